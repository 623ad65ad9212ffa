package evidence

import (
	"encoding/json"
	"net/http"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/state"
)

// Attempt is one effect a client tried through the proxy, as the client saw
// it. Every attempt carries an Idempotency-Key that is also the last part
// of its URL path, so the upstream's count, the client's answer and the
// ledger's record of one effect meet on one key.
type Attempt struct {
	Run     string
	Key     string
	Started time.Time
	// Ended is when the client had its answer (or its error).
	Ended time.Time
	// Status is the HTTP status the client got (0: no answer at all).
	Status int
	// Code is the refusal's X-Stopgate-Refusal, Recorded its "recorded".
	Code     string
	Recorded string
	Err      error
}

// SetAnswer fills Status, Code and Recorded from the proxy's answer.
func (a *Attempt) SetAnswer(resp *http.Response, body []byte) {
	a.Status = resp.StatusCode
	a.Code = resp.Header.Get("X-Stopgate-Refusal")
	if a.Code != "" {
		var b struct {
			Recorded string `json:"recorded"`
		}
		_ = json.Unmarshal(body, &b)
		a.Recorded = b.Recorded
	}
}

// RefusedBeforeSending reports whether stopgate told the client that
// nothing was sent: a refusal of the guard, a store that did not answer.
// A cut (run_not_active recorded UNKNOWN) or an upstream failure is not.
func (a Attempt) RefusedBeforeSending() bool {
	switch a.Code {
	case "store_unavailable", "intent_in_progress", "idempotency_key_reused", "run_not_admitted",
		"destination_denied", "no_run_identity", "bad_run_identity", "body_too_large":
		return true
	case state.RefusalRunNotActive, state.RefusalStaleVersion:
		return a.Recorded == string(state.IntentCancelledBeforeDispatch)
	}
	return false
}

// CountLeaks adds to r.Leaked every effect an upstream counted that
// nothing authorized. hits is the upstream's own count by key; cancelled
// is when each cancelled run's cancel was acknowledged; audits are the
// runs' records afterwards. An effect is authorized when some attempt under
// its key was not refused, started before its run's cancel was
// acknowledged, and the ledger holds an intent admitted for it; each
// such attempt covers at most one arrival.
func CountLeaks(r *Round, attempts []Attempt, hits map[string]int, cancelled map[string]time.Time, audits map[string]control.Audit) {
	byKey := map[string][]Attempt{}
	for _, a := range attempts {
		byKey[a.Key] = append(byKey[a.Key], a)
	}
	for key, n := range hits {
		if n == 0 {
			continue
		}
		as := byKey[key]
		if len(as) == 0 {
			r.Fail(&r.Leaked, "upstream got %d request(s) under key %s that no client of the test sent", n, key)
			continue
		}
		run := as[0].Run
		covered := 0
		for _, a := range as {
			ack, wasCancelled := cancelled[run]
			switch {
			case a.RefusedBeforeSending():
			case wasCancelled && a.Started.After(ack):
			default:
				covered++
			}
		}
		if n > covered {
			r.Fail(&r.Leaked, "run %s key %s: upstream counted %d, but only %d attempt(s) could have sent it (the others were refused, or started after the cancel was acknowledged)", run, key, n, covered)
			continue
		}
		in, ok := intentOf(audits[run], key)
		switch {
		case !ok:
			r.Fail(&r.Leaked, "run %s key %s reached the upstream %d time(s) and the ledger has no intent for it", run, key, n)
		case in.Attempts < n || in.State == state.IntentCancelledBeforeDispatch:
			r.Fail(&r.Leaked, "run %s key %s reached the upstream %d time(s); the ledger admitted it %d time(s) and says %s", run, key, n, in.Attempts, in.State)
		}
	}
}

func intentOf(a control.Audit, key string) (state.Intent, bool) {
	for _, in := range a.Intents {
		if in.Key == key {
			return in, true
		}
	}
	return state.Intent{}, false
}

// CheckCancelKept adds to r.Lost when the run's record does not show the
// acknowledged cancel: the row past ACTIVE at version 2 with the
// operator's reason, and exactly one cancel event.
func CheckCancelKept(r *Round, a control.Audit, reason string) {
	row := a.Run
	if row.Status == state.StatusActive || row.Status == state.StatusCompleted || row.CancelVersion != 2 || row.Reason != reason {
		r.Fail(&r.Lost, "run %s after an acknowledged cancel (%q) is %s at version %d (reason %q)", row.ID, reason, row.Status, row.CancelVersion, row.Reason)
		return
	}
	n := 0
	for _, e := range a.Events {
		if e.Kind == state.EventRunCancelled {
			n++
		}
	}
	if n != 1 {
		r.Fail(&r.Lost, "run %s has %d cancel events, want exactly 1", row.ID, n)
	}
}

