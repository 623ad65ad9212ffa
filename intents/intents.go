// Package intents is the effect ledger on top of the state guard: it names
// effects (idempotency keys), admits them through the one atomic guard,
// keeps the leases of the effects this instance carries alive, records their
// outcomes, and sweeps the store so that expired leases become UNKNOWN and
// cancelled runs move on to CANCELLED or UNKNOWN.
//
// It never dispatches an effect and never decides whether one may happen:
// that is the guard's answer, recorded in the same atomic step as the check.
package intents

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strconv"
	"sync"
	"time"

	"github.com/stopgate/stopgate/state"
)

// RecordedTarget is the URL an effect is recorded under, on every edge
// that records one (the egress proxy's requests, the browser guard's
// navigations): where it went, without the credentials, query and
// fragment, which often carry secrets; its key (DerivedKey) still covers
// the whole URL, query included. whole is u.String() when the caller has
// written it out already ("" when not), which spares writing it again.
func RecordedTarget(u *url.URL, whole string) string {
	if u.User == nil && u.RawQuery == "" && !u.ForceQuery && u.Fragment == "" {
		if whole == "" {
			whole = u.String()
		}
		return state.Clip(whole, state.MaxTargetLen)
	}
	if u.User == nil && u.Fragment == "" && whole != "" {
		// u.String() ends with "?" and the raw query when it has no
		// fragment.
		if n := len(whole) - len(u.RawQuery) - 1; n >= 0 && whole[n] == '?' && whole[n+1:] == u.RawQuery {
			return state.Clip(whole[:n], state.MaxTargetLen)
		}
	}
	c := *u
	c.User, c.RawQuery, c.ForceQuery, c.Fragment, c.RawFragment = nil, "", false, "", ""
	return state.Clip(c.String(), state.MaxTargetLen)
}

// DerivedKey names an effect that carries no Idempotency-Key: the same run,
// method, target and body give the same base, and the store numbers repeats.
func DerivedKey(runID, method, target, bodyDigest string) string {
	// Each part as "len:part;", hashed in one piece: every request without
	// an Idempotency-Key is named here, so no fmt and one buffer, on the
	// stack for the usual URL.
	var stack [512]byte
	b := stack[:0]
	for _, part := range [...]string{runID, method, target, bodyDigest} {
		b = strconv.AppendInt(b, int64(len(part)), 10)
		b = append(b, ':')
		b = append(b, part...)
		b = append(b, ';')
	}
	sum := sha256.Sum256(b)
	var key [2 + 24]byte
	copy(key[:], "d-")
	hex.Encode(key[2:], sum[:12])
	return string(key[:])
}

// Ledger admits effects through the guard and holds their leases until
// their outcome is recorded.
type Ledger struct {
	store   state.Store
	owner   string
	ttl     time.Duration
	timeout time.Duration
	log     *slog.Logger

	mu   sync.Mutex
	held map[state.IntentRef]struct{}
}

// DefaultLeaseTTL is how long an IN_FLIGHT intent stays leased to its
// carrier without a renewal when none is set: a carrier killed with -9
// leaves its effects UNKNOWN that much later.
const DefaultLeaseTTL = 15 * time.Second

// LedgerOptions configure a Ledger.
type LedgerOptions struct {
	// Owner names this instance in leases and in the audit log.
	Owner string
	// LeaseTTL is how long an IN_FLIGHT intent stays leased without a
	// renewal; a carrier killed with -9 leaves it to expire into UNKNOWN.
	LeaseTTL time.Duration
	// StoreTimeout bounds every store call: past it the store counts as down.
	StoreTimeout time.Duration
	Logger       *slog.Logger
}

