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
// identity for requests that bring none of their own. Either way the
// destination is checked here, before any guard, so that a client learns
// at the CONNECT, where it can read the answer, that it may not go there.
func (p *Proxy) handleConnect(host string, pctx *goproxy.ProxyCtx) (*goproxy.ConnectAction, string) {
	req := pctx.Req
	ex := &exchange{start: time.Now(), slot: slotOf(req.Context()), rules: p.current()}
	pctx.UserData = ex
	passThrough := ex.rules.PassThrough.Match(host)
	boundary := state.BoundaryHTTP
	if passThrough {
		boundary = state.BoundaryTunnel
	}
	reject := func(r *refusal.Refusal) (*goproxy.ConnectAction, string) {
		pctx.Resp = p.refuse(req, ex, boundary, r)
		// goproxy closes the connection after a refused CONNECT: say so, or
		// a client answering a 407 (libcurl's anyauth) sends its credentials
		// on a connection that is gone ("Proxy CONNECT aborted").
		pctx.Resp.Close = true
		pctx.Resp.Header.Set("Connection", "close")
		return &goproxy.ConnectAction{Action: goproxy.ConnectReject}, host
	}
	if !passThrough && p.cfg.CA == nil {
		return reject(refusal.New(refusal.InterceptionDisabled,
			"this proxy has no CA to intercept %s and it is not a pass-through host", host))
	}
	id, err := identify(req.Header, p.boundRun(req), p.tokens)
	anonymous := errors.Is(err, errNoIdentity)
	switch {
	case err == nil:
		ex.id, ex.hasID = id, true
		// A tunnel whose client asked for it (stopgate exec, carrying a
		// sandboxed command's connections) keeps the CONNECT's run for
		// every request inside: nothing the command sends names another.
		ex.id.bound = ex.id.bound || req.Header.Get(HeaderBindTunnel) == "1"
	case anonymous:
		// Answered 407 below, once the destination is known to be allowed:
		// a 407 inside a tunnel is one no client can act on.
	default:
		return reject(identityRefusal(err))
	}
	if ex.hasID && ex.slot != nil && !ex.slot.name(id.run) {
		return reject(refusal.New(refusal.TooManyConnections,
			"run %s holds %d open exchanges through this proxy, its cap (--max-conns-per-run): try again when some have ended; nothing was sent", id.run, p.cfg.MaxConnsPerRun))
	}
	allow := ex.rules.Delivery.Match(host)
	greq := state.GuardRequest{
		RunID: id.run, ObservedVersion: id.version, Key: intents.DerivedKey(id.run, http.MethodConnect, host, ""),
		Boundary: boundary, Method: http.MethodConnect, Target: host,
		AutoAdmit: p.cfg.AutoAdmit, AllowCancelling: allow,
	}
	if greq.AutoAdmit && ex.hasID {
		greq.Budget = ex.rules.autoBudget(id.run)
	}
	if passThrough && !anonymous {
		if tw := ex.rules.tripwireOf(http.MethodConnect, host, nil); tw != "" {
			// A tunnel to a host the run must never reach: refused,
			// recorded and the run cancelled in the guard's one step.
			greq.Tripwire, greq.TripwireDrain = tw, ex.rules.CancelDrain
			if r := p.guard(req, ex, greq); r != nil {
				return reject(r)
			}
			p.finish(req.Context(), ex, state.IntentNotSent, 0, "a tripwire's guard admitted the tunnel")
			return reject(refusal.New(refusal.Internal, "the guard admitted a tunnel that meets tripwire %s; nothing was sent", tw))
		}
	}
	if r := p.destination(req, ex, boundary, checkedAddr(req.Context(), host)); r != nil {
		return reject(p.denied(req, ex, r, greq))
	}
	if anonymous {
		// An anonymous CONNECT is answered 407 here, where the client can
		// answer it (libcurl's anyauth, so git, sends its credentials only
		// after one), rather than let in to meet a 407 inside the tunnel.
		// A client naming its run per request with X-Run-ID names one at
		// the CONNECT too (credentials, X-Run-ID on the CONNECT, or --run).
		return reject(identityRefusal(err))
	}
	if !passThrough {
		return &goproxy.ConnectAction{Action: goproxy.ConnectHijack, Hijack: func(_ *http.Request, client net.Conn, _ *goproxy.ProxyCtx) {
			p.intercept(client, host, ex)
		}}, host
	}

	if ex.slot != nil {
		// The tunnel bounds its client's silences itself, both ways at once.
		ex.slot.mode.Store(readOwn)
	}
	if r := p.guard(req, ex, greq); r != nil {
		return reject(r)
	}
	return &goproxy.ConnectAction{Action: goproxy.ConnectHijack, Hijack: func(req *http.Request, client net.Conn, _ *goproxy.ProxyCtx) {
		p.tunnel(req, client, host, ex)
	}}, host
}

