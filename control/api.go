package control

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/stopgate/stopgate/state"
)

// The request and response bodies of the API. The CLI's client decodes the
// same types, so a field renamed here is renamed for both sides at once.

// AdmitRequest is the body of POST /v1/runs.
type AdmitRequest struct {
	RunID  string `json:"run_id"`
	Reason string `json:"reason,omitempty"`
	// Budget is the run's limits, on top of what the policy gives it
	// (docs/budgets.md); fixed in its row.
	Budget *BudgetRequest `json:"budget,omitempty"`
	// Labels choose the policy's budget rule; they are not stored.
	Labels map[string]string `json:"labels,omitempty"`
}

// BudgetRequest is a run's budget on the wire; a limit not given is none
// (or the policy's). Durations are Go durations ("30m"), the spend is USD.
type BudgetRequest state.BudgetWire

// BudgetRequestOf is b on the wire.
func BudgetRequestOf(b state.Budget) *BudgetRequest {
	out := BudgetRequest(b.Wire())
	return &out
}

// Budget is the budget the request gives, or what is wrong with it,
// naming the field.
func (r *BudgetRequest) Budget() (state.Budget, error) {
	if r == nil {
		return state.Budget{}, nil
	}
	b, err := state.BudgetWire(*r).Budget()
	if err != nil {
		return state.Budget{}, fmt.Errorf("%w: %w", state.ErrInvalid, err)
	}
	return b, b.Validate()
}

// CancelRequest is the body of POST /v1/runs/{run}/cancel. Every field is
// optional: an empty body cancels with the server's default drain.
type CancelRequest struct {
	Reason string `json:"reason,omitempty"`
	// DrainTimeout is how long in-flight work of the run may go on; nil
	// takes the server's default.
	DrainTimeout *Duration `json:"drain_timeout,omitempty"`
}

// CancelResponse is the answer to a cancel: the row as it stands, and
// whether this call moved it (false when it was already past ACTIVE).
type CancelResponse struct {
	Run     state.Run `json:"run"`
	Changed bool      `json:"changed"`
	// Tombstone: the run was never seen, and this cancel wrote its
	// CANCELLED tombstone (often a mistyped id, which the CLI says).
	Tombstone bool `json:"tombstone,omitempty"`
}

// CompleteRequest is the body of POST /v1/runs/{run}/complete.
type CompleteRequest struct {
	// CancelVersion is the version the caller observed; a run cancelled
	// since then is not completed (409 stale_version or run_not_active).
	CancelVersion int64  `json:"cancel_version"`
	Reason        string `json:"reason,omitempty"`
}

// RunList is the answer to GET /v1/runs.
type RunList struct {
	Runs []state.Run `json:"runs"`
	// More is how many runs matched beyond the query's limit.
	More int `json:"more,omitempty"`
}

// EventList is the answer to GET /v1/runs/{run}/events.
type EventList struct {
	Events []state.Event `json:"events"`
}

// IntentList is the answer to GET /v1/runs/{run}/intents.
type IntentList struct {
	Intents []state.Intent `json:"intents"`
}

// Audit is the answer to GET /v1/runs/{run}/audit, and what
// `stopgate audit RUN --json` prints.
type Audit struct {
	Run     state.Run      `json:"run"`
	Intents []state.Intent `json:"intents"`
	Events  []state.Event  `json:"events"`
}

// ClaimRequest is the body of POST /v1/runs/{run}/claims: a worker asks to
// take a queued step. The intent's key is "claim:<step_id>".
type ClaimRequest struct {
	StepID string `json:"step_id"`
	// CancelVersion is the version the worker observed; 0 checks ACTIVE alone.
	CancelVersion int64 `json:"cancel_version,omitempty"`
	// Worker holds the claim's lease; empty takes the request's actor.
	Worker string `json:"worker,omitempty"`
	// LeaseTTL is how long the claim lives unless the worker reports its
	// outcome; nil takes DefaultLeaseTTL. An expired claim becomes UNKNOWN.
	LeaseTTL *TTL `json:"lease_ttl,omitempty"`
}