// NewLedger returns a ledger; call Run to keep its leases alive.
func NewLedger(store state.Store, opts LedgerOptions) *Ledger {
	if opts.LeaseTTL <= 0 {
		opts.LeaseTTL = DefaultLeaseTTL
	}
	if opts.StoreTimeout <= 0 {
		opts.StoreTimeout = state.DefaultTimeout
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	return &Ledger{
		store: store, owner: opts.Owner, ttl: opts.LeaseTTL, timeout: opts.StoreTimeout,
		log: opts.Logger, held: map[state.IntentRef]struct{}{},
	}
}

// Begin runs the guard for one effect. An admitted IN_FLIGHT intent is
// leased to this ledger until Finish. A store that does not answer within
// the store timeout is an error wrapping state.ErrUnavailable: the caller
// must not dispatch.
//
// The guard is fenced by the store (state.GuardRequest.Fenced) at
// start + StoreTimeout/2, the ledger's bound halved: a store whose clock
// is past that refuses to apply it. The ledger waits the full
// StoreTimeout, so a guard it gave up on can never take effect later, as
// long as the store's clock is no more than StoreTimeout/2 behind this
// host's. A store clock more than that ahead refuses every guard, which
// fails closed and shows in the error.
func (l *Ledger) Begin(ctx context.Context, req state.GuardRequest) (state.GuardResult, error) {
	req.LeaseOwner = l.owner
	if req.NotBefore.IsZero() {
		req.LeaseTTL = l.ttl
	}
	if req.Actor == "" {
		req.Actor = l.owner
	}
	ctx, cancel := context.WithTimeout(ctx, l.timeout)
	defer cancel()
	res, err := l.store.Guard(ctx, req)
	if err != nil {
		return res, fmt.Errorf("guard %s for run %s: %w", req.Boundary, req.RunID, unavailableOnDeadline(err))
	}
	if res.Admitted && res.Intent.State == state.IntentInFlight {
		l.mu.Lock()
		l.held[state.IntentRef{RunID: res.Intent.RunID, Key: res.Intent.Key}] = struct{}{}
		l.mu.Unlock()
	}
	return res, nil
}

// Finish records the outcome of an intent this ledger carried and lets its
// lease go; req names the intent (run, key, attempt) and the outcome, the
// ledger is the actor. If the store cannot take it, the lease is still let
// go: it expires into UNKNOWN, which is the honest record of an outcome
// nobody could write down.
func (l *Ledger) Finish(ctx context.Context, req state.FinishRequest) (state.Intent, error) {
	req = l.release(req)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.timeout)
	defer cancel()
	out, err := l.store.Finish(ctx, req)
	return out, notRecorded(req.Outcome, req.RunID, req.Key, err)
}

// A Recorder is told what became of an outcome queued by
// Ledger.FinishLater. It is an interface rather than a func so that a
// carrier already on the heap (a proxied request) is told without a
// closure of its own on every request.
type Recorder interface {
	// Recorded is called once, with the error Finish would have returned
	// (nil: recorded), on the store's goroutine: it must be quick and must
	// not call the store.
	Recorded(error)
}

// FinishLater is Finish for a carrier that does not wait for the record:
// the outcome is queued in the store now, ordered before every later step
// of this instance, and r is told whether it was, in Finish's words, once
// it is written (see state.Store.FinishLater). The store bounds the step as
// it bounds the write that carries it.
func (l *Ledger) FinishLater(ctx context.Context, req state.FinishRequest, r Recorder) {
	req = l.release(req)
	// The callback keeps what its error names, not the whole request.
	outcome, run, key := req.Outcome, req.RunID, req.Key
	l.store.FinishLater(context.WithoutCancel(ctx), req, func(err error) {
		r.Recorded(notRecorded(outcome, run, key, err))
	})
}

// release lets the lease of the intent req reports on go, and names this
// ledger the actor of its outcome. The outcome is recorded whatever
// becomes of the caller's context: it is what happened.
func (l *Ledger) release(req state.FinishRequest) state.FinishRequest {
	l.mu.Lock()
	delete(l.held, state.IntentRef{RunID: req.RunID, Key: req.Key})
	l.mu.Unlock()
	req.Actor = l.owner
	return req
}

func notRecorded(outcome state.IntentState, run, key string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("record %s of intent %s/%s: %w", outcome, run, key, unavailableOnDeadline(err))
}

// Note adds one line about an intent this ledger carried to the run's
// audit log (a cut answer, say), as this ledger.
func (l *Ledger) Note(ctx context.Context, in state.Intent, kind, reason string) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.timeout)
	defer cancel()
	err := l.store.Note(ctx, state.NoteRequest{RunID: in.RunID, Key: in.Key, Kind: kind, Reason: state.Clip(reason, state.MaxTextLen), Actor: l.owner})
	if err != nil {
		return fmt.Errorf("note %s on intent %s/%s: %w", kind, in.RunID, in.Key, unavailableOnDeadline(err))
	}
	return nil
}

// Held lists the intents this ledger carries now.
func (l *Ledger) Held() []state.IntentRef {
	l.mu.Lock()
	defer l.mu.Unlock()
	refs := make([]state.IntentRef, 0, len(l.held))
	for ref := range l.held {
		refs = append(refs, ref)
	}
	return refs
}

// Run renews the leases of held intents every third of the lease TTL until
// ctx ends.
func (l *Ledger) Run(ctx context.Context) { every(ctx, l.ttl/3, l.renew) }

func (l *Ledger) renew(ctx context.Context) {
	refs := l.Held()
	if len(refs) == 0 {
		return
	}
	_, err := storeCall(ctx, l.timeout, func(ctx context.Context) (state.RenewResult, error) {
		return l.store.Renew(ctx, state.RenewRequest{Owner: l.owner, TTL: l.ttl, Refs: refs})
	})
	if err != nil {
		l.log.Warn("lease renewal failed; leases expire into UNKNOWN if this persists", "owner", l.owner, "intents", len(refs), "err", err)
	}
}

func unavailableOnDeadline(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("%w: %w", state.ErrUnavailable, err)
	}
	return err
}
