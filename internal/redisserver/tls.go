package redisserver

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"
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

// MakeTLS makes a CA and a server certificate for 127.0.0.1 in a temporary
// directory of t.
func MakeTLS(t testing.TB) *TLSFiles {
	t.Helper()
	dir := t.TempDir()
	fail := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("redisserver: TLS files: %v", err)
		}
	}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	fail(err)
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "redisserver test CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true, IsCA: true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	fail(err)
	ca, err := x509.ParseCertificate(caDER)
	fail(err)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	fail(err)
	der, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "127.0.0.1"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, DNSNames: []string{"localhost"},
	}, ca, &key.PublicKey, caKey)
	fail(err)
	keyDER, err := x509.MarshalECPrivateKey(key)
	fail(err)
	f := &TLSFiles{CA: filepath.Join(dir, "ca.crt"), Cert: filepath.Join(dir, "server.crt"), Key: filepath.Join(dir, "server.key"), Pool: x509.NewCertPool()}
	f.Pool.AddCert(ca)
	fail(os.WriteFile(f.CA, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), 0o600))
	fail(os.WriteFile(f.Cert, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600))
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
