package main

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/proxy"
	"github.com/stopgate/stopgate/runtoken"
)

// transparentParts are serve's transparent listener (--transparent-addr) and
// the bindings exec --isolate asks for; both off without the flag.
type transparentParts struct {
	// addr is the first listener's bound address.
	addr   string
	binder control.TransparentBinder
	close  func()
}

// startTransparent serves the transparent listeners lns (none: off); they
// are closed with the listeners if it fails.
func startTransparent(cfg serveConfig, lns []net.Listener, egress *proxy.Proxy, log *slog.Logger) (*transparentParts, error) {
	if len(lns) == 0 {
		return &transparentParts{close: func() {}}, nil
	}
	tr, err := egress.NewTransparent(proxy.TransparentOptions{})
	if err != nil {
		return nil, err
	}
	addrs := make([]string, 0, len(lns))
	for _, ln := range lns {
		addrs = append(addrs, ln.Addr().String())
		go func() {
			if err := tr.Serve(ln); err != nil {
				log.Error("transparent listener stopped", "addr", ln.Addr().String(), "err", err)
			}
		}()
	}
	bindings := egress.NewBindings()
	log.Info("transparent listener serving", "addrs", addrs, "static_run", cfg.Run)
	return &transparentParts{
		addr:   lns[0].Addr().String(),
		binder: bindingsAPI{bindings},
		close: func() {
			bindings.Close()
			_ = tr.Close()
		},
	}, nil
}

func runTokenMode(tokens *runtoken.Signer, required bool) string {
	switch {
	case required:
		return control.RunTokensRequired
	case tokens != nil:
		return control.RunTokensAccepted
	}
	return control.RunTokensOff
}

// bindingsAPI serves the proxy's bindings to the control API.
type bindingsAPI struct{ b *proxy.Bindings }

func (a bindingsAPI) Bind(_ context.Context, uid uint32, run string, version int64, ttl time.Duration) (control.Binding, error) {
	b, err := a.b.Bind(uid, run, version, ttl)
	return apiBinding(b), apiBindingError(err)
}

func (a bindingsAPI) Renew(_ context.Context, id string) (control.Binding, error) {
	b, err := a.b.Renew(id)
	return apiBinding(b), apiBindingError(err)
}

func (a bindingsAPI) Unbind(_ context.Context, id string) error {
	return apiBindingError(a.b.Unbind(id))
}

func apiBinding(b proxy.Binding) control.Binding {
	return control.Binding{
		ID: b.ID, UID: b.UID, RunID: b.RunID, CancelVersion: b.CancelVersion, Port: b.Port,
		Addrs: b.Addrs, LeaseTTL: control.TTL(b.TTL), ExpiresAt: b.ExpiresAt.UTC(),
	}
}

// apiBindingError keeps the proxy's message and adds the API's sentinel.
func apiBindingError(err error) error {
	switch {
	case errors.Is(err, proxy.ErrUIDBound):
		return &alsoErr{err, control.ErrUIDBound}
	case errors.Is(err, proxy.ErrNoBinding):
		return &alsoErr{err, control.ErrNoBinding}
	}
	return err
}

type alsoErr struct{ err, also error }

func (e *alsoErr) Error() string   { return e.err.Error() }
func (e *alsoErr) Unwrap() []error { return []error{e.err, e.also} }