// RetryRequest is the body of POST /v1/runs/{run}/retries: schedule attempt
// Attempt of a step at NotBefore. The intent's key is
// "retry:<step_id>:<attempt>"; a cancel revokes it while it is SCHEDULED.
type RetryRequest struct {
	StepID  string `json:"step_id"`
	Attempt int    `json:"attempt"`
	// NotBefore is RFC 3339. It is a string on the wire so that a bad time
	// is reported under its own field name.
	NotBefore     string `json:"not_before"`
	CancelVersion int64  `json:"cancel_version,omitempty"`
}

// DispatchRequest is the body of POST
// /v1/runs/{run}/retries/{step}/{attempt}/dispatch: run a scheduled retry.
type DispatchRequest struct {
	CancelVersion int64  `json:"cancel_version,omitempty"`
	Worker        string `json:"worker,omitempty"`
	LeaseTTL      *TTL   `json:"lease_ttl,omitempty"`
}

// IntentRequest is the body of POST /v1/runs/{run}/intents: the guard for
// an effect that does not travel through the egress proxy (an e-mail, a
// queue publish, a delivery).
type IntentRequest struct {
	// Key is the effect's idempotency key, required: a replay under the
	// same key is recognised, never dispatched twice at once.
	Key string `json:"key"`
	// Boundary is custom (default), delivery or browser.
	Boundary   state.Boundary `json:"boundary,omitempty"`
	Method     string         `json:"method,omitempty"`
	Target     string         `json:"target,omitempty"`
	BodyDigest string         `json:"body_digest,omitempty"`
	// CancelVersion is the version the caller observed; 0 checks the status alone.
	CancelVersion int64 `json:"cancel_version,omitempty"`
	LeaseTTL      *TTL  `json:"lease_ttl,omitempty"`
	// Carrier holds the lease; empty takes the request's actor.
	Carrier string `json:"carrier,omitempty"`
	// AllowCancelling admits a delivery while the run is CANCELLING; only
	// with boundary delivery.
	AllowCancelling bool `json:"allow_cancelling,omitempty"`
}

// GuardResponse is the 201 answer of an admitted claim, retry or intent.
type GuardResponse struct {
	Admitted bool         `json:"admitted"`
	Intent   state.Intent `json:"intent"`
	Run      state.Run    `json:"run"`
}

// RenewRequest is the body of POST /v1/runs/{run}/intents/{key}/renew: a
// worker's heartbeat on an effect it carries.
type RenewRequest struct {
	// Worker holds the lease; empty takes the request's actor.
	Worker   string `json:"worker,omitempty"`
	LeaseTTL *TTL   `json:"lease_ttl,omitempty"`
}

// RenewResponse is the renewed intent and the run's row: a worker that sees
// the run is no longer ACTIVE stops at its next safe checkpoint.
type RenewResponse struct {
	Intent state.Intent `json:"intent"`
	Run    state.Run    `json:"run"`
}

// OutcomeRequest is the body of PATCH /v1/runs/{run}/intents/{key}: what
// happened to an IN_FLIGHT effect.
type OutcomeRequest struct {
	// Outcome is responded, not_sent or unknown.
	Outcome    string `json:"outcome"`
	StatusCode int    `json:"status_code,omitempty"`
	// Attempt is the attempt the carrier dispatched; nil takes the
	// intent's current one. A stale attempt is refused (409 stale_attempt).
	Attempt *int   `json:"attempt,omitempty"`
	Reason  string `json:"reason,omitempty"`
}

// NoteRequest is the body of POST /v1/runs/{run}/intents/{key}/notes: one
// event about an effect of the run, in the run's audit, changing
// nothing else (stopgate exec records there the signal it sent at the
// cancel, and the kill at the drain deadline).
type NoteRequest struct {
	// Kind is the event's kind, exec.* or worker.*: the kinds stopgate
	// itself writes are not a caller's to forge.
	Kind   string `json:"kind"`
	Reason string `json:"reason,omitempty"`
}

// NoteKindPrefixes are the kinds a note through the API may have.
var NoteKindPrefixes = []string{"exec.", "worker."}

// Outcomes of OutcomeRequest.
const (
	OutcomeResponded = "responded"
	OutcomeNotSent   = "not_sent"
	OutcomeUnknown   = "unknown"
)

