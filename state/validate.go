package state

import (
	"fmt"
	"slices"
	"time"
	"unicode/utf8"
)

// MaxDrainTimeout bounds a cancel's drain: a run cancelling for longer is
// a run nobody is watching; an effect that needs longer must be reconciled.
const MaxDrainTimeout = 7 * 24 * time.Hour

// CheckDrainTimeout says what is wrong with d as a cancel's drain
// (ErrInvalid): negative, or longer than MaxDrainTimeout. Zero is the
// caller's default.
func CheckDrainTimeout(d time.Duration) error {
	if d < 0 {
		return fmt.Errorf("%w: drain timeout %s is negative", ErrInvalid, d)
	}
	if d > MaxDrainTimeout {
		return fmt.Errorf("%w: drain timeout %s is longer than 7 days", ErrInvalid, d)
	}
	return nil
}

// Validation is shared by both stores so that bad input gets the same
// answer whichever store is behind it.

func validateText(field, s string) error {
	if len(s) > MaxTextLen {
		return fmt.Errorf("%w: %s is %d bytes, longer than %d", ErrInvalid, field, len(s), MaxTextLen)
	}
	return nil
}

// Validate checks an admission.
func (r AdmitRequest) Validate() error {
	if err := ValidateRunID(r.RunID); err != nil {
		return err
	}
	if err := validateText("actor", r.Actor); err != nil {
		return err
	}
	if err := r.Budget.Validate(); err != nil {
		return err
	}
	return validateText("reason", r.Reason)
}

// Validate checks a cancel.
func (r CancelRequest) Validate() error {
	if err := ValidateRunID(r.RunID); err != nil {
		return err
	}
	if err := CheckDrainTimeout(r.DrainTimeout); err != nil {
		return err
	}
	if err := validateText("actor", r.Actor); err != nil {
		return err
	}
	return validateText("reason", r.Reason)
}

// Validate checks a completion.
func (r CompleteRequest) Validate() error {
	if err := ValidateRunID(r.RunID); err != nil {
		return err
	}
	if r.Version < 1 {
		return fmt.Errorf("%w: cancel_version %d: completing a run needs the version it observed (1 or more)", ErrInvalid, r.Version)
	}
	if err := validateText("actor", r.Actor); err != nil {
		return err
	}
	return validateText("reason", r.Reason)
}

// Validate checks a guard request.
func (r GuardRequest) Validate() error {
	if err := ValidateRunID(r.RunID); err != nil {
		return err
	}
	if err := ValidateKey(r.Key); err != nil {
		return err
	}
	if r.ObservedVersion < 0 {
		return fmt.Errorf("%w: observed cancel_version %d is negative", ErrInvalid, r.ObservedVersion)
	}
	if !slices.Contains(Boundaries, r.Boundary) {
		return fmt.Errorf("%w: unknown boundary %q", ErrInvalid, r.Boundary)
	}
	if len(r.Target) > MaxTargetLen {
		return fmt.Errorf("%w: target is %d bytes, longer than %d", ErrInvalid, len(r.Target), MaxTargetLen)
	}
	if r.NotBefore.IsZero() && r.LeaseTTL <= 0 {
		return fmt.Errorf("%w: an effect dispatched now needs a lease TTL", ErrInvalid)
	}
	for field, v := range map[string]string{"method": r.Method, "body digest": r.BodyDigest, "lease owner": r.LeaseOwner, "actor": r.Actor, "refusal": r.Refuse} {
		if err := validateText(field, v); err != nil {
			return err
		}
	}
	if err := r.Budget.Validate(); err != nil {
		return err
	}
	if r.RequestBytes < 0 {
		return fmt.Errorf("%w: request bytes %d is negative", ErrInvalid, r.RequestBytes)
	}
	if r.Tripwire != "" {
		if r.Refuse != "" {
			return fmt.Errorf("%w: a guard is refused by the edge (%s) or meets a tripwire (%s), not both", ErrInvalid, r.Refuse, r.Tripwire)
		}
		if err := ValidateRuleName(r.Tripwire); err != nil {
			return err
		}
	}
	if r.TripwireDrain < 0 || r.TripwireDrain > 7*24*time.Hour {
		return fmt.Errorf("%w: tripwire drain %s: want 0 to 7 days", ErrInvalid, r.TripwireDrain)
	}
	return nil
}

// MaxRuleNameLen bounds the name of a policy rule a reason names.
const MaxRuleNameLen = 64

// ValidateRuleName rejects a rule name (a tripwire's) that a reason
// (tripwire:<rule>) could not carry plainly.
func ValidateRuleName(name string) error {
	if name == "" || len(name) > MaxRuleNameLen {
		return fmt.Errorf("%w: rule name %q: want 1 to %d bytes", ErrInvalid, name, MaxRuleNameLen)
	}
	for _, c := range name {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Errorf("%w: rule name %q has %q; use letters, digits and . _ -", ErrInvalid, name, c)
		}
	}
	return nil
}

