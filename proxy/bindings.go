package proxy

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/stopgate/stopgate/redirect"
	"github.com/stopgate/stopgate/state"
)

// Bindings are transparent listeners opened on request, each bound to one
// run and reserved for one uid: what `stopgate exec --isolate` asks serve
// for, so that two isolated agents of different runs (different uids, each
// redirected by the kernel to its own port) are each guarded under their own
// run. The kernel's per-uid redirect decides which listener a connection
// reaches, so the run of a connection never depends on anything its client
// sends. A binding lives while its holder renews it; one that is not renewed
// closes its listener, and the redirect that may still point at it then
// fails closed (connection refused).
type Bindings struct {
	p   *Proxy
	log *slog.Logger

	mu     sync.Mutex
	closed bool
	byID   map[string]*binding
	byUID  map[uint32]*binding
}

// Bounds of a binding's life without renewal.
const (
	MinBindingTTL = time.Second
	MaxBindingTTL = time.Hour
)

// binding is one bound transparent listener: what Bind, Renew and List
// return (redirect.Binding, the control API's type too), and what serves it.
type binding struct {
	redirect.Binding
	tr    *Transparent
	timer *time.Timer
}

// NewBindings returns an empty set of bindings on p.
func (p *Proxy) NewBindings() *Bindings {
	return &Bindings{p: p, log: p.log.With("component", "bindings"), byID: map[string]*binding{}, byUID: map[uint32]*binding{}}
}

// Bind opens a transparent listener for run, reserved for uid, that lives
// for ttl unless renewed. A uid holds one binding at a time: a second is
// redirect.ErrUIDBound, whatever its run, because the kernel redirects a uid to one
// port only.
func (b *Bindings) Bind(uid uint32, run string, version int64, ttl time.Duration) (redirect.Binding, error) {
	if err := state.ValidateRunID(run); err != nil {
		return redirect.Binding{}, err
	}
	if version < 0 {
		return redirect.Binding{}, fmt.Errorf("%w: cancel_version %d is negative", state.ErrInvalid, version)
	}
	if ttl < MinBindingTTL || ttl > MaxBindingTTL {
		return redirect.Binding{}, fmt.Errorf("%w: ttl %s: want %s to %s", state.ErrInvalid, ttl, MinBindingTTL, MaxBindingTTL)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return redirect.Binding{}, errors.New("bindings are closed: stopgate is stopping")
	}
	if old := b.byUID[uid]; old != nil {
		return redirect.Binding{}, fmt.Errorf("%w: uid %d is bound to run %s until %s (another exec --isolate?); pick another uid", redirect.ErrUIDBound, uid, old.RunID, old.ExpiresAt.Format(time.RFC3339))
	}
	tr, err := b.p.NewTransparent(TransparentOptions{Run: run, Version: version})
	if err != nil {
		return redirect.Binding{}, err
	}
	lns, err := listenLoopbackPair()
	if err != nil {
		_ = tr.Close()
		return redirect.Binding{}, err
	}
	var idb [8]byte
	_, _ = rand.Read(idb[:])
	bd := &binding{tr: tr, Binding: redirect.Binding{
		ID: hex.EncodeToString(idb[:]), UID: uid, RunID: run, CancelVersion: version,
		Port: lns[0].Addr().(*net.TCPAddr).Port, LeaseTTL: ttl, ExpiresAt: time.Now().UTC().Add(ttl),
	}}
	for _, ln := range lns {
		bd.Addrs = append(bd.Addrs, ln.Addr().String())
		go func() {
			if err := tr.Serve(ln); err != nil {
				b.log.Warn("binding listener stopped", "id", bd.ID, "err", err)
			}
		}()
	}
	id := bd.ID
	bd.timer = time.AfterFunc(ttl, func() { b.expire(id) })
	b.byID[id], b.byUID[uid] = bd, bd
	b.log.Info("transparent binding opened", "id", id, "uid", uid, "run", run, "cancel_version", version, "addrs", bd.Addrs, "ttl", ttl)
	return bd.Binding, nil
}

