// Package state owns the durable run rows, the intent records written
// against them, the run's audit log, and the one atomic guard that decides
// whether an effect may be dispatched.
//
// Every transition here is one atomic step of the store (a Lua script in
// Redis, one transaction in the embedded store): a check is never a read
// followed by a write. The package never dispatches an effect, never cuts a
// connection and never decides policy (which destinations a cancelling run
// may still reach, how long a lease lives): callers say so in each request.
package state

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Status is the lifecycle of a run row.
type Status string

const (
	// StatusActive admits new work.
	StatusActive Status = "ACTIVE"
	// StatusCancelling admits no new work; in-flight work drains until the deadline.
	StatusCancelling Status = "CANCELLING"
	// StatusCancelled is final: nothing is in flight or unresolved, nothing resumes.
	StatusCancelled Status = "CANCELLED"
	// StatusCompleted is final: the run finished normally.
	StatusCompleted Status = "COMPLETED"
	// StatusUnknown means some effect of a cancelled run cannot be proven
	// either way; it becomes CANCELLED once every unknown intent is reconciled.
	StatusUnknown Status = "UNKNOWN"
)

// Statuses lists every run status, in lifecycle order.
var Statuses = []Status{StatusActive, StatusCancelling, StatusCancelled, StatusCompleted, StatusUnknown}

// ParseStatus accepts a status name in any case.
func ParseStatus(s string) (Status, error) {
	for _, st := range Statuses {
		if strings.EqualFold(string(st), s) {
			return st, nil
		}
	}
	return "", fmt.Errorf("%w: unknown run status %q (want one of ACTIVE, CANCELLING, CANCELLED, COMPLETED, UNKNOWN)", ErrInvalid, s)
}

// IntentState is the lifecycle of one external effect.
type IntentState string

const (
	// IntentInFlight was admitted by the guard and is leased to its carrier.
	IntentInFlight IntentState = "IN_FLIGHT"
	// IntentScheduled is a retry waiting for its time; a cancel revokes it.
	IntentScheduled IntentState = "SCHEDULED"
	// IntentResponded: the provider answered (status code recorded).
	IntentResponded IntentState = "RESPONDED"
	// IntentNotSent: provably never reached the provider.
	IntentNotSent IntentState = "NOT_SENT"
	// IntentUnknown: may or may not have happened.
	IntentUnknown IntentState = "UNKNOWN"
	// IntentCancelledBeforeDispatch: refused by the guard, never dispatched.
	IntentCancelledBeforeDispatch IntentState = "CANCELLED_BEFORE_DISPATCH"
	// IntentRevoked: a scheduled retry revoked by the cancel.
	IntentRevoked IntentState = "REVOKED"
	// IntentApplied: an UNKNOWN reconciled as having happened.
	IntentApplied IntentState = "APPLIED"
	// IntentNotApplied: an UNKNOWN reconciled as not having happened.
	IntentNotApplied IntentState = "NOT_APPLIED"
)

// IntentStates lists every intent state.
var IntentStates = []IntentState{
	IntentInFlight, IntentScheduled, IntentResponded, IntentNotSent, IntentUnknown,
	IntentCancelledBeforeDispatch, IntentRevoked, IntentApplied, IntentNotApplied,
}

// Boundary names where an effect is created.
type Boundary string

const (
	BoundaryHTTP     Boundary = "http"     // tool dispatch through the egress proxy
	BoundaryTunnel   Boundary = "tunnel"   // a pass-through CONNECT tunnel, one intent per tunnel
	BoundaryClaim    Boundary = "claim"    // a queue claim
	BoundaryRetry    Boundary = "retry"    // a scheduled retry
	BoundaryBrowser  Boundary = "browser"  // a browser action over CDP
	BoundaryDelivery Boundary = "delivery" // outbound delivery to a configured destination
	BoundaryCustom   Boundary = "custom"   // any other effect reported through the intent API
)

// Boundaries lists every boundary.
var Boundaries = []Boundary{BoundaryHTTP, BoundaryTunnel, BoundaryClaim, BoundaryRetry, BoundaryBrowser, BoundaryDelivery, BoundaryCustom}