// ResolveRequest is the body of POST /v1/runs/{run}/intents/{key}/resolve:
// what reconciliation found out about an UNKNOWN effect.
type ResolveRequest struct {
	// Outcome is applied or not_applied.
	Outcome string `json:"outcome"`
	// Source is where the answer came from: "operator" by default; for a
	// signed webhook, the configured source whose secret signed the body.
	Source string `json:"source,omitempty"`
	Note   string `json:"note,omitempty"`
	// RunID and Key name the intent inside the signed body. A webhook must
	// send them, so that a body signed for one intent cannot be replayed
	// against another; an operator may.
	RunID string `json:"run_id,omitempty"`
	Key   string `json:"key,omitempty"`
}

// Outcomes of ResolveRequest.
const (
	OutcomeApplied    = "applied"
	OutcomeNotApplied = "not_applied"
)

// Every answer that is not a success is a refusal.Refusal: its JSON body
// ({"error": code, "message": ...} and, when a run's row decided it, the
// run's fields) is the same on every edge of stopgate.

// Duration is a drain timeout on the wire: a Go duration string ("30s",
// "1m30s") or a number of seconds (30, 0.5). It is written back as a string.
type Duration time.Duration

// UnmarshalJSON accepts both spellings, so a shell script can send 30 and a
// Go program can send "30s".
func (d *Duration) UnmarshalJSON(b []byte) error {
	return unmarshalDuration("drain_timeout", b, (*time.Duration)(d))
}

// MarshalJSON writes the duration as a Go duration string.
func (d Duration) MarshalJSON() ([]byte, error) {
	return json.Marshal(time.Duration(d).String())
}

// TTL is a lease TTL on the wire, spelt like Duration. It is a type of its
// own so that a bad value is reported under its own field name: the JSON
// decoder does not say which field a custom unmarshaler failed on.
type TTL time.Duration

// UnmarshalJSON accepts "10m" or a number of seconds.
func (d *TTL) UnmarshalJSON(b []byte) error {
	return unmarshalDuration("lease_ttl", b, (*time.Duration)(d))
}

// MarshalJSON writes the TTL as a Go duration string.
func (d TTL) MarshalJSON() ([]byte, error) {
	return json.Marshal(time.Duration(d).String())
}

func unmarshalDuration(field string, b []byte, d *time.Duration) error {
	s := strings.TrimSpace(string(b))
	if s == "null" {
		return nil
	}
	if strings.HasPrefix(s, `"`) {
		var str string
		if err := json.Unmarshal(b, &str); err != nil {
			return err
		}
		v, err := parseDuration(field, str)
		if err != nil {
			return err
		}
		*d = v
		return nil
	}
	secs, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return fmt.Errorf("%s: want a duration such as \"30s\" or a number of seconds, got %s", field, s)
	}
	v, err := secondsToDuration(field, secs)
	if err != nil {
		return err
	}
	*d = v
	return nil
}

// ParseDuration reads a drain timeout as a Go duration ("30s") or a bare
// number of seconds ("30"), the two forms the API and the CLI accept.
func ParseDuration(s string) (time.Duration, error) {
	return parseDuration("drain_timeout", s)
}

// ParseTTL reads a lease TTL in the same two forms as ParseDuration.
func ParseTTL(s string) (time.Duration, error) {
	return parseDuration("lease_ttl", s)
}

func parseDuration(field, s string) (time.Duration, error) {
	s = strings.TrimSpace(s)
	if v, err := time.ParseDuration(s); err == nil {
		return v, nil
	}
	secs, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return 0, fmt.Errorf("%s: want a duration such as \"30s\" or a number of seconds, got %q", field, s)
	}
	return secondsToDuration(field, secs)
}

func secondsToDuration(field string, secs float64) (time.Duration, error) {
	// Bound before converting: a float beyond int64 nanoseconds would wrap.
	const maxSecs = float64(1<<63-1) / float64(time.Second)
	if secs != secs || secs > maxSecs || secs < -maxSecs {
		return 0, fmt.Errorf("%s: %v seconds is out of range", field, secs)
	}
	return time.Duration(secs * float64(time.Second)), nil
}
