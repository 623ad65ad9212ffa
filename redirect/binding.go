package redirect

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// Binding is the other end of a redirect: a transparent listener of the
// egress proxy bound to one run and reserved for one uid, the port the
// uid's rules send it to (Rules.Port). The proxy makes and keeps them; the
// control API serves them as they are (POST /v1/transparent/bindings), and
// `stopgate exec --isolate` reads them back: one type on both sides of the
// wire.
type Binding struct {
	ID            string `json:"id"`
	UID           uint32 `json:"uid"`
	RunID         string `json:"run_id"`
	CancelVersion int64  `json:"cancel_version,omitempty"`
	// Port is the listener's port on 127.0.0.1 and, where IPv6 works, on
	// [::1]: the kernel redirects IPv4 and IPv6 connections to the same port.
	Port  int      `json:"port"`
	Addrs []string `json:"addrs"`
	// LeaseTTL is how long the binding lives unless renewed; on the wire a
	// Go duration ("30s").
	LeaseTTL  time.Duration `json:"-"`
	ExpiresAt time.Time     `json:"expires_at"`
}

// Errors of making, renewing and ending bindings, whoever reports them.
var (
	// ErrUIDBound: the uid has a binding already; the kernel redirects a
	// uid to one port only.
	ErrUIDBound = errors.New("uid already bound")
	// ErrNoBinding: no binding has that id (expired, removed, or made by a
	// stopgate that has restarted since).
	ErrNoBinding = errors.New("no such binding")
)

// bindingWire is Binding with its lease spelt as on the wire.
type bindingWire struct {
	plainBinding
	LeaseTTL string `json:"lease_ttl"`
}

// plainBinding is Binding without its methods, so that the wire form can
// embed it without calling itself.
type plainBinding Binding

// MarshalJSON writes the binding with its lease as a Go duration.
func (b Binding) MarshalJSON() ([]byte, error) {
	return json.Marshal(bindingWire{plainBinding(b), b.LeaseTTL.String()})
}

// UnmarshalJSON reads what MarshalJSON writes.
func (b *Binding) UnmarshalJSON(data []byte) error {
	var w bindingWire
	if err := json.Unmarshal(data, &w); err != nil {
		return err
	}
	ttl, err := time.ParseDuration(w.LeaseTTL)
	if err != nil {
		return fmt.Errorf("binding lease_ttl %q: %w", w.LeaseTTL, err)
	}
	*b = Binding(w.plainBinding)
	b.LeaseTTL = ttl
	return nil
}
