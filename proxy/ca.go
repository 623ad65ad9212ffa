package proxy

import (
	"cmp"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	lru "github.com/hashicorp/golang-lru/v2"
)

// CA is the certificate authority the proxy signs intercepted hosts with.
// Workers trust it through SSL_CERT_FILE, REQUESTS_CA_BUNDLE or
// NODE_EXTRA_CA_CERTS; its key never leaves the data directory (mode 0600).
type CA struct {
	Cert tls.Certificate
	// PEM is the CA certificate alone, as workers install it.
	PEM []byte
}

// CA file names inside the data directory.
const (
	caCertFile = "ca.pem"
	caKeyFile  = "ca-key.pem"
)

// LoadOrCreateCA reads the CA from dir, or creates one there on first start.
// A half-present CA (a certificate without its key, or the reverse) is an
// error rather than a silent replacement: workers already trust the old one.
func LoadOrCreateCA(dir string) (*CA, error) {
	certPath, keyPath := filepath.Join(dir, caCertFile), filepath.Join(dir, caKeyFile)
	certPEM, certErr := os.ReadFile(certPath)
	keyPEM, keyErr := os.ReadFile(keyPath)
	switch {
	case certErr == nil && keyErr == nil:
		return parseCA(certPEM, keyPEM, certPath, keyPath)
	case errors.Is(certErr, fs.ErrNotExist) && errors.Is(keyErr, fs.ErrNotExist):
		return createCA(dir, certPath, keyPath)
	case certErr != nil && !errors.Is(certErr, fs.ErrNotExist):
		return nil, fmt.Errorf("read CA certificate: %w", certErr)
	case keyErr != nil && !errors.Is(keyErr, fs.ErrNotExist):
		return nil, fmt.Errorf("read CA key: %w", keyErr)
	default:
		return nil, fmt.Errorf("CA in %s is incomplete: need both %s and %s (remove both to create a new CA, then redistribute it to workers)", dir, caCertFile, caKeyFile)
	}
}

// LoadCA reads an operator-provided CA from two files, for a fleet whose
// instances must all sign with one CA (a Kubernetes Secret, say), so that a
// worker trusts one certificate wherever its sidecar runs. Nothing is
// created: a missing or unreadable file is an error. The key must not be
// readable by others: mode 0600 or 0400, or, when root owns it, 0640 or
// 0440 (what a Kubernetes Secret volume with an fsGroup gives, and how
// Debian's ssl-cert group shares keys): its group is then an
// administrator's choice, not an accident of umask.
func LoadCA(certFile, keyFile string) (*CA, error) {
	if certFile == "" || keyFile == "" {
		return nil, errors.New("a CA from files needs both the certificate and the key")
	}
	info, err := os.Stat(keyFile)
	if err != nil {
		return nil, fmt.Errorf("CA key: %w", err)
	}
	if err := checkKeyMode(info); err != nil {
		return nil, fmt.Errorf("CA key %s: %w", keyFile, err)
	}
	certPEM, err := os.ReadFile(certFile)
	if err != nil {
		return nil, fmt.Errorf("CA certificate: %w", err)
	}
	if err := certificatesOnly(certPEM); err != nil {
		return nil, fmt.Errorf("CA certificate %s: %w", certFile, err)
	}
	keyPEM, err := os.ReadFile(keyFile)
	if err != nil {
		return nil, fmt.Errorf("CA key: %w", err)
	}
	return parsePair(certPEM, keyPEM, certFile, keyFile)
}

// certificatesOnly refuses a certificate file that holds anything but
// certificates: that file is served on /v1/ca and mounted into workers, so
// a key pasted into it would be handed to the least trusted party.
func certificatesOnly(certPEM []byte) error {
	rest := certPEM
	for {
		var block *pem.Block
		block, rest = pem.Decode(rest)
		if block == nil {
			return nil
		}
		if block.Type != "CERTIFICATE" {
			return fmt.Errorf("holds a %q block: it is given to every worker, so it may hold certificates only (keep the key in its own file)", block.Type)
		}
	}
}

// checkKeyMode is LoadCA's rule for the key file's permissions.
func checkKeyMode(info fs.FileInfo) error {
	perm := info.Mode().Perm()
	switch {
	case !info.Mode().IsRegular():
		return errors.New("is not a regular file")
	case perm&0o077 == 0:
		return nil
	case perm&0o037 == 0 && ownedByRoot(info):
		return nil
	}
	return fmt.Errorf("has mode %#o: it must not be readable by others: chmod 600 (or 400); a key root owns may be group-readable (640, 440)", perm)
}

func parseCA(certPEM, keyPEM []byte, certPath, keyPath string) (*CA, error) {
	if info, err := os.Stat(keyPath); err == nil && info.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("CA key %s has mode %v: it must be readable by its owner only (chmod 600)", keyPath, info.Mode().Perm())
	}
	return parsePair(certPEM, keyPEM, certPath, keyPath)
}

// parsePair checks that the certificate and the key belong together and
// that the certificate may sign others.
func parsePair(certPEM, keyPEM []byte, certPath, keyPath string) (*CA, error) {
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("CA in %s and %s: %w", certPath, keyPath, err)
	}
	leaf, err := x509.ParseCertificate(cert.Certificate[0])
	if err != nil {
		return nil, fmt.Errorf("CA certificate %s: %w", certPath, err)
	}
	if !leaf.IsCA {
		return nil, fmt.Errorf("CA certificate %s is not a CA certificate", certPath)
	}
	cert.Leaf = leaf
	return &CA{Cert: cert, PEM: certPEM}, nil
}