// Run is one durable run row.
type Run struct {
	ID            string `json:"run_id"`
	Status        Status `json:"status"`
	CancelVersion int64  `json:"cancel_version"`
	// Reason is the operator's reason for the cancel (or completion).
	Reason string `json:"reason,omitempty"`
	// StatusReason says why the run left CANCELLING or UNKNOWN: drained,
	// unresolved_intents, drain_timeout, reconciled.
	StatusReason string    `json:"status_reason,omitempty"`
	CreatedAt    time.Time `json:"created_at"`
	UpdatedAt    time.Time `json:"updated_at"`
	// CancelledAt is when the cancel committed; zero if never cancelled.
	CancelledAt time.Time `json:"cancelled_at,omitzero"`
	// DrainDeadline is when a CANCELLING run stops waiting for in-flight work.
	DrainDeadline time.Time `json:"drain_deadline,omitzero"`
	// PrunedAt is when retention last removed the intents and events of
	// this final run (Store.Prune); zero if never. The row itself, its
	// status, version and intent counts stay for good.
	PrunedAt time.Time `json:"pruned_at,omitzero"`
	// Intents counts the run's intents by state; states with none are absent.
	Intents map[IntentState]int `json:"intents"`
	// Budget is the run's limits, fixed at admission (docs/budgets.md).
	Budget Budget `json:"budget,omitzero"`
	// Usage is what the run has used (Usage, docs/budgets.md). Only Get
	// and List fill it: a step's answer carries the row without it.
	Usage Usage `json:"usage,omitempty"`
}

// Final reports whether the row can never change again: the stores drop a
// final run from their live indexes.
func (r Run) Final() bool { return r.Status == StatusCancelled || r.Status == StatusCompleted }

// Over reports whether the run will never again have work admitted or
// carried: it is final, or UNKNOWN (its in-flight work was cut by the
// drain deadline or lost with its carrier, and only the reconciliation of
// its record remains). Every edge asks this one question before it lets go
// of what it holds for a run: open connections, browser sessions, browsers.
func (r Run) Over() bool { return r.Final() || r.Status == StatusUnknown }

// Intent is the record of one external effect.
type Intent struct {
	RunID      string      `json:"run_id"`
	Key        string      `json:"key"`
	Boundary   Boundary    `json:"boundary"`
	State      IntentState `json:"state"`
	Method     string      `json:"method,omitempty"`
	Target     string      `json:"target,omitempty"`
	BodyDigest string      `json:"body_digest,omitempty"`
	StatusCode int         `json:"status_code,omitempty"`
	// Attempts counts dispatches admitted under this key.
	Attempts int `json:"attempts"`
	// Refusals counts attempts the guard refused under an existing key.
	Refusals int `json:"refusals,omitempty"`
	// ObservedVersion is the cancel_version the last attempt carried (0: none).
	ObservedVersion int64     `json:"observed_version,omitempty"`
	Reason          string    `json:"reason,omitempty"`
	Source          string    `json:"source,omitempty"`
	Note            string    `json:"note,omitempty"`
	LeaseOwner      string    `json:"lease_owner,omitempty"`
	LeaseExpires    time.Time `json:"lease_expires,omitzero"`
	NotBefore       time.Time `json:"not_before,omitzero"`
	CreatedAt       time.Time `json:"created_at"`
	UpdatedAt       time.Time `json:"updated_at"`
}

// Event is one line of a run's audit log.
type Event struct {
	At      time.Time `json:"at"`
	RunID   string    `json:"run_id"`
	Actor   string    `json:"actor"`
	Kind    string    `json:"kind"`
	Reason  string    `json:"reason,omitempty"`
	From    string    `json:"from,omitempty"`
	To      string    `json:"to,omitempty"`
	Intent  string    `json:"intent,omitempty"`
	Version int64     `json:"cancel_version,omitempty"`
}

