package redisserver

import (
	"crypto/ecdsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/stopgate/stopgate/proxy"
)

// TLSFiles are a CA and a certificate for 127.0.0.1 it signed, in the files
// redis-server reads (--tls-ca-cert-file, --tls-cert-file, --tls-key-file).
// Every server of a test given the same files trusts the others: a
// Sentinel its master, a cluster node its peers.
type TLSFiles struct {
	CA, Cert, Key string
	// Pool trusts the CA, for a client that verifies what it is given.
	Pool *x509.CertPool
}

// MakeTLS makes the files in a temporary directory of t, with stopgate's
// own CA code (the egress proxy's CA and one of its leaves).
func MakeTLS(t testing.TB) *TLSFiles {
	t.Helper()
	fail := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("redisserver: TLS files: %v", err)
		}
	}
	dir := t.TempDir()
	ca, err := proxy.LoadOrCreateCA(dir)
	fail(err)
	leaf, err := ca.Leaf("127.0.0.1")
	fail(err)
	keyDER, err := x509.MarshalECPrivateKey(leaf.PrivateKey.(*ecdsa.PrivateKey))
	fail(err)
	var chain []byte
	for _, der := range leaf.Certificate {
		chain = append(chain, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})...)
	}
	f := &TLSFiles{CA: filepath.Join(dir, "ca.pem"), Cert: filepath.Join(dir, "server.crt"), Key: filepath.Join(dir, "server.key"), Pool: x509.NewCertPool()}
	f.Pool.AddCert(ca.Cert.Leaf)
	fail(os.WriteFile(f.Cert, chain, 0o600))
	fail(os.WriteFile(f.Key, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600))
	return f
}

// args make a server speak TLS alone on port: no plain port, replication
// and the cluster bus over TLS too, clients not asked for a certificate.
func (f *TLSFiles) args(port int) []string {
	return []string{"--port", "0", "--tls-port", strconv.Itoa(port), "--tls-cert-file", f.Cert, "--tls-key-file", f.Key,
		"--tls-ca-cert-file", f.CA, "--tls-auth-clients", "no", "--tls-replication", "yes", "--tls-cluster", "yes"}
}

// clientConfig is what the harness's own PING trusts.
func (f *TLSFiles) clientConfig() *tls.Config {
	return &tls.Config{RootCAs: f.Pool, ServerName: "127.0.0.1", MinVersion: tls.VersionTLS12}
}
