package serve

import (
	"log/slog"
	"net"

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
func startTransparent(cfg Config, lns []net.Listener, egress *proxy.Proxy, log *slog.Logger) (*transparentParts, error) {
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
		binder: bindings,
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