// Event kinds.
const (
	EventRunAdmitted    = "run.admitted"
	EventRunCancelled   = "run.cancel"     // the CAS to CANCELLING, or a tombstone
	EventRunTransition  = "run.transition" // CANCELLING/UNKNOWN → CANCELLED/UNKNOWN
	EventRunCompleted   = "run.completed"
	EventIntentAdmitted = "intent.admitted" // guard admitted (IN_FLIGHT or SCHEDULED)
	EventIntentRefused  = "intent.refused"  // guard refused
	EventIntentOutcome  = "intent.outcome"  // carrier reported RESPONDED/NOT_SENT/UNKNOWN
	EventIntentExpired  = "intent.lease_expired"
	EventIntentRevoked  = "intent.revoked"
	EventIntentResolved = "intent.resolved"
	// EventIntentCut notes that the carrier cut an effect whose outcome was
	// already recorded (a response cut mid-stream): Store.Note.
	EventIntentCut = "intent.cut"
)

// storeKinds are the event kinds the stores write for transitions; a note
// may not pass for one of them.
var storeKinds = []string{
	EventRunAdmitted, EventRunCancelled, EventRunTransition, EventRunCompleted, EventIntentAdmitted,
	EventIntentRefused, EventIntentOutcome, EventIntentExpired, EventIntentRevoked, EventIntentResolved,
}

// Sources of a NOT_APPLIED outcome the carrier records itself (Finish), as
// opposed to a reconciliation (Resolve: operator, webhook, lookup).
const (
	// SourceSafeMethod: a safe-method request (GET, HEAD, a stream) cut
	// after bytes were sent; reading has no external effect.
	SourceSafeMethod = "safe_method"
	// SourcePolicy: a request to a destination the policy declares
	// without external effects (effects: none), cut after bytes were sent.
	SourcePolicy = "policy"
)

// Status reasons of a run leaving CANCELLING or UNKNOWN (Run.StatusReason),
// and the reasons the rules give an intent or an event.
const (
	ReasonAutoAdmit    = "auto-admit"
	ReasonDrained      = "drained"
	ReasonUnresolved   = "unresolved_intents"
	ReasonDrainTimeout = "drain_timeout"
	ReasonReconciled   = "reconciled"
	ReasonLeaseExpired = "lease_expired"
	ReasonRunCancelled = "run_cancelled"
	ReasonLateResponse = "late_response"
	// ReasonShutdown: an effect cut because its stopgate instance shut down.
	ReasonShutdown = "stopgate_shutdown"
)

// ReasonRunOver is the reason of an effect cut because its run is over:
// run_CANCELLED, run_COMPLETED, run_UNKNOWN.
func ReasonRunOver(s Status) string { return "run_" + string(s) }

// CutBy reports whether an outcome's or a note's reason says stopgate cut
// the effect (the reason may lead with the outcome's source and follow
// with a detail: "policy: run_cancelled: safe request").
func CutBy(reason string) bool {
	cut := []string{ReasonRunCancelled, ReasonDrainTimeout, ReasonShutdown}
	for _, s := range []Status{StatusCancelled, StatusCompleted, StatusUnknown} {
		cut = append(cut, ReasonRunOver(s))
	}
	for _, c := range cut {
		if strings.Contains(reason, c) {
			return true
		}
	}
	return false
}

// Refusal reasons the guard returns.
const (
	RefusalRunNotActive   = "run_not_active"
	RefusalStaleVersion   = "stale_version"
	RefusalRunNotAdmitted = "run_not_admitted"       // no row and auto-admit off; nothing recorded
	RefusalInProgress     = "intent_in_progress"     // explicit key still IN_FLIGHT, SCHEDULED or UNKNOWN
	RefusalKeyReused      = "idempotency_key_reused" // explicit key with a different body digest
)

// AdmitRequest creates a run ACTIVE at version 1.
type AdmitRequest struct {
	RunID  string
	Actor  string
	Reason string
	// Budget is the run's limits, fixed in its row (none when zero).
	Budget Budget
}

// AdmitResult is the row after an admission and whether this call created it.
type AdmitResult struct {
	Run     Run
	Created bool
}

// CancelRequest is the CAS ACTIVE → CANCELLING.
type CancelRequest struct {
	RunID        string
	Actor        string
	Reason       string
	DrainTimeout time.Duration
}

// CancelResult reports the row after a cancel and whether this call changed it.
type CancelResult struct {
	Run     Run
	Changed bool
}