// Renew extends a binding by its TTL from now.
func (b *Bindings) Renew(id string) (redirect.Binding, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	bd := b.byID[id]
	if bd == nil {
		return redirect.Binding{}, fmt.Errorf("%w: %s (expired, removed, or made by a stopgate that has restarted since)", redirect.ErrNoBinding, id)
	}
	bd.timer.Reset(bd.LeaseTTL)
	bd.ExpiresAt = time.Now().UTC().Add(bd.LeaseTTL)
	return bd.Binding, nil
}

// Unbind closes a binding's listener and its connections.
func (b *Bindings) Unbind(id string) error {
	b.mu.Lock()
	bd := b.byID[id]
	if bd != nil {
		b.remove(bd)
	}
	b.mu.Unlock()
	if bd == nil {
		return fmt.Errorf("%w: %s", redirect.ErrNoBinding, id)
	}
	b.log.Info("transparent binding closed", "id", id, "uid", bd.UID, "run", bd.RunID)
	return bd.tr.Close()
}

// Close closes every binding.
func (b *Bindings) Close() {
	b.mu.Lock()
	b.closed = true
	all := make([]*binding, 0, len(b.byID))
	for _, bd := range b.byID {
		all = append(all, bd)
		b.remove(bd)
	}
	b.mu.Unlock()
	for _, bd := range all {
		_ = bd.tr.Close()
	}
}

// List returns the open bindings.
func (b *Bindings) List() []redirect.Binding {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make([]redirect.Binding, 0, len(b.byID))
	for _, bd := range b.byID {
		out = append(out, bd.Binding)
	}
	return out
}

func (b *Bindings) expire(id string) {
	b.mu.Lock()
	bd := b.byID[id]
	// A renewal that raced the timer moved the deadline on.
	if bd == nil || time.Now().Before(bd.ExpiresAt) {
		b.mu.Unlock()
		return
	}
	b.remove(bd)
	b.mu.Unlock()
	b.log.Warn("transparent binding expired without renewal; its listener is closed", "id", id, "uid", bd.UID, "run", bd.RunID)
	_ = bd.tr.Close()
}

// remove forgets bd; b.mu is held.
func (b *Bindings) remove(bd *binding) {
	bd.timer.Stop()
	delete(b.byID, bd.ID)
	if b.byUID[bd.UID] == bd {
		delete(b.byUID, bd.UID)
	}
}

// listenLoopbackPair listens on 127.0.0.1 and on [::1] at the same port,
// where REDIRECT sends a local uid's IPv4 and IPv6 connections. Without
// IPv6 on the machine the IPv4 listener alone is returned.
func listenLoopbackPair() ([]net.Listener, error) {
	var lastErr error
	for range 8 {
		ln4, err := net.Listen("tcp4", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("listen on 127.0.0.1: %w", err)
		}
		port := ln4.Addr().(*net.TCPAddr).Port
		ln6, err := net.Listen("tcp6", net.JoinHostPort("::1", strconv.Itoa(port)))
		switch {
		case err == nil:
			return []net.Listener{ln4, ln6}, nil
		case noIPv6(err):
			return []net.Listener{ln4}, nil
		}
		// The port is taken on [::1]: try another.
		_ = ln4.Close()
		lastErr = err
	}
	return nil, fmt.Errorf("no port free on both 127.0.0.1 and [::1]: %w", lastErr)
}

// noIPv6 reports whether a listen on [::1] failed because there is no IPv6.
func noIPv6(err error) bool {
	return errors.Is(err, syscall.EADDRNOTAVAIL) || errors.Is(err, syscall.EAFNOSUPPORT) || errors.Is(err, syscall.EPROTONOSUPPORT)
}

// ListenTransparent listens on addr and, when addr is on 127.0.0.1, also on
// [::1] at the same port (where the kernel redirects IPv6 connections).
func ListenTransparent(addr string) ([]net.Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	host, _, _ := net.SplitHostPort(addr)
	if host != "127.0.0.1" {
		return []net.Listener{ln}, nil
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln6, err := net.Listen("tcp6", net.JoinHostPort("::1", strconv.Itoa(port)))
	if err != nil {
		if noIPv6(err) {
			return []net.Listener{ln}, nil
		}
		_ = ln.Close()
		return nil, fmt.Errorf("listen on [::1]:%d too, for redirected IPv6 connections: %w", port, err)
	}
	return []net.Listener{ln, ln6}, nil
}
