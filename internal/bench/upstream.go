package bench

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"time"
)

// maxStream bounds how long the upstream holds an event stream open, so
// that nothing waits forever if a cut never comes.
const maxStream = 30 * time.Second

// upstream is the loopback provider every case reaches: the same handler
// over plain HTTP, over HTTPS, and over HTTPS on a second port that the
// stopgate policy tunnels unseen (pass-through).
type upstream struct {
	HTTPURL  string // http://127.0.0.1:P
	HTTPSURL string // https://127.0.0.1:P, intercepted by the proxies
	// TunnelURL is https://127.0.0.1:P on the pass-through port.
	TunnelURL string
	// CertFile holds the upstream's self-signed certificate (PEM): the
	// proxies trust it through SSL_CERT_FILE, the direct client through Roots.
	CertFile string
	Roots    *x509.CertPool
	servers  []*http.Server
}

// startUpstream serves the upstream on three loopback ports; its
// certificate is written into dir.
func startUpstream(dir string) (*upstream, error) {
	cert, certPEM, err := selfSignedCert()
	if err != nil {
		return nil, err
	}
	u := &upstream{CertFile: filepath.Join(dir, "upstream.pem"), Roots: x509.NewCertPool()}
	if err := os.WriteFile(u.CertFile, certPEM, 0o644); err != nil {
		return nil, fmt.Errorf("upstream certificate: %w", err)
	}
	u.Roots.AppendCertsFromPEM(certPEM)
	mux := http.NewServeMux()
	mux.HandleFunc("/small", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Content-Length", "2")
		_, _ = io.WriteString(w, "ok")
	})
	mux.HandleFunc("/sse", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		_, _ = io.WriteString(w, "data: open\n\n")
		http.NewResponseController(w).Flush()
		select {
		case <-r.Context().Done():
		case <-time.After(maxStream):
		}
	})
	tlsCfg := &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"http/1.1"}}
	for i, url := range []*string{&u.HTTPURL, &u.HTTPSURL, &u.TunnelURL} {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			u.close()
			return nil, fmt.Errorf("upstream listener: %w", err)
		}
		srv := &http.Server{
			Handler:           mux,
			ReadHeaderTimeout: 5 * time.Second,
			ErrorLog:          log.New(io.Discard, "", 0),
			// HTTP/1.1 only, as the proxies speak upstream.
			TLSNextProto: map[string]func(*http.Server, *tls.Conn, http.Handler){},
		}
		u.servers = append(u.servers, srv)
		if i == 0 {
			*url = "http://" + ln.Addr().String()
			go func() { _ = srv.Serve(ln) }()
			continue
		}
		*url = "https://" + ln.Addr().String()
		go func() { _ = srv.Serve(tls.NewListener(ln, tlsCfg)) }()
	}
	return u, nil
}

func (u *upstream) close() {
	for _, s := range u.servers {
		_ = s.Close()
	}
}

// selfSignedCert is a certificate for 127.0.0.1 and localhost that is its
// own root.
func selfSignedCert() (tls.Certificate, []byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, nil, fmt.Errorf("upstream key: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(time.Now().UnixNano()),
		Subject:               pkix.Name{CommonName: "stopgate-bench upstream"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1)},
		DNSNames:              []string{"localhost"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, nil, fmt.Errorf("upstream certificate: %w", err)
	}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return tls.Certificate{}, nil, fmt.Errorf("upstream key: %w", err)
	}
	cert, err := tls.X509KeyPair(certPEM, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}))
	if err != nil {
		return tls.Certificate{}, nil, errors.Join(errors.New("upstream key pair"), err)
	}
	return cert, certPEM, nil
}