// CompleteRequest is the CAS ACTIVE → COMPLETED at the observed version.
type CompleteRequest struct {
	RunID   string
	Version int64
	Actor   string
	Reason  string
}

// GuardRequest asks to dispatch one effect.
type GuardRequest struct {
	RunID string
	// ObservedVersion is the cancel_version the caller saw; 0 checks ACTIVE alone.
	ObservedVersion int64
	// Key identifies the effect. With ExplicitKey it is the caller's
	// idempotency key and replays follow the idempotency rules; without it,
	// Key is a derived base and the store makes each dispatch its own record
	// (the n-th identical request of a run is "<base>.n" for n > 1).
	Key         string
	ExplicitKey bool
	Boundary    Boundary
	Method      string
	Target      string
	BodyDigest  string
	// AutoAdmit creates an unseen run ACTIVE at version 1 first.
	AutoAdmit bool
	// AllowCancelling admits the effect while the run is CANCELLING
	// (delivery destinations); CANCELLED, COMPLETED and UNKNOWN still refuse.
	AllowCancelling bool
	// NotBefore, when set, schedules the effect (a retry) instead of
	// dispatching it: the intent is SCHEDULED, not leased, and revoked by a cancel.
	NotBefore time.Time
	// LeaseOwner and LeaseTTL lease an IN_FLIGHT intent to its carrier.
	LeaseOwner string
	LeaseTTL   time.Duration
	Actor      string
	// Refuse, when set, is a reason the edge refused the effect for before
	// the run's state could matter (destination_denied): the guard records
	// the effect as refused for it, CANCELLED_BEFORE_DISPATCH, in the same
	// one step, whatever the run's state, and admits nothing. The run row
	// is not changed (an unseen run is still auto-admitted when asked).
	Refuse string
	// NotAfter fences a guard its caller may give up on: once the store's
	// own clock is past it, the store refuses to apply the guard with an
	// error wrapping ErrUnavailable and records nothing (no intent, no
	// lease, no event). A guard that waited in a queue, or that a paused
	// Redis read only after resuming, then never takes effect after its
	// caller answered "nothing was sent". Zero sets no fence.
	NotAfter time.Time
	// Budget is the budget of a run this guard admits (AutoAdmit); a run
	// that has a row keeps the budget it was admitted with.
	Budget Budget
	// RequestBytes is the size of the effect's request body, counted
	// against the run's max_request_bytes.
	RequestBytes int64
	// Tripwire, when set, names the policy's tripwire the effect matches:
	// the guard refuses it (RefusalTripwire) and cancels an ACTIVE run in
	// the same step, reason tripwire:<rule>, draining for TripwireDrain.
	Tripwire      string
	TripwireDrain time.Duration
}

// Fenced is r fenced by ctx's deadline, so that no caller can forget the
// fence: NotAfter becomes the point halfway between now and the deadline
// (unless r already has an earlier one). The caller waits until the
// deadline; a store that applies the guard only before the fence leaves
// half the wait as a margin for the store's clock being behind this host's,
// and a guard the caller gave up on (a paused Redis resuming, a queue
// behind the embedded store's writer) never takes effect later. Each store
// fences every guard with it, after bounding ctx by its own timeout; a ctx
// without a deadline sets no fence.
func (r GuardRequest) Fenced(ctx context.Context) GuardRequest {
	deadline, ok := ctx.Deadline()
	if !ok {
		return r
	}
	now := time.Now()
	if fence := now.Add(deadline.Sub(now) / 2); r.NotAfter.IsZero() || fence.Before(r.NotAfter) {
		r.NotAfter = fence
	}
	return r
}

// Late reports whether a store whose clock reads now must refuse the guard
// because its NotAfter has passed. Times compare in whole milliseconds, the
// stores' resolution.
func (r GuardRequest) Late(now time.Time) bool {
	return !r.NotAfter.IsZero() && now.UnixMilli() > r.NotAfter.UnixMilli()
}

