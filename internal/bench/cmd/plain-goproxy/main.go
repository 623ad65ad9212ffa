// Command plain-goproxy is the benchmark's baseline: github.com/elazarl/goproxy
// at the version stopgate uses, with the upstream transport stopgate's
// proxy builds (proxy.New) and the same listener bounds, intercepting HTTPS
// with a CA of its own, and no guard at all. It is what a guarded request
// is compared against; it is not a product.
//
//	plain-goproxy -addr 127.0.0.1:0 -ca-out ca.pem
//
// prints "listening HOST:PORT" on its first line once it accepts
// connections, and serves until SIGINT or SIGTERM.
package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/elazarl/goproxy"
)

func main() {
	if err := run(os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "plain-goproxy:", err)
		os.Exit(1)
	}
}

func run(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("plain-goproxy", flag.ContinueOnError)
	addr := fs.String("addr", "127.0.0.1:0", "listen address")
	caOut := fs.String("ca-out", "", "file to write the interception CA certificate (PEM) to")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *caOut == "" {
		return errors.New("-ca-out is required: clients must trust the CA")
	}
	ca, caPEM, err := newCA()
	if err != nil {
		return err
	}
	if err := os.WriteFile(*caOut, caPEM, 0o644); err != nil {
		return fmt.Errorf("-ca-out: %w", err)
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		return fmt.Errorf("-addr: %w", err)
	}
	srv := &http.Server{
		Handler: newProxy(ca),
		// stopgate serve's bounds for its proxy listener.
		ReadHeaderTimeout: 5 * time.Second,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          log.New(os.Stderr, "plain-goproxy: ", 0),
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	fmt.Fprintf(stdout, "listening %s\n", ln.Addr())
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// newProxy is goproxy configured as stopgate's proxy.New configures it,
// minus the guard: the same transport settings, no proxy from the
// environment, Accept-Encoding kept, leaf certificates cached per host, and
// every CONNECT intercepted.
func newProxy(ca *tls.Certificate) *goproxy.ProxyHttpServer {
	dialer := &net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}
	tr := &http.Transport{
		Proxy:                 nil,
		DialContext:           dialer.DialContext,
		TLSClientConfig:       &tls.Config{MinVersion: tls.VersionTLS12},
		TLSHandshakeTimeout:   10 * time.Second,
		MaxIdleConns:          512,
		MaxIdleConnsPerHost:   64,
		IdleConnTimeout:       90 * time.Second,
		ExpectContinueTimeout: time.Second,
		DisableCompression:    true,
		TLSNextProto:          map[string]func(string, *tls.Conn) http.RoundTripper{},
	}
	gp := goproxy.NewProxyHttpServer()
	gp.Tr = tr
	gp.ConnectDial = nil
	gp.ConnectDialWithReq = nil
	gp.KeepAcceptEncoding = true
	gp.Logger = log.New(os.Stderr, "plain-goproxy: ", 0)
	gp.CertStore = &certCache{}
	gp.OnRequest().HandleConnectFunc(func(host string, _ *goproxy.ProxyCtx) (*goproxy.ConnectAction, string) {
		return &goproxy.ConnectAction{Action: goproxy.ConnectMitm, TLSConfig: goproxy.TLSConfigFromCA(ca)}, host
	})
	return gp
}

// newCA makes an ECDSA P-256 CA, as stopgate makes its own.
func newCA() (*tls.Certificate, []byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("CA key: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(time.Now().UnixNano()),
		Subject:               pkix.Name{CommonName: "plain-goproxy baseline CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, fmt.Errorf("CA certificate: %w", err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, fmt.Errorf("CA key: %w", err)
	}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	cert, err := tls.X509KeyPair(certPEM, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}))
	if err != nil {
		return nil, nil, fmt.Errorf("CA key pair: %w", err)
	}
	if cert.Leaf, err = x509.ParseCertificate(der); err != nil {
		return nil, nil, fmt.Errorf("CA certificate: %w", err)
	}
	return &cert, certPEM, nil
}

// certCache keeps one leaf per host, as stopgate's does.
type certCache struct {
	mu    sync.Mutex
	certs map[string]*tls.Certificate
}

func (c *certCache) Fetch(host string, gen func() (*tls.Certificate, error)) (*tls.Certificate, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if cert, ok := c.certs[host]; ok {
		return cert, nil
	}
	cert, err := gen()
	if err != nil {
		return nil, err
	}
	if c.certs == nil {
		c.certs = map[string]*tls.Certificate{}
	}
	c.certs[host] = cert
	return cert, nil
}
