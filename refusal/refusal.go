// Package refusal decides what it means when stopgate does not do what it
// was asked: the reason code, the HTTP status that every edge answers it
// with, the message that says what was wrong, and the fields of the
// contract's refusal body. The egress proxy (plain requests and tunnels),
// the browser guard and the control API only render a Refusal — as an HTTP
// JSON answer or as a CDP error frame — so the same reason gets the same
// status and the same words everywhere, and a fix lands once.
//
// It never records anything and never talks to the store: a refusal is the
// answer to a decision taken elsewhere (the guard's, or a check at the
// edge). It never decides policy either; it only names the outcome.
package refusal

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/stopgate/stopgate/state"
)

// Headers stopgate answers in. Only stopgate speaks in them: the egress
// proxy removes them from an upstream's answer.
const (
	// Header carries the refusal's code on every refusal.
	Header = "X-Stopgate-Refusal"
	// IntentHeader carries the key an effect is recorded under.
	IntentHeader = "X-Stopgate-Intent"
	// ShouldRetryHeader is "false" on every refusal a retry cannot change
	// (Code.Retryable): the OpenAI and Anthropic SDKs obey it.
	ShouldRetryHeader = "X-Should-Retry"
)

// Code is a refusal's reason: stable, for programs. Its HTTP status is
// fixed by Status, the one table of this package.
type Code string

// The codes. The guard's own reasons keep the names package state gives
// them, so a refusal recorded in the ledger and the answer the caller got
// say the same word.
const (
	// The guard refused the effect because of the run's row.
	RunNotActive     Code = state.RefusalRunNotActive
	StaleVersion     Code = state.RefusalStaleVersion
	RunNotAdmitted   Code = state.RefusalRunNotAdmitted
	IntentInProgress Code = state.RefusalInProgress
	KeyReused        Code = state.RefusalKeyReused

	// A transition other than the guard refused by the row (control API).
	IntentNotInFlight Code = state.ConflictNotInFlight
	IntentNotUnknown  Code = state.ConflictNotUnknown
	StaleAttempt      Code = state.ConflictStaleAttempt
	// StoreNotReset: control API, an acknowledgement of a reset of a store
	// whose marker does not say reset.
	StoreNotReset Code = "store_not_reset"

	// Who is asking.
	NoRunIdentity  Code = "no_run_identity"  // no run named where one is needed
	BadRunIdentity Code = "bad_run_identity" // a run named in a way that cannot be read
	Unauthorized   Code = "unauthorized"     // control plane: no or wrong bearer token
	BadSignature   Code = "bad_signature"    // control plane: a webhook's signature is missing or wrong
	Forbidden      Code = "forbidden"        // control plane: the token's scope does not allow it

	// What is asked.
	InvalidRequest       Code = "invalid_request"        // a field, header, path or query value is not valid
	InvalidJSON          Code = "invalid_json"           // the body is not JSON of the right shape
	UnknownField         Code = "unknown_field"          // the body has a field the endpoint does not take
	BadRequestBody       Code = "bad_request_body"       // the request body could not be read whole
	BodyTooLarge         Code = "body_too_large"         // the body is over the limit
	UnsupportedMediaType Code = "unsupported_media_type" // the body is not JSON
	NotAProxyRequest     Code = "not_a_proxy_request"    // the egress proxy got an origin-form request
	NotFound             Code = "not_found"              // no such run, intent or endpoint
	MethodNotAllowed     Code = "method_not_allowed"

	// Where it would go.
	DestinationDenied    Code = "destination_denied"    // the policy does not allow the destination
	InterceptionDisabled Code = "interception_disabled" // no CA to look inside the tunnel, and the host is not pass-through
	TooManyConnections   Code = "too_many_connections"  // a cap on open connections was reached
	HostNotAllowed       Code = "host_not_allowed"      // the browser guard answers only to an IP or localhost Host
	CommandNotAllowed    Code = "command_not_allowed"   // the browser guard never forwards this command (local files, downloads, browser features)

	// Transparent mode: connections the kernel redirected to stopgate.
	NotHTTPOrTLS           Code = "not_http_or_tls"           // neither an HTTP request nor a TLS ClientHello: closed, never spliced
	NotRedirected          Code = "not_redirected"            // a connection made to the transparent listener itself
	NotATransparentRequest Code = "not_a_transparent_request" // a CONNECT on a connection that already goes through stopgate
	TransparentOff         Code = "transparent_off"           // control API: serve has no --transparent-addr
	UIDBound               Code = "uid_bound"                 // control API: the uid already has a transparent binding

	// PolicyInvalid: a reload found a policy file that does not parse or
	// validate; the policy in force stays as it was.
	PolicyInvalid Code = "policy_invalid"

	// What failed.
	StoreUnavailable   Code = "store_unavailable"   // the state store did not answer in time: fail closed
	UpstreamFailed     Code = "upstream_failed"     // the upstream could not be reached or failed mid-answer
	BrowserUnavailable Code = "browser_unavailable" // no browser could be started for the run
	BrowserLimit       Code = "browser_limit"       // the cap on browsers running at once was reached
	BrowserUnreachable Code = "browser_unreachable" // the run's browser did not answer the guard
	NoBrowser          Code = "no_browser"          // the run has no browser running
	Internal           Code = "internal"            // a bug; logged with its stack

	// ClientGone is not an answer anyone reads: the caller went away while
	// the request was being read or guarded. It is logged and counted as
	// the client's doing, never as a store failure.
	ClientGone Code = "client_gone"
)

