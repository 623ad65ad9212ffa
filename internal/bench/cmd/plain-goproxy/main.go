// Command plain-goproxy is the benchmark's baseline (package baseline):
// github.com/elazarl/goproxy at the version stopgate uses, with the upstream
// transport stopgate's proxy builds (proxy.New) and the same listener
// bounds, intercepting HTTPS with a CA and a leaf cache made by stopgate's
// own code (a CA of its own, in a temporary directory), and no guard at all. It is what a guarded request
// is compared against; it is not a product.
//
//	plain-goproxy -addr 127.0.0.1:0 -ca-out ca.pem
//
// prints "listening HOST:PORT" on its first line once it accepts
// connections, and serves until SIGINT or SIGTERM.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/stopgate/stopgate/internal/bench/baseline"
	"github.com/stopgate/stopgate/proxy"
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
	caDir, err := os.MkdirTemp("", "plain-goproxy-ca-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(caDir)
	ca, err := proxy.LoadOrCreateCA(caDir)
	if err != nil {
		return err
	}
	if err := os.WriteFile(*caOut, ca.PEM, 0o644); err != nil {
		return fmt.Errorf("-ca-out: %w", err)
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		return fmt.Errorf("-addr: %w", err)
	}
	srv := &http.Server{
		Handler: baseline.Goproxy(&ca.Cert, log.New(os.Stderr, "plain-goproxy: ", 0)),
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
