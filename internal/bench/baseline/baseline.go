// Package baseline is what stopgate's benchmarks compare a guarded request
// with: github.com/elazarl/goproxy at the version stopgate uses, configured
// as stopgate's proxy.New configures it, minus the guard. It is written once
// here so that the plain-goproxy command (make bench) and the in-process
// benchmarks measure the same baseline. It is not a product.
package baseline

import (
	"crypto/tls"
	"log"
	"net"
	"time"

	"github.com/elazarl/goproxy"

	"github.com/stopgate/stopgate/proxy"
)

// Goproxy is goproxy as stopgate's proxy.New configures it, minus the
// guard: stopgate's upstream transport (proxy.UpstreamTransport, with a
// plain dialer), Accept-Encoding kept, and, with a CA, every CONNECT
// intercepted with leaf certificates cached per host (with none, CONNECT is
// goproxy's default tunnel). logger takes goproxy's own lines.
func Goproxy(ca *tls.Certificate, logger *log.Logger) *goproxy.ProxyHttpServer {
	dialer := &net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}
	gp := goproxy.NewProxyHttpServer()
	gp.Tr = proxy.UpstreamTransport(dialer.DialContext, nil, 10*time.Second)
	gp.ConnectDial = nil
	gp.ConnectDialWithReq = nil
	gp.KeepAcceptEncoding = true
	gp.Logger = logger
	if ca != nil {
		gp.CertStore = &proxy.CertCache{}
		gp.OnRequest().HandleConnectFunc(func(host string, _ *goproxy.ProxyCtx) (*goproxy.ConnectAction, string) {
			return &goproxy.ConnectAction{Action: goproxy.ConnectMitm, TLSConfig: goproxy.TLSConfigFromCA(ca)}, host
		})
	}
	return gp
}