// Explain adds to r.Unexplained whatever in the run's record an operator
// could not explain from the record alone. refused gives, for the keys
// whose clients were told nothing was sent, when they were told: an intent
// admitted under such a key after that moment is a late record (a guard
// that ran once its caller had given up); one admitted before it is a lost
// reply, which the record must show as UNKNOWN or reconciled, never as
// sent.
func Explain(r *Round, a control.Audit, refused map[string]time.Time) {
	run := a.Run.ID
	bad := func(format string, args ...any) {
		r.Fail(&r.Unexplained, "run %s: "+format, append([]any{run}, args...)...)
	}
	if len(a.Events) == 0 {
		bad("no events")
		return
	}
	intents := map[string]state.Intent{}
	counts := map[state.IntentState]int{}
	for _, in := range a.Intents {
		intents[in.Key] = in
		counts[in.State]++
	}
	for st, n := range a.Run.Intents {
		if counts[st] != n {
			bad("the row counts %d %s intents, the ledger lists %d", n, st, counts[st])
		}
	}
	cancelledAt := -1
	admittedAt := map[string]time.Time{} // intent key → its first admission
	lastTo := map[string]string{}        // intent key → the state its last transition gave it
	refusedOnly := map[string]bool{}
	runStatus := ""
	for i, e := range a.Events {
		if e.At.IsZero() || e.Actor == "" || e.Kind == "" {
			bad("event %d (%s) lacks time, actor or kind", i, e.Kind)
		}
		if i > 0 && e.At.Before(a.Events[i-1].At) {
			bad("event %d (%s at %s) is older than the one before it", i, e.Kind, e.At)
		}
		switch e.Kind {
		case state.EventRunAdmitted, state.EventRunCancelled, state.EventRunTransition, state.EventRunCompleted:
			if e.Kind == state.EventRunCancelled {
				if cancelledAt >= 0 {
					bad("a second cancel event (%d)", i)
				}
				cancelledAt = i
				if e.Reason == "" {
					bad("the cancel event has no reason")
				}
			}
			if e.Kind == state.EventRunTransition && e.Reason == "" {
				bad("transition to %s has no reason", e.To)
			}
			runStatus = e.To
		case state.EventIntentRefused:
			if e.Reason == "" {
				bad("refusal of %s has no reason", e.Intent)
			}
			if _, seen := lastTo[e.Intent]; !seen {
				refusedOnly[e.Intent] = true
			}
		default:
			if e.Intent == "" {
				bad("event %d (%s) names no intent", i, e.Kind)
				continue
			}
			if e.To == "" {
				// A note (a cut of an effect whose outcome is recorded)
				// changes no state, and must say why.
				if e.Reason == "" {
					bad("%s of intent %s has no reason", e.Kind, e.Intent)
				}
				continue
			}
			if e.Kind == state.EventIntentAdmitted {
				if cancelledAt >= 0 && intents[e.Intent].Boundary != state.BoundaryDelivery {
					bad("intent %s admitted after the cancel committed", e.Intent)
				}
				if _, ok := admittedAt[e.Intent]; !ok {
					admittedAt[e.Intent] = e.At
				}
			}
			if e.To == string(state.IntentUnknown) && e.Reason == "" {
				bad("intent %s became UNKNOWN without a reason", e.Intent)
			}
			lastTo[e.Intent] = e.To
			delete(refusedOnly, e.Intent)
		}
	}
	if runStatus != string(a.Run.Status) {
		bad("the row says %s, the last run event says %s", a.Run.Status, runStatus)
	}
	for key, in := range intents {
		switch to, ok := lastTo[key]; {
		case ok && to != string(in.State):
			bad("intent %s is %s, its last transition in the log says %s", key, in.State, to)
		case !ok && !(refusedOnly[key] && in.State == state.IntentCancelledBeforeDispatch):
			bad("intent %s is %s and no event put it there", key, in.State)
		}
		if in.State == state.IntentUnknown && in.Reason == "" {
			bad("intent %s is UNKNOWN without a reason", key)
		}
		if told, ok := refused[key]; ok && in.Attempts > 0 && in.State != state.IntentCancelledBeforeDispatch {
			switch at := admittedAt[key]; {
			case at.After(told):
				bad("intent %s was admitted at %s, after its client was told at %s that nothing was sent: a late record",
					key, at.Format(time.StampMilli), told.Format(time.StampMilli))
			case in.State == state.IntentInFlight || in.State == state.IntentResponded || in.State == state.IntentNotSent:
				bad("intent %s is %s, but its client was told nothing was sent (a lost reply must end UNKNOWN, then reconciled)", key, in.State)
			}
		}
	}
	switch a.Run.Status {
	case state.StatusCancelled:
		if counts[state.IntentInFlight]+counts[state.IntentUnknown]+counts[state.IntentScheduled] > 0 {
			bad("CANCELLED with intents in flight, scheduled or unknown: %v", counts)
		}
	case state.StatusCancelling, state.StatusUnknown:
		if cancelledAt < 0 {
			bad("%s without a cancel event", a.Run.Status)
		}
	}
}

// RefusedKeys gives the keys of attempts that were refused before sending
// and never tried with another outcome, with when the client was first told.
func RefusedKeys(attempts []Attempt) map[string]time.Time {
	out := map[string]time.Time{}
	other := map[string]bool{}
	for _, a := range attempts {
		if !a.RefusedBeforeSending() {
			other[a.Key] = true
		} else if t, ok := out[a.Key]; !ok || a.Ended.Before(t) {
			out[a.Key] = a.Ended
		}
	}
	for k := range other {
		delete(out, k)
	}
	return out
}
