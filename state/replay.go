package state

// ReplayRefusal is why a guard under an explicit key that already names a
// record may not dispatch, even though the run would take it ("" when it
// may): an intent's record is written once per dispatch and never
// rewritten.
//
//   - An effect under way (IN_FLIGHT, UNKNOWN until it is reconciled, or a
//     SCHEDULED retry scheduled again) is not sent twice:
//     RefusalInProgress.
//   - A key names one effect: another boundary, method, target or body
//     under it is RefusalKeyReused, whatever the record's state.
//   - An effect that happened or was settled (RESPONDED, APPLIED,
//     NOT_APPLIED) or revoked is over: its key answers with the record as it
//     stands, RefusalKeyReused, and is never dispatched over it.
//   - What provably never left (NOT_SENT, CANCELLED_BEFORE_DISPATCH) may be
//     tried again under its key, and a SCHEDULED retry guarded without a
//     time is its own dispatch.
func ReplayRefusal(rec Intent, req GuardRequest) string {
	switch {
	case rec.State == IntentInFlight || rec.State == IntentUnknown,
		rec.State == IntentScheduled && !req.NotBefore.IsZero():
		return RefusalInProgress
	case rec.Boundary != req.Boundary || rec.Method != req.Method || rec.Target != req.Target,
		rec.BodyDigest != "" && req.BodyDigest != "" && rec.BodyDigest != req.BodyDigest:
		return RefusalKeyReused
	case rec.State == IntentScheduled, rec.State == IntentNotSent, rec.State == IntentCancelledBeforeDispatch:
		return ""
	}
	return RefusalKeyReused
}