// GuardResult is the guard's decision. A refusal is a result, not an error.
type GuardResult struct {
	Admitted bool
	// Refusal is one of the Refusal* reasons when not admitted.
	Refusal string
	Run     Run
	// Intent is the record as written (or, for a duplicate refusal, as it stands).
	Intent Intent
	// Cause names what refused a budget or tripwire refusal: the reason of
	// the cancel the guard made (budget:<limit>, tripwire:<rule>).
	Cause string
}

// FinishRequest reports what happened to an IN_FLIGHT intent.
type FinishRequest struct {
	RunID string
	Key   string
	// Attempt is the intent's attempt number the carrier dispatched; a
	// report for an older attempt is refused.
	Attempt int
	// Outcome is RESPONDED, NOT_SENT, UNKNOWN, or NOT_APPLIED with Source
	// (only from IN_FLIGHT: a cut request that provably had no effect).
	Outcome    IntentState
	StatusCode int
	Reason     string
	// Source says why a NOT_APPLIED outcome is known: SourceSafeMethod or
	// SourcePolicy. Required with NOT_APPLIED, refused with any other.
	Source string
	Actor  string
	// ResponseBytes is the size of the answer's body as it passed,
	// counted against the run's max_response_bytes.
	ResponseBytes int64
	// LLM is what an LLM answer says it used (nil: not an LLM answer).
	LLM *LLMUsage
}

// NoteRequest appends one audit event about an intent without changing
// any state: Kind is the event's kind (EventIntentCut, say), never one of
// the kinds the stores write for transitions.
type NoteRequest struct {
	RunID  string
	Key    string
	Kind   string
	Reason string
	Actor  string
}

// PruneRequest asks retention to remove the intents and events of runs
// that became final (CANCELLED, COMPLETED) before FinalBefore, at most
// Limit runs in one call. The rows stay: a cancelled run never comes back.
type PruneRequest struct {
	FinalBefore time.Time
	Limit       int
}

// ResolveRequest reconciles an UNKNOWN intent.
type ResolveRequest struct {
	RunID   string
	Key     string
	Applied bool
	// Source is where the answer came from: operator, webhook, lookup.
	Source string
	Note   string
	Actor  string
}

// IntentRef names one intent.
type IntentRef struct {
	RunID string
	Key   string
}

// RenewRequest extends the leases Owner holds on the intents named.
type RenewRequest struct {
	Owner string
	TTL   time.Duration
	Refs  []IntentRef
}

// ByRun groups the keys of r.Refs by run: the runs in the order they are
// first named, and each run's keys in the order given. A store renews one
// run per step.
func (r RenewRequest) ByRun() (runs []string, keys map[string][]string) {
	keys = map[string][]string{}
	for _, ref := range r.Refs {
		if _, ok := keys[ref.RunID]; !ok {
			runs = append(runs, ref.RunID)
		}
		keys[ref.RunID] = append(keys[ref.RunID], ref.Key)
	}
	return runs, keys
}

// RenewResult is what a renewal found: the intents whose lease it extended
// (as they now stand), and the row of every run named, so that a carrier
// learns in the same round trip whether its run was cancelled meanwhile.
// An intent named but not renewed (finished, expired into UNKNOWN, or
// leased to someone else) is absent from Renewed.
type RenewResult struct {
	Renewed []Intent
	Runs    map[string]Run
}

// Holds reports whether the renewal extended the lease of ref.
func (r RenewResult) Holds(ref IntentRef) (Intent, bool) {
	for _, in := range r.Renewed {
		if in.RunID == ref.RunID && in.Key == ref.Key {
			return in, true
		}
	}
	return Intent{}, false
}

// TickRequest moves one run on: expired leases, drained cancels, passed
// deadlines.
type TickRequest struct {
	RunID string
	Actor string
}

