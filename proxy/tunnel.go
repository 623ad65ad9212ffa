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

	"github.com/elazarl/goproxy"

	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/state"
)

// handleConnect decides what a CONNECT becomes. Pass-through hosts are
// guarded here, one intent per tunnel; every other host is intercepted and
// each request inside is guarded on its own, carrying the CONNECT's
// identity for requests that bring none of their own.
func (p *Proxy) handleConnect(host string, pctx *goproxy.ProxyCtx) (*goproxy.ConnectAction, string) {
	req := pctx.Req
	if !p.cfg.PassThrough.Match(host) {
		if p.cfg.CA == nil {
			pctx.Resp = refusal(req, http.StatusForbidden, "interception_disabled", map[string]any{
				"message": "this proxy has no CA to intercept " + host + " and it is not a pass-through host",
			})
			return &goproxy.ConnectAction{Action: goproxy.ConnectReject}, host
		}
		id, err := identify(req.Header, p.boundRun(req), p.tokens)
		switch {
		case err == nil:
			pctx.UserData = id
		case errors.Is(err, errNoIdentity):
			// Requests inside may name their run with X-Run-ID.
		default:
			pctx.Resp = p.identityError(req, err)
			return &goproxy.ConnectAction{Action: goproxy.ConnectReject}, host
		}
		return &goproxy.ConnectAction{Action: goproxy.ConnectMitm, TLSConfig: goproxy.TLSConfigFromCA(&p.cfg.CA.Cert)}, host
	}

	id, err := identify(req.Header, p.boundRun(req), p.tokens)
	if err != nil {
		pctx.Resp = p.identityError(req, err)
		return &goproxy.ConnectAction{Action: goproxy.ConnectReject}, host
	}
	allow := p.cfg.Delivery.Match(host)
	res, err := p.cfg.Ledger.Begin(req.Context(), state.GuardRequest{
		RunID: id.run, ObservedVersion: id.version, Key: intents.DerivedKey(id.run, http.MethodConnect, host, ""),
		Boundary: state.BoundaryTunnel, Method: http.MethodConnect, Target: host,
		AutoAdmit: p.cfg.AutoAdmit, AllowCancelling: allow,
	})
	if err != nil {
		p.stats.Unavailable.Add(1)
		pctx.Resp = refusal(req, http.StatusServiceUnavailable, "store_unavailable", map[string]any{
			"run_id": id.run, "message": "the run state store did not answer in time; no tunnel was opened (fail closed): " + err.Error(),
		})
		return &goproxy.ConnectAction{Action: goproxy.ConnectReject}, host
	}
	if !res.Admitted {
		p.stats.Refused.Add(1)
		pctx.Resp = guardRefusal(req, id, res)
		return &goproxy.ConnectAction{Action: goproxy.ConnectReject}, host
	}
	f := &flow{id: id, intent: res.Intent, method: http.MethodConnect, allowCancelling: allow, tunnel: true}
	return &goproxy.ConnectAction{Action: goproxy.ConnectHijack, Hijack: func(req *http.Request, client net.Conn, _ *goproxy.ProxyCtx) {
		p.tunnel(req, client, host, f)
	}}, host
}

// tunnel carries a pass-through CONNECT, unseen, until either side closes or
// the run's cancel cuts it.
func (p *Proxy) tunnel(req *http.Request, client net.Conn, host string, f *flow) {
	defer client.Close()
	// Values only (a transparent connection's dial pin): the tunnel outlives the CONNECT.
	ctx, cut := context.WithCancelCause(context.WithoutCancel(req.Context()))
	defer cut(nil)
	f.cut = cut
	p.flows.add(f)
	defer p.flows.remove(f)

	dctx, cancel := context.WithTimeout(ctx, p.cfg.DialTimeout)
	upstream, err := p.dial(dctx, "tcp", host)
	cancel()
	if err != nil {
		p.finish(ctx, f, state.IntentNotSent, 0, "dial: "+err.Error())
		resp := refusal(req, http.StatusBadGateway, "upstream_failed", map[string]any{
			"run_id": f.id.run, "intent": f.intent.Key, "recorded": state.IntentNotSent, "message": err.Error(),
		}, f.intent.Key)
		_ = resp.Write(client)
		return
	}
	defer upstream.Close()
	if _, err := fmt.Fprintf(client, "HTTP/1.1 200 Connection established\r\n%s: %s\r\n\r\n", HeaderIntent, f.intent.Key); err != nil {
		p.finish(ctx, f, state.IntentNotSent, 0, "client gone before the tunnel opened")
		return
	}
	p.stats.Forwarded.Add(1)

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
		p.finish(ctx, f, state.IntentResponded, 0, "tunnel_closed")
	case <-ctx.Done():
		_ = client.Close()
		_ = upstream.Close()
		<-copied
		p.stats.Cut.Add(1)
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
		p.finish(ctx, f, outcome, 0, reason)
	}
}

func (p *Proxy) finish(ctx context.Context, f *flow, outcome state.IntentState, code int, reason string) {
	if _, err := p.cfg.Ledger.Finish(ctx, f.intent, outcome, code, truncate(reason, 512)); err != nil {
		p.log.Warn("outcome not recorded; the lease will expire into UNKNOWN", "run", f.id.run, "intent", f.intent.Key, "err", err)
	}
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
		return
	}
	_ = c.Close()
}