// StatusClientClosed is the status a ClientGone refusal is logged with (the
// convention nginx set); nobody receives it.
const StatusClientClosed = 499

// Status is the HTTP status of a code, on every edge that answers over
// HTTP. docs/refusals.md is this table in prose.
func (c Code) Status() int {
	switch c {
	case RunNotActive, StaleVersion, RunNotAdmitted, IntentInProgress, KeyReused,
		IntentNotInFlight, IntentNotUnknown, StaleAttempt, UIDBound, StoreNotReset:
		return http.StatusConflict
	case PolicyInvalid:
		return http.StatusUnprocessableEntity
	case NoRunIdentity:
		return http.StatusProxyAuthRequired
	case Unauthorized, BadSignature:
		return http.StatusUnauthorized
	case Forbidden, DestinationDenied, InterceptionDisabled, HostNotAllowed, CommandNotAllowed:
		return http.StatusForbidden
	case BadRunIdentity, InvalidRequest, InvalidJSON, UnknownField, BadRequestBody, NotAProxyRequest, NotHTTPOrTLS, NotRedirected:
		return http.StatusBadRequest
	case BodyTooLarge:
		return http.StatusRequestEntityTooLarge
	case UnsupportedMediaType:
		return http.StatusUnsupportedMediaType
	case NotFound, NoBrowser, TransparentOff:
		return http.StatusNotFound
	case MethodNotAllowed, NotATransparentRequest:
		return http.StatusMethodNotAllowed
	case TooManyConnections:
		return http.StatusTooManyRequests
	case StoreUnavailable, BrowserUnavailable, BrowserLimit:
		return http.StatusServiceUnavailable
	case UpstreamFailed, BrowserUnreachable:
		return http.StatusBadGateway
	case ClientGone:
		return StatusClientClosed
	}
	return http.StatusInternalServerError
}

// Retryable reports whether the same request, sent again, may be answered
// otherwise: a refusal about load or a failure (429, 5xx) may pass later,
// and so may intent_in_progress once its first attempt is over. Every
// other refusal is about the request or the run, which a retry does not
// change: its answers carry X-Should-Retry: false, which the OpenAI and
// Anthropic SDKs obey instead of retrying a 409 (three refused intents per
// call, each recorded).
func (c Code) Retryable() bool {
	if c == IntentInProgress {
		return true
	}
	s := c.Status()
	return s == http.StatusTooManyRequests || s >= http.StatusInternalServerError
}

// Refusal is one refused request or effect: why, in a code and in words,
// and, when a run's row decided it, the row and what was recorded.
type Refusal struct {
	Code    Code
	Message string

	// RunID is the run the request named; empty when none was read.
	RunID string
	// Run is the row that decided the refusal, as the store saw it in the
	// same atomic step; nil when no row decided it (or none exists).
	Run *state.Run
	// ObservedVersion is the cancel_version the caller carried (0: none).
	ObservedVersion int64
	// Intent is the key the effect is recorded under, if any.
	Intent string
	// IntentState is the state of the existing intent that refused a
	// replay (intent_in_progress, idempotency_key_reused).
	IntentState state.IntentState
	// Record is the existing intent that refused a replay, as it stands:
	// the recorded answer of a key whose effect is under way or over.
	Record *state.Intent
	// Recorded is what the ledger now says of this effect: the guard's
	// CANCELLED_BEFORE_DISPATCH, or the outcome of an admitted effect that
	// was then cut or failed (NOT_SENT, UNKNOWN, NOT_APPLIED).
	Recorded state.IntentState

	// Err is the cause, for logs; it is never rendered to the caller.
	Err error
}

func (r *Refusal) Error() string { return string(r.Code) + ": " + r.Message }

// Unwrap lets errors.Is find the cause (state.ErrUnavailable, say).
func (r *Refusal) Unwrap() error { return r.Err }

// Status is the HTTP status the refusal is answered with.
func (r *Refusal) Status() int { return r.Code.Status() }

// New is a refusal decided at an edge, before or instead of a store call.
func New(code Code, format string, args ...any) *Refusal {
	return &Refusal{Code: code, Message: fmt.Sprintf(format, args...)}
}

// Wrap is New with the cause kept for logs (and for errors.Is).
func Wrap(err error, code Code, format string, args ...any) *Refusal {
	r := New(code, format, args...)
	r.Err = err
	return r
}