// Store is the durable state. Both implementations pass the same
// conformance suite (package statetest).
type Store interface {
	// Admit creates the run ACTIVE at version 1; for an ACTIVE run it is a
	// no-op returning the row (Created false); for any other status it is a
	// *Conflict (RefusalRunNotActive).
	Admit(ctx context.Context, req AdmitRequest) (AdmitResult, error)
	// Cancel moves ACTIVE → CANCELLING, bumps cancel_version, sets the drain
	// deadline and revokes every SCHEDULED intent, in one step. An unseen run
	// gets a CANCELLED tombstone at version 2. CANCELLING, CANCELLED and
	// UNKNOWN runs are returned unchanged. A COMPLETED run is a *Conflict.
	Cancel(ctx context.Context, req CancelRequest) (CancelResult, error)
	// Complete moves ACTIVE → COMPLETED when Version is the row's version.
	Complete(ctx context.Context, req CompleteRequest) (Run, error)
	// Get returns the row, or ErrNotFound.
	Get(ctx context.Context, runID string) (Run, error)
	// List returns rows ordered by run id; status "" lists all.
	List(ctx context.Context, status Status) ([]Run, error)
	// DrainingRuns lists the ids of CANCELLING and UNKNOWN runs, in id
	// order: the runs every sweep ticks. Its cost follows the runs that
	// are draining now, not the runs ever stored.
	DrainingRuns(ctx context.Context) ([]string, error)
	// ActiveRuns lists the ids of ACTIVE runs sorting after `after` ("" for
	// the first), in id order, at most limit of them. Fewer than limit
	// means there are no more: a caller walking them a page at a time
	// starts again from "". Its cost follows limit, not the runs stored.
	ActiveRuns(ctx context.Context, after string, limit int) ([]string, error)

	// Guard is the one atomic check-and-record of an effect.
	Guard(ctx context.Context, req GuardRequest) (GuardResult, error)
	// Finish records the outcome of an IN_FLIGHT intent (or a late RESPONDED
	// for one that a deadline turned UNKNOWN), then finalizes the run.
	Finish(ctx context.Context, req FinishRequest) (Intent, error)
	// FinishLater records the outcome as Finish does, without making the
	// caller wait: the step is queued now and rides with this store's next
	// write (a guard, say), or is written on its own within the store's
	// OutcomeDelay. Every later guard or outcome of the same run comes
	// after it, every other operation of this Store (reads included) waits
	// for it, and Close writes it; another instance may read the intent
	// IN_FLIGHT until it is written. done is called once with the error
	// Finish would have returned (nil once the outcome is recorded), on the
	// goroutine that wrote the step (before FinishLater returns for a
	// request that is not valid): it must be quick and must not call the
	// store. It is not given the record: a carrier that does not wait has
	// no use for it, and a store need not read it back (a caller that
	// wants it calls Finish). The store bounds the step as it bounds the
	// write that carries it; ctx withdraws it only if it ends first.
	FinishLater(ctx context.Context, req FinishRequest, done func(error))
	// Resolve reconciles an UNKNOWN intent to APPLIED or NOT_APPLIED, then
	// finalizes the run.
	Resolve(ctx context.Context, req ResolveRequest) (Intent, error)
	// Note appends one event about an existing intent to the run's audit
	// log and changes nothing else; ErrNotFound for an unknown run or
	// intent.
	Note(ctx context.Context, req NoteRequest) error
	// Renew extends the leases of IN_FLIGHT intents held by req.Owner;
	// intents no longer IN_FLIGHT or held by another owner are skipped.
	Renew(ctx context.Context, req RenewRequest) (RenewResult, error)
	// Tick turns IN_FLIGHT intents with expired leases UNKNOWN and moves a
	// CANCELLING or UNKNOWN run on: CANCELLED when nothing is in flight or
	// unknown; UNKNOWN when something is unknown, or when the drain deadline
	// passed with work in flight (those intents become UNKNOWN, reason
	// drain_timeout). Safe to run from any number of instances at once.
	Tick(ctx context.Context, req TickRequest) (Run, error)

	// Intent returns one intent, or ErrNotFound.
	Intent(ctx context.Context, runID, key string) (Intent, error)
	// Intents returns the run's intents in creation order.
	Intents(ctx context.Context, runID string) ([]Intent, error)
	// Events returns the run's audit log in order.
	Events(ctx context.Context, runID string) ([]Event, error)

	// Prune removes the intents and events of up to req.Limit runs that
	// became final before req.FinalBefore and returns how many runs it
	// pruned. Each row stays, with its status, version and intent counts,
	// and PrunedAt set. What is recorded against a final run after it
	// became final (the refusals of an agent that keeps trying) is pruned
	// with it, or, when it came after a prune, one retention after the
	// first such record.
	Prune(ctx context.Context, req PruneRequest) (int, error)

	// Totals counts every run by status, the intents UNKNOWN and the
	// reconciliations by source, across every run the store holds (every
	// instance's), kept in the same atomic step as each transition: a
	// read costs the same however many runs there are.
	Totals(ctx context.Context) (Totals, error)

	// Cancels delivers the id of every run whose cancel commits, from any
	// instance sharing the store, until ctx ends. Delivery is best effort:
	// callers re-check rows periodically.
	Cancels(ctx context.Context) (<-chan string, error)
	// Ping reports whether the store answers and can take writes (the
	// embedded store: its disk has room, is writable, and a write commits):
	// a store that can be read but not written is down for the guard.
	Ping(ctx context.Context) error
	Close() error
}