// tunnel carries a pass-through CONNECT, unseen, until either side closes,
// the run's cancel cuts it, or it is silent too long: before the client's
// first byte, the handshake timeout; after, the idle timeout, both ways.
func (p *Proxy) tunnel(req *http.Request, client net.Conn, host string, ex *exchange) {
	defer client.Close()
	f := ex.flow
	// Values only (a transparent connection's dial pin): the tunnel outlives the CONNECT.
	ctx, cut := context.WithCancelCause(context.WithoutCancel(req.Context()))
	defer cut(nil)
	ex.ctx, f.cut = ctx, cut
	p.flows.add(f)
	defer p.flows.remove(f)

	dctx, cancel := context.WithTimeout(withTarget(ctx, &ex.dest), p.cfg.DialTimeout)
	upstream, err := p.dial(dctx, "tcp", host)
	cancel()
	if err != nil {
		r := refusal.Wrap(err, refusal.UpstreamFailed, "cannot reach %s: %v; recorded %s", host, err, state.IntentNotSent)
		var denied *refusal.Refusal
		if errors.As(err, &denied) {
			r = denied
			r.Recorded = state.IntentNotSent
		}
		r.RunID, r.ObservedVersion, r.Intent, r.Recorded = f.id.run, f.id.version, f.intent.Key, state.IntentNotSent
		ex.status = r.Status()
		p.finish(ctx, ex, state.IntentNotSent, 0, "dial: "+err.Error())
		_ = r.Response(req).Write(client)
		return
	}
	defer upstream.Close()
	if _, err := fmt.Fprintf(client, "HTTP/1.1 200 Connection established\r\n%s: %s\r\n\r\n", refusal.IntentHeader, f.intent.Key); err != nil {
		p.finish(ctx, ex, state.IntentNotSent, 0, "client gone before the tunnel opened")
		return
	}
	ex.status = http.StatusOK

	opened := time.Now()
	var sent atomic.Int64 // bytes read from the client, so far
	var last atomic.Int64 // when a byte last went either way, in ns since opened
	var wg sync.WaitGroup
	wg.Go(func() {
		_, _ = io.Copy(upstream, &activeReader{r: client, opened: opened, last: &last, count: &sent})
		closeWrite(upstream)
	})
	wg.Go(func() {
		_, _ = io.Copy(client, &activeReader{r: upstream, opened: opened, last: &last})
		closeWrite(client)
	})
	// Either the copies end on their own, or a cut or a silence closes both sides.
	copied := make(chan struct{})
	go func() { wg.Wait(); close(copied) }()
	closeBoth := func() {
		_ = client.Close()
		_ = upstream.Close()
		<-copied
	}
	silence := time.NewTimer(p.cfg.HandshakeTimeout)
	defer silence.Stop()
	for {
		select {
		case <-copied:
			p.finish(ctx, ex, state.IntentResponded, 0, "tunnel_closed")
			return
		case <-ctx.Done():
			closeBoth()
			reason := "cut"
			if ce := cutOf(ctx); ce != nil {
				reason = ce.reason
			}
			outcome := state.IntentNotSent
			if sent.Load() > 0 {
				// Bytes went upstream through a tunnel we cannot see into.
				outcome = state.IntentUnknown
			}
			p.finish(ctx, ex, outcome, 0, reason)
			return
		case <-silence.C:
			limit, reason := p.cfg.IdleTimeout, "idle_timeout"
			if sent.Load() == 0 {
				limit, reason = p.cfg.HandshakeTimeout, "handshake_timeout"
			}
			quiet := time.Since(opened.Add(time.Duration(last.Load())))
			if quiet < limit {
				silence.Reset(limit - quiet)
				continue
			}
			closeBoth()
			// Nothing the tunnel carried was cut short by stopgate: it
			// went quiet, and what it sent (if anything) was answered or not
			// as the two sides agreed.
			outcome := state.IntentResponded
			if sent.Load() == 0 {
				outcome = state.IntentNotSent
			}
			p.finish(ctx, ex, outcome, 0, reason)
			return
		}
	}
}

// activeReader notes when bytes pass, for the tunnel's silence timer, and
// counts them when count is set.
type activeReader struct {
	r      io.Reader
	opened time.Time
	last   *atomic.Int64
	count  *atomic.Int64
}

func (a *activeReader) Read(b []byte) (int, error) {
	n, err := a.r.Read(b)
	if n > 0 {
		a.last.Store(int64(time.Since(a.opened)))
		if a.count != nil {
			a.count.Add(int64(n))
		}
	}
	return n, err
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
		return
	}
	_ = c.Close()
}