// Validate checks an outcome report.
func (r FinishRequest) Validate() error {
	if err := ValidateRunID(r.RunID); err != nil {
		return err
	}
	if err := ValidateKey(r.Key); err != nil {
		return err
	}
	switch r.Outcome {
	case IntentResponded, IntentNotSent, IntentUnknown:
		if r.Source != "" {
			return fmt.Errorf("%w: source %q: a source goes only with outcome NOT_APPLIED", ErrInvalid, r.Source)
		}
	case IntentNotApplied:
		if r.Source != SourceSafeMethod && r.Source != SourcePolicy {
			return fmt.Errorf("%w: outcome NOT_APPLIED needs source %q or %q (got %q): an UNKNOWN is reconciled with Resolve", ErrInvalid, SourceSafeMethod, SourcePolicy, r.Source)
		}
	default:
		return fmt.Errorf("%w: outcome %q: want RESPONDED, NOT_SENT, UNKNOWN or NOT_APPLIED", ErrInvalid, r.Outcome)
	}
	if r.Attempt < 1 {
		return fmt.Errorf("%w: attempt %d: want the attempt number the guard returned (1 or more)", ErrInvalid, r.Attempt)
	}
	if r.StatusCode < 0 || r.StatusCode > 999 {
		return fmt.Errorf("%w: status code %d is not an HTTP status", ErrInvalid, r.StatusCode)
	}
	if r.ResponseBytes < 0 {
		return fmt.Errorf("%w: response bytes %d is negative", ErrInvalid, r.ResponseBytes)
	}
	if err := r.LLM.Validate(); err != nil {
		return err
	}
	if err := validateText("actor", r.Actor); err != nil {
		return err
	}
	return validateText("reason", r.Reason)
}

// Validate checks a reconciliation.
func (r ResolveRequest) Validate() error {
	if err := ValidateRunID(r.RunID); err != nil {
		return err
	}
	if err := ValidateKey(r.Key); err != nil {
		return err
	}
	if r.Source == "" {
		return fmt.Errorf("%w: a resolution needs its source (operator, webhook, lookup)", ErrInvalid)
	}
	for field, v := range map[string]string{"source": r.Source, "note": r.Note, "actor": r.Actor} {
		if err := validateText(field, v); err != nil {
			return err
		}
	}
	return nil
}

// MaxKindLen bounds a note's kind.
const MaxKindLen = 64

// Validate checks a note.
func (r NoteRequest) Validate() error {
	if err := ValidateRunID(r.RunID); err != nil {
		return err
	}
	if err := ValidateKey(r.Key); err != nil {
		return err
	}
	if r.Kind == "" || len(r.Kind) > MaxKindLen {
		return fmt.Errorf("%w: note kind %q: want 1 to %d bytes", ErrInvalid, r.Kind, MaxKindLen)
	}
	for _, c := range r.Kind {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Errorf("%w: note kind %q has %q; use lower-case letters, digits and . _ -", ErrInvalid, r.Kind, c)
		}
	}
	if slices.Contains(storeKinds, r.Kind) {
		return fmt.Errorf("%w: note kind %q is a transition the store records itself", ErrInvalid, r.Kind)
	}
	if err := validateText("actor", r.Actor); err != nil {
		return err
	}
	return validateText("reason", r.Reason)
}

// MaxPruneLimit bounds the runs one Prune call may remove, so that one
// call stays one bounded step.
const MaxPruneLimit = 10000

// Validate checks a prune.
func (r PruneRequest) Validate() error {
	if r.FinalBefore.IsZero() {
		return fmt.Errorf("%w: prune needs FinalBefore: the time before which runs became final", ErrInvalid)
	}
	if r.Limit < 1 || r.Limit > MaxPruneLimit {
		return fmt.Errorf("%w: prune limit %d: want 1 to %d", ErrInvalid, r.Limit, MaxPruneLimit)
	}
	return nil
}

// MaxPage bounds one page of ActiveRuns.
const MaxPage = 10000

// ValidatePage checks the arguments of ActiveRuns: after is "" or any
// string a run id could sort after, limit 1 to MaxPage.
func ValidatePage(after string, limit int) error {
	if len(after) > MaxRunIDLen {
		return fmt.Errorf("%w: page cursor is %d bytes, longer than a run id (%d)", ErrInvalid, len(after), MaxRunIDLen)
	}
	if limit < 1 || limit > MaxPage {
		return fmt.Errorf("%w: page size %d: want 1 to %d", ErrInvalid, limit, MaxPage)
	}
	return nil
}

// Validate checks a renewal.
func (r RenewRequest) Validate() error {
	if err := validateText("lease owner", r.Owner); err != nil {
		return err
	}
	if r.TTL <= 0 {
		return fmt.Errorf("%w: lease TTL %s: want more than zero", ErrInvalid, r.TTL)
	}
	for _, ref := range r.Refs {
		if err := ValidateRunID(ref.RunID); err != nil {
			return err
		}
		if err := ValidateKey(ref.Key); err != nil {
			return err
		}
	}
	return nil
}

// Validate checks a tick.
func (r TickRequest) Validate() error {
	if err := ValidateRunID(r.RunID); err != nil {
		return err
	}
	return validateText("actor", r.Actor)
}

// Clip shortens s to at most n bytes, for text that must fit a field's
// limit (a reason, a target) rather than be refused: what was cut off is
// detail, and the record must still be written.
func Clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	// Cut on a rune boundary, so the text stays valid UTF-8.
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}