// Totals are a store's counts across every run it holds: what an operator
// alerts on (runs UNKNOWN, effects awaiting reconciliation).
type Totals struct {
	// Runs counts the runs in each status (pruned runs included: a row
	// stays).
	Runs map[Status]int64
	// UnknownIntents counts the intents UNKNOWN, awaiting reconciliation.
	UnknownIntents int64
	// Resolutions counts the UNKNOWN intents reconciled, by source
	// (ResolutionSources), since the store began keeping totals.
	Resolutions map[string]int64
}

// Where a reconciliation of an UNKNOWN intent came from, as Totals counts
// it: an operator, a signed webhook (whatever provider it names), a
// lookup, or a late answer of the upstream (Finish RESPONDED after a
// deadline). Any other source counts as ResolutionOther, so that the set
// stays small enough to label a metric with.
const (
	ResolutionOperator = "operator"
	ResolutionWebhook  = "webhook"
	ResolutionLookup   = "lookup"
	ResolutionResponse = "late_response"
	ResolutionOther    = "other"
)

// ResolutionSources lists every source Totals counts under.
var ResolutionSources = []string{ResolutionOperator, ResolutionWebhook, ResolutionLookup, ResolutionResponse, ResolutionOther}

// ResolutionSource is the source the reconciliation req counts under: a
// webhook's actor is webhook:PROVIDER, its source the provider.
func ResolutionSource(req ResolveRequest) string {
	if strings.HasPrefix(req.Actor, ResolutionWebhook+":") {
		return ResolutionWebhook
	}
	switch req.Source {
	case ResolutionOperator, ResolutionWebhook, ResolutionLookup:
		return req.Source
	}
	return ResolutionOther
}

// OutcomeDelay bounds how long an outcome queued by FinishLater waits for
// another write to ride with before it is written on its own. It is short
// against anything an operator reads, and longer than the gap between one
// connection's answer and its next request, so that the outcome and the
// next guard share one write.
const OutcomeDelay = 2 * time.Millisecond

// DefaultTimeout bounds one store call on a request's path when the
// operator sets none: past it the store counts as down and the caller fails
// closed.
const DefaultTimeout = 2 * time.Second

// Errors. Store failures (unreachable, timeout) wrap ErrUnavailable.
var (
	ErrNotFound    = errors.New("not found")
	ErrInvalid     = errors.New("invalid request")
	ErrUnavailable = errors.New("store unavailable")
)

// Why is what an ErrInvalid error says was wrong, without the words that
// say it is one ("invalid request: "): for an edge that names the bad input
// itself, a flag or a form field. Any other error is its whole message.
func Why(err error) string {
	msg := err.Error()
	if errors.Is(err, ErrInvalid) {
		return strings.TrimPrefix(msg, ErrInvalid.Error()+": ")
	}
	return msg
}

// ErrInconsistent is a store that knows it has lost writes it once
// acknowledged (emptied, rolled back, a row gone), so that a cancel it held
// may be gone too and no admission can be trusted. It wraps ErrUnavailable:
// every edge refuses with 503 (fail closed) until an operator acknowledges
// the loss. A store's error says which loss, and the way out.
var ErrInconsistent error = inconsistent{}

type inconsistent struct{}

func (inconsistent) Error() string { return "store lost acknowledged writes" }
func (inconsistent) Unwrap() error { return ErrUnavailable }