func createCA(dir, certPath, keyPath string) (*CA, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create data directory: %w", err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate CA key: %w", err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("CA serial: %w", err)
	}
	host, _ := os.Hostname()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: "stopgate egress CA " + host, Organization: []string{"stopgate"}},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().AddDate(10, 0, 0),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("create CA certificate: %w", err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("encode CA key: %w", err)
	}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})
	// Key first, so that a crash in between leaves a state LoadOrCreateCA reports.
	if err := writeFileSync(keyPath, keyPEM, 0o600); err != nil {
		return nil, fmt.Errorf("write CA key: %w", err)
	}
	if err := writeFileSync(certPath, certPEM, 0o644); err != nil {
		return nil, fmt.Errorf("write CA certificate: %w", err)
	}
	return parseCA(certPEM, keyPEM, certPath, keyPath)
}

func writeFileSync(path string, data []byte, mode os.FileMode) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		_ = f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

// DefaultCertCacheSize is how many leaves a CertCache keeps when its Size
// is zero: one per host an agent names, and an agent may name any number.
const DefaultCertCacheSize = 4096

// leafRenewBefore is how long before its expiry a cached leaf is minted
// anew, so that no handshake is answered with a leaf about to lapse.
const leafRenewBefore = time.Hour

// CertCache keeps the leaves minted for intercepted hosts, so that a worker
// that opens many tunnels to one host does not cost a key generation each
// time: the Size most recently used, each until an hour before it expires.
// A miss mints outside the lock, so that one host's mint never waits for
// another's; misses for the same host at once mint once and share it. A
// failed mint is not kept. It is goproxy's CertStore for every
// intercepting proxy here (the benchmark's baseline uses it too, so both
// mint alike). The zero value is ready.
type CertCache struct {
	// Size bounds the leaves kept (DefaultCertCacheSize when zero).
	Size int
	// Now is the clock leaves expire by (time.Now when nil).
	Now func() time.Time

	once    sync.Once
	leaves  *lru.Cache[string, *tls.Certificate]
	mu      sync.Mutex
	minting map[string]*mint
}

// mint is one host's mint in progress, which misses of the host wait for.
type mint struct {
	done chan struct{}
	cert *tls.Certificate
	err  error
}

func (c *CertCache) init() {
	leaves, err := lru.New[string, *tls.Certificate](cmp.Or(c.Size, DefaultCertCacheSize))
	if err != nil {
		panic(err) // only for a negative Size
	}
	c.leaves, c.minting = leaves, map[string]*mint{}
	if c.Now == nil {
		c.Now = time.Now
	}
}

// Fetch returns host's leaf, minting it with gen when none is kept or the
// one kept is about to expire.
func (c *CertCache) Fetch(host string, gen func() (*tls.Certificate, error)) (*tls.Certificate, error) {
	c.once.Do(c.init)
	if cert, ok := c.fresh(host); ok {
		return cert, nil
	}
	c.mu.Lock()
	if m, ok := c.minting[host]; ok {
		c.mu.Unlock()
		<-m.done
		return m.cert, m.err
	}
	// A mint of host may have ended between the look and the lock.
	if cert, ok := c.fresh(host); ok {
		c.mu.Unlock()
		return cert, nil
	}
	m := &mint{done: make(chan struct{})}
	c.minting[host] = m
	c.mu.Unlock()

	m.cert, m.err = gen()
	if m.err == nil {
		c.leaves.Add(host, m.cert)
	}
	c.mu.Lock()
	delete(c.minting, host)
	c.mu.Unlock()
	close(m.done)
	return m.cert, m.err
}

// fresh is host's kept leaf, if it has one that is not about to expire.
func (c *CertCache) fresh(host string) (*tls.Certificate, bool) {
	cert, ok := c.leaves.Get(host)
	if !ok || cert.Leaf == nil || !c.Now().Add(leafRenewBefore).Before(cert.Leaf.NotAfter) {
		return nil, false
	}
	return cert, true
}

// leafLifetime is how long a minted leaf is good for; the cache mints a
// new one when it expires.
const leafLifetime = 30 * 24 * time.Hour

// Leaf mints a certificate for host (a name or an IP address, without a
// port) signed by the CA: what an intercepted connection to host is
// answered with. Its subject names stopgate, so that whoever inspects the
// certificate a worker got (openssl s_client, a browser) sees who is in
// the middle.
func (ca *CA) Leaf(host string) (*tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("mint a certificate for %s: %w", host, err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("mint a certificate for %s: %w", host, err)
	}
	now := time.Now()
	notAfter := now.Add(leafLifetime)
	if ca.Cert.Leaf.NotAfter.Before(notAfter) {
		notAfter = ca.Cert.Leaf.NotAfter
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject: pkix.Name{
			CommonName: host, Organization: []string{"stopgate"},
			OrganizationalUnit: []string{"stopgate egress proxy: intercepted, guarded and recorded"},
		},
		NotBefore:   now.Add(-time.Hour),
		NotAfter:    notAfter,
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	if ip := net.ParseIP(host); ip != nil {
		tmpl.IPAddresses = []net.IP{ip}
	} else {
		tmpl.DNSNames = []string{host}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert.Leaf, &key.PublicKey, ca.Cert.PrivateKey)
	if err != nil {
		return nil, fmt.Errorf("mint a certificate for %s: %w", host, err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("mint a certificate for %s: %w", host, err)
	}
	return &tls.Certificate{Certificate: [][]byte{der, ca.Cert.Leaf.Raw}, PrivateKey: key, Leaf: leaf}, nil
}
