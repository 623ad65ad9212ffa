package proxy_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/proxy"
)

// fleetCA makes a CA the way an operator would hand it to a fleet: a
// certificate file and a key file, the key with the given mode.
func fleetCA(t *testing.T, keyMode os.FileMode) (certFile, keyFile string) {
	t.Helper()
	dir := t.TempDir()
	if _, err := proxy.LoadOrCreateCA(dir); err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(dir, "ca.pem"), filepath.Join(dir, "ca-key.pem")
	if err := os.Chmod(keyFile, keyMode); err != nil {
		t.Fatal(err)
	}
	return certFile, keyFile
}

func TestLoadCAFromOperatorFiles(t *testing.T) {
	for _, mode := range []os.FileMode{0o600, 0o400} {
		certFile, keyFile := fleetCA(t, mode)
		ca, err := proxy.LoadCA(certFile, keyFile)
		if err != nil {
			t.Fatalf("key mode %#o: %v", mode, err)
		}
		want, _ := os.ReadFile(certFile)
		if string(ca.PEM) != string(want) || ca.Cert.Leaf == nil || !ca.Cert.Leaf.IsCA {
			t.Fatalf("key mode %#o: the CA served to workers is not the certificate file: %q", mode, ca.PEM)
		}
	}
	// Nothing is created beside them: the operator's files are the CA.
	certFile, keyFile := fleetCA(t, 0o600)
	before, _ := os.ReadDir(filepath.Dir(certFile))
	if _, err := proxy.LoadCA(certFile, keyFile); err != nil {
		t.Fatal(err)
	}
	if after, _ := os.ReadDir(filepath.Dir(certFile)); len(after) != len(before) {
		t.Fatalf("LoadCA wrote files: %d before, %d after", len(before), len(after))
	}
}

// A Kubernetes Secret volume with an fsGroup mounts a key 0440, owned by
// root and group-readable by the pod's group; a key a user owns must not
// be readable by its group.
func TestLoadCAAcceptsGroupReadableKeyOnlyWhenRootOwnsIt(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to give the key file to root and to another user")
	}
	certFile, keyFile := fleetCA(t, 0o440)
	if err := os.Chown(keyFile, 0, 10001); err != nil {
		t.Fatal(err)
	}
	if _, err := proxy.LoadCA(certFile, keyFile); err != nil {
		t.Fatalf("root-owned 0440 key: %v", err)
	}
	if err := os.Chown(keyFile, 10001, 10001); err != nil {
		t.Fatal(err)
	}
	if _, err := proxy.LoadCA(certFile, keyFile); err == nil || !strings.Contains(err.Error(), "chmod 600") {
		t.Fatalf("a group-readable key owned by uid 10001 was accepted: %v", err)
	}
}

func TestLoadCARefusesWhatWouldLeakOrMislead(t *testing.T) {
	certFile, keyFile := fleetCA(t, 0o600)
	otherCert, otherKey := fleetCA(t, 0o600)
	worldReadable := func() string {
		_, k := fleetCA(t, 0o644)
		return k
	}()
	groupWritable := func() string {
		_, k := fleetCA(t, 0o660)
		return k
	}()
	keyPEM, _ := os.ReadFile(keyFile)
	certPEM, _ := os.ReadFile(certFile)
	bundled := filepath.Join(t.TempDir(), "bundle.pem")
	if err := os.WriteFile(bundled, append(append([]byte{}, certPEM...), keyPEM...), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, cert, key, want string
	}{
		{"world-readable key", certFile, worldReadable, "chmod 600"},
		{"group-writable key", certFile, groupWritable, "chmod 600"},
		{"key in the certificate file", bundled, keyFile, "may hold certificates only"},
		{"certificate and key of different CAs", certFile, otherKey, "private key does not match"},
		{"missing certificate", filepath.Join(t.TempDir(), "none.pem"), keyFile, "no such file"},
		{"missing key", otherCert, filepath.Join(t.TempDir(), "none.pem"), "no such file"},
		{"key is a directory", certFile, t.TempDir(), "not a regular file"},
		{"no key named", certFile, "", "needs both"},
	} {
		_, err := proxy.LoadCA(tc.cert, tc.key)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: got %v, want an error containing %q", tc.name, err, tc.want)
		}
	}
}

func TestLoadCARefusesALeafCertificate(t *testing.T) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(7), Subject: pkix.Name{CommonName: "not a CA"}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, _ := x509.MarshalECPrivateKey(key)
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "leaf.pem"), filepath.Join(dir, "leaf-key.pem")
	_ = os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
	_ = os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600)
	if _, err := proxy.LoadCA(certFile, keyFile); err == nil || !strings.Contains(err.Error(), "not a CA certificate") {
		t.Fatalf("got %v, want a refusal of a certificate that may not sign", err)
	}
}

// TestMintedLeafNamesStopgate: the certificate an intercepted connection
// is answered with verifies against the CA for the host (a name or an IP
// address) and names stopgate as its organization, not the proxy library
// it is built on.
func TestMintedLeafNamesStopgate(t *testing.T) {
	ca, err := proxy.LoadOrCreateCA(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca.PEM)
	for _, host := range []string{"api.example.com", "127.0.0.1", "::1"} {
		cert, err := ca.Leaf(host)
		if err != nil {
			t.Fatal(err)
		}
		leaf := cert.Leaf
		if _, err := leaf.Verify(x509.VerifyOptions{DNSName: host, Roots: roots}); err != nil {
			t.Errorf("%s: the leaf does not verify: %v", host, err)
		}
		if got := leaf.Subject.String(); !strings.Contains(got, "O=stopgate") || strings.Contains(got, "GoProxy") || leaf.Subject.CommonName != host {
			t.Errorf("%s: subject %q", host, got)
		}
		if leaf.NotAfter.After(time.Now().Add(31 * 24 * time.Hour)) {
			t.Errorf("%s: good until %s", host, leaf.NotAfter)
		}
	}
}