// Conflict is a transition refused by the row's current state.
type Conflict struct {
	// Code is a Refusal* reason or one of the Conflict* codes.
	Code   string
	Run    Run
	Intent *Intent
	Detail string
}

// Conflict codes besides the refusal reasons.
const (
	ConflictNotInFlight  = "intent_not_in_flight" // Finish on an intent that is not IN_FLIGHT
	ConflictNotUnknown   = "intent_not_unknown"   // Resolve on an intent that is not UNKNOWN
	ConflictStaleAttempt = "stale_attempt"        // Finish for an attempt that is not the latest
)

func (c *Conflict) Error() string {
	msg := fmt.Sprintf("%s: run %s is %s at cancel_version %d", c.Code, c.Run.ID, c.Run.Status, c.Run.CancelVersion)
	if c.Intent != nil {
		msg += fmt.Sprintf(", intent %s is %s", c.Intent.Key, c.Intent.State)
	}
	if c.Detail != "" {
		msg += ": " + c.Detail
	}
	return msg
}

// Limits on identifiers, so a key fits in any store and any header.
const (
	MaxRunIDLen  = 128
	MaxKeyLen    = 256
	MaxTextLen   = 1024 // reasons, notes, actors, sources
	MaxTargetLen = 4096
)

// ValidateRunID rejects ids that cannot be stored or printed safely.
func ValidateRunID(id string) error {
	if id == "" {
		return fmt.Errorf("%w: run id is empty", ErrInvalid)
	}
	if len(id) > MaxRunIDLen {
		return fmt.Errorf("%w: run id is %d bytes, longer than %d", ErrInvalid, len(id), MaxRunIDLen)
	}
	dots := 0
	for _, c := range id {
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.' || c == ':'
		if !ok {
			return fmt.Errorf("%w: run id %q has %q; use letters, digits and - _ . :", ErrInvalid, id, c)
		}
		if c == '.' {
			dots++
		}
	}
	// "." and ".." are path segments, not names: in a URL path they would
	// address another endpoint (/v1/runs/.. is /v1), so no run may have them.
	if dots == len(id) {
		return fmt.Errorf("%w: run id %q is only dots, which URL paths read as . or ..; use a letter or digit", ErrInvalid, id)
	}
	return nil
}

// The control API keys its queue claims and scheduled retries under these
// prefixes. No other effect may take a key under them, in any case (stores
// and readers compare keys as written, an operator reads them without
// case), so that an effect reported elsewhere can never block, or stand in
// for, a claim or a retry.
const (
	ClaimKeyPrefix = "claim:"
	RetryKeyPrefix = "retry:"
)

// ClaimKey is the intent key of the queue claim of step.
func ClaimKey(step string) string { return ClaimKeyPrefix + step }

// RetryKey is the intent key of the retry of step at attempt.
func RetryKey(step string, attempt int) string {
	return RetryKeyPrefix + step + ":" + strconv.Itoa(attempt)
}

// CheckUnreserved refuses a key that only the control API's claims and
// retries may take (ErrInvalid): every other edge that takes a key from its
// caller asks it.
func CheckUnreserved(key string) error {
	for _, prefix := range [...]string{ClaimKeyPrefix, RetryKeyPrefix} {
		if len(key) >= len(prefix) && strings.EqualFold(key[:len(prefix)], prefix) {
			return fmt.Errorf("%w: key %q starts with %q, which stopgate reserves for the queue claims and retries of the control API (/claims, /retries)", ErrInvalid, key, key[:len(prefix)])
		}
	}
	return nil
}

// ValidateKey rejects intent keys that cannot be stored or printed safely.
func ValidateKey(key string) error {
	if key == "" {
		return fmt.Errorf("%w: intent key is empty", ErrInvalid)
	}
	if len(key) > MaxKeyLen {
		return fmt.Errorf("%w: intent key is %d bytes, longer than %d", ErrInvalid, len(key), MaxKeyLen)
	}
	for _, c := range key {
		if c < 0x21 || c > 0x7e {
			return fmt.Errorf("%w: intent key %q has a byte outside printable ASCII", ErrInvalid, key)
		}
	}
	return nil
}