// FromGuard is the refusal of an effect the guard did not admit. req is
// what was asked, res the guard's answer.
func FromGuard(req state.GuardRequest, res state.GuardResult) *Refusal {
	r := &Refusal{
		Code: Code(res.Refusal), RunID: req.RunID, ObservedVersion: req.ObservedVersion, Intent: res.Intent.Key,
	}
	if res.Refusal != state.RefusalRunNotAdmitted {
		row := res.Run
		r.Run = &row
	}
	switch r.Code {
	case RunNotActive, StaleVersion:
		r.Recorded = state.IntentCancelledBeforeDispatch
		r.Message = fmt.Sprintf("run %s is %s at cancel_version %d (the request observed %s): nothing was sent; recorded %s under %s",
			req.RunID, res.Run.Status, res.Run.CancelVersion, observed(req.ObservedVersion), state.IntentCancelledBeforeDispatch, res.Intent.Key)
	case RunNotAdmitted:
		r.Message = fmt.Sprintf("run %s was never admitted and auto-admit is off: admit it first (stopgate admit %s); nothing was sent or recorded",
			req.RunID, req.RunID)
	case IntentInProgress:
		r.IntentState, r.Record = res.Intent.State, &res.Intent
		r.Message = fmt.Sprintf("intent %s of run %s is %s: no second dispatch while the first is unresolved; nothing was sent",
			res.Intent.Key, req.RunID, res.Intent.State)
	case KeyReused:
		r.IntentState, r.Record = res.Intent.State, &res.Intent
		r.Message = keyReused(req, res.Intent)
	default:
		r.Message = fmt.Sprintf("the guard refused %s of run %s: %s; nothing was sent", res.Intent.Key, req.RunID, res.Refusal)
	}
	return r
}

// keyReused says why a key that names a record may not dispatch: the
// record is another effect, or its effect is over (state.ReplayRefusal).
func keyReused(req state.GuardRequest, rec state.Intent) string {
	switch {
	case rec.Boundary != req.Boundary || rec.Method != req.Method || rec.Target != req.Target:
		return fmt.Sprintf("idempotency key %s of run %s names another effect (%s %s %s, %s): one key, one effect; nothing was sent",
			rec.Key, req.RunID, rec.Boundary, rec.Method, rec.Target, rec.State)
	case rec.BodyDigest != "" && req.BodyDigest != "" && rec.BodyDigest != req.BodyDigest:
		return fmt.Sprintf("idempotency key %s of run %s was used for a different request body: one key, one effect; nothing was sent",
			rec.Key, req.RunID)
	}
	answer := string(rec.State)
	if rec.StatusCode != 0 {
		answer += " " + strconv.Itoa(rec.StatusCode)
	}
	return fmt.Sprintf("idempotency key %s of run %s names an effect that is over (%s after %d attempt(s)): its record stands as it is, in intent_record; nothing was sent",
		rec.Key, req.RunID, answer, rec.Attempts)
}

// Over is the refusal of what a run that is over (CANCELLED, COMPLETED,
// UNKNOWN) tries next — a connection to its lingering browser, say —
// where no guard was asked: what says what was refused.
func Over(row state.Run, what string) *Refusal {
	return &Refusal{
		Code: RunNotActive, RunID: row.ID, Run: &row,
		Message: fmt.Sprintf("run %s is %s at cancel_version %d: %s", row.ID, row.Status, row.CancelVersion, what),
	}
}

func observed(v int64) string {
	if v == 0 {
		return "none"
	}
	return strconv.FormatInt(v, 10)
}

// FromError is the refusal an error stands for: a *Refusal as it is; a
// *state.Conflict as its code, with the row; the store's error kinds
// (state.ErrInvalid, ErrNotFound, ErrUnavailable and deadlines) as their
// codes; a cancelled context as ClientGone; anything else Internal.
func FromError(err error) *Refusal {
	var r *Refusal
	var conflict *state.Conflict
	switch {
	case err == nil:
		return nil
	case errors.As(err, &r):
		return r
	case errors.As(err, &conflict):
		row := conflict.Run
		// The conflict's text leads with its code, which Error and every
		// rendering put in front again: the message is what follows it.
		msg := strings.TrimPrefix(conflict.Error(), conflict.Code+": ")
		out := &Refusal{Code: Code(conflict.Code), Message: msg, RunID: row.ID, Run: &row, Err: err}
		if conflict.Intent != nil {
			out.Intent = conflict.Intent.Key
			out.IntentState = conflict.Intent.State
		}
		return out
	case errors.Is(err, context.Canceled):
		// Before ErrUnavailable: a store call cut short because its
		// caller went away reports both, and it is not a store failure.
		return Wrap(err, ClientGone, "the client went away before an answer: %v", err)
	case errors.Is(err, state.ErrInvalid):
		return Wrap(err, InvalidRequest, "%v", err)
	case errors.Is(err, state.ErrNotFound):
		return Wrap(err, NotFound, "%v", err)
	case errors.Is(err, state.ErrInconsistent):
		// Before ErrUnavailable, which it wraps: the store answered, and
		// its error says what it lost and the way out.
		return Wrap(err, StoreUnavailable, "nothing was done (fail closed): %v", err)
	case errors.Is(err, state.ErrUnavailable), errors.Is(err, context.DeadlineExceeded):
		return Wrap(err, StoreUnavailable, "the run state store did not answer in time, so nothing was done (fail closed): %v", err)
	}
	return Wrap(err, Internal, "internal error: %v", err)
}
