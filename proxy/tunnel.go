package proxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/elazarl/goproxy"

	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
)

// handleConnect decides what a CONNECT becomes. Pass-through hosts are
// guarded here, one intent per tunnel; every other host is intercepted and
// each request inside is guarded on its own, carrying the CONNECT's
// identity for requests that bring none of their own.
func (p *Proxy) handleConnect(host string, pctx *goproxy.ProxyCtx) (*goproxy.ConnectAction, string) {
	req := pctx.Req
	ex := &exchange{start: time.Now()}
	pctx.UserData = ex
	reject := func(boundary state.Boundary, r *refusal.Refusal) (*goproxy.ConnectAction, string) {
		pctx.Resp = p.refuse(req, ex, boundary, r)
		return &goproxy.ConnectAction{Action: goproxy.ConnectReject}, host
	}
	id, err := identify(req.Header, p.boundRun(req), p.tokens)
	if !p.cfg.PassThrough.Match(host) {
		if p.cfg.CA == nil {
			return reject(state.BoundaryHTTP, refusal.New(refusal.InterceptionDisabled,
				"this proxy has no CA to intercept %s and it is not a pass-through host", host))
		}
		switch {
		case err == nil:
			ex.id, ex.hasID = id, true
		case errors.Is(err, errNoIdentity):
			// Requests inside may name their run with X-Run-ID.
		default:
			return reject(state.BoundaryHTTP, identityRefusal(err))
		}
		return &goproxy.ConnectAction{Action: goproxy.ConnectMitm, TLSConfig: goproxy.TLSConfigFromCA(&p.cfg.CA.Cert)}, host
	}

	if err != nil {
		return reject(state.BoundaryTunnel, identityRefusal(err))
	}
	ex.id, ex.hasID = id, true
	allow := p.cfg.Delivery.Match(host)
	greq := state.GuardRequest{
		RunID: id.run, ObservedVersion: id.version, Key: intents.DerivedKey(id.run, http.MethodConnect, host, ""),
		Boundary: state.BoundaryTunnel, Method: http.MethodConnect, Target: host,
		AutoAdmit: p.cfg.AutoAdmit, AllowCancelling: allow,
	}
	if r := p.guard(req, ex, greq); r != nil {
		return reject(state.BoundaryTunnel, r)
	}
	return &goproxy.ConnectAction{Action: goproxy.ConnectHijack, Hijack: func(req *http.Request, client net.Conn, _ *goproxy.ProxyCtx) {
		p.tunnel(req, client, host, ex)
	}}, host
}

// tunnel carries a pass-through CONNECT, unseen, until either side closes or
// the run's cancel cuts it.
func (p *Proxy) tunnel(req *http.Request, client net.Conn, host string, ex *exchange) {
	defer client.Close()
	f := ex.flow
	// Values only (a transparent connection's dial pin): the tunnel outlives the CONNECT.
	ctx, cut := context.WithCancelCause(context.WithoutCancel(req.Context()))
	defer cut(nil)
	ex.ctx, f.cut = ctx, cut
	p.flows.add(f)
	defer p.flows.remove(f)

	dctx, cancel := context.WithTimeout(ctx, p.cfg.DialTimeout)
	upstream, err := p.dial(dctx, "tcp", host)
	cancel()
	if err != nil {
		p.finish(ctx, ex, state.IntentNotSent, 0, "dial: "+err.Error())
		r := refusal.Wrap(err, refusal.UpstreamFailed, "cannot reach %s: %v; recorded %s", host, err, state.IntentNotSent)
		r.RunID, r.ObservedVersion, r.Intent, r.Recorded = f.id.run, f.id.version, f.intent.Key, state.IntentNotSent
		_ = r.Response(req).Write(client)
		return
	}
	defer upstream.Close()
	if _, err := fmt.Fprintf(client, "HTTP/1.1 200 Connection established\r\n%s: %s\r\n\r\n", refusal.IntentHeader, f.intent.Key); err != nil {
		p.finish(ctx, ex, state.IntentNotSent, 0, "client gone before the tunnel opened")
		return
	}

	var sent atomic.Int64
	var wg sync.WaitGroup
	wg.Go(func() {
		n, _ := io.Copy(upstream, client)
		sent.Add(n)
		closeWrite(upstream)
	})
	wg.Go(func() {
		_, _ = io.Copy(client, upstream)
		closeWrite(client)
	})
	// Either the copies end on their own, or a cut closes both sides.
	copied := make(chan struct{})
	go func() { wg.Wait(); close(copied) }()
	select {
	case <-copied:
		p.finish(ctx, ex, state.IntentResponded, 0, "tunnel_closed")
	case <-ctx.Done():
		_ = client.Close()
		_ = upstream.Close()
		<-copied
		reason := "cut"
		var ce *cutError
		if errors.As(context.Cause(ctx), &ce) {
			reason = ce.reason
		}
		outcome := state.IntentNotSent
		if sent.Load() > 0 {
			// Bytes went upstream through a tunnel we cannot see into.
			outcome = state.IntentUnknown
		}
		p.finish(ctx, ex, outcome, 0, reason)
	}
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
		return
	}
	_ = c.Close()
}
