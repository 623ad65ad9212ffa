package redisstore

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/machine"
)

// Every per-run operation is a step: a rule of package machine decided in
// this process on what it knows of the run (a runView), and its mutation
// written by the apply program (lua/apply.lua) under what the rule read.
// Steps queued together share calls (batcher). A run this process saw
// ACTIVE at a version is decided on what it saw, for the two steps on
// every effect's path (a guard, an outcome): one round trip. Any other
// step, and one whose expectations do not hold any more, reads the run
// first (lua/read.lua) and is decided again: two.

// maxRounds bounds how often one step is read and decided again before
// its caller is told the store is too busy to take it (the call's
// deadline bounds it too).
const maxRounds = 32

// step is one rule on one run, and, once done, its answer.
type step struct {
	run string
	op  string
	// decide runs the rule; it sets the operation's answer.
	decide func(v machine.View, now time.Time) (*machine.Mutation, error)
	// settle completes the answer once the mutation is written: the row
	// after the step, and the records it wrote as they now stand (in the
	// order of its mutation's Intents).
	settle func(row state.Run, recs []*record) error
	// touch, instead of a rule: checks that write nothing but the run's
	// last step time (for a WAIT to count a write of its connection).
	touch []any
	// count, instead of a rule: counts a row not yet counted in the
	// totals (totals.go).
	count bool
	// rowless: the step's answer has no row in it (an outcome, a
	// reconciliation, a note), so a call of such steps alone is not
	// answered the run's row.
	rowless bool
	// assume, for a guard or an outcome, decides without reading a run
	// this process saw ACTIVE (see runView).
	assume assumption
	// key is the record the step's rule reads (an outcome's, a guard's
	// key or, with derived, the base of its derived key), needs what else
	// it reads, for a read of the run.
	key     string
	derived bool
	needs   needs

	ctx  context.Context
	done chan struct{}
	err  error
	// later is set on an outcome nobody waits for; answered is then
	// called with its error.
	later    bool
	answered func(error)

	// Of the round under way.
	mut     *machine.Mutation
	ops     []any
	returns int
}

// assumption is what a step on an effect's path assumes of a run this
// process saw ACTIVE.
type assumption struct {
	on bool
	// key: the record an outcome reports on, assumed IN_FLIGHT at
	// attempt with no refusals.
	key     string
	attempt int
}

// needs is what a read of a run takes for a step.
type needs struct {
	keys     []string
	bases    []string
	usage    []string
	leases   bool
	schedule bool
}

func (n *needs) add(o needs) {
	for _, k := range o.keys {
		if !slices.Contains(n.keys, k) {
			n.keys = append(n.keys, k)
		}
	}
	for _, b := range o.bases {
		if !slices.Contains(n.bases, b) {
			n.bases = append(n.bases, b)
		}
	}
	for _, u := range o.usage {
		if !slices.Contains(n.usage, u) {
			n.usage = append(n.usage, u)
		}
	}
	n.leases = n.leases || o.leases
	n.schedule = n.schedule || o.schedule
}

// record is an intent as a view holds it: decoded, and its two fields as
// stored (imm empty when not known), and its creation ordinal (0: not
// known).
type record struct {
	in       state.Intent
	imm, mut string
	ord      int64
	// partial: written in this round over a record assumed, not read, so
	// that only its moving part is known; a later step that reads it
	// waits for a read of the run.
	partial bool
}

// runView is what one round knows of a run: a read of it (read true), or
// what this process last saw of it; and the writes of the steps of the
// round decided before, so that each step reads the run as the steps
// before it leave it.
type runView struct {
	id   string
	read bool
	// row: as read, or (not read) its status and version as last seen.
	row   state.Run
	found bool
	// recs are the records known, by key; nil: known not to exist.
	recs map[string]*record
	// taken are keys known to name a record this view does not hold
	// (derived key bases this process saw taken).
	taken   map[string]bool
	derived map[string]int64
	// usage are the usage counters known: as read, with the round's
	// additions. Not read, a counter is taken as 0 (less than it may be;
	// the rules' expectations of it hold the write to what is stored).
	usage map[string]int64
	// leases and sched are the keys in the lease and scheduled sets, as
	// read (with leases and sched taken: asked for).
	leases, sched           []string
	leasesTaken, schedTaken bool
	// ord is the run's creation ordinal as read.
	ord int64
	// old: the run is of the old layout (no ordinal field), whose intents
	// legacy holds (key: JSON); a step moves them into this layout before
	// anything else.
	old    bool
	legacy map[string]string
	// assume is the step's assumption when the run was not read.
	assume assumption
	// missed is what a rule asked for that the view did not know.
	missed needs
	// t is the run's last step as known: no step may be dated earlier.
	t int64
	// counted: the row is counted in the totals (countedField).
	counted bool
	// names are the named usage counters known listed in namesField (see
	// seen.names); shared, copied before a change.
	names map[string]bool
}

func (v *runView) Row() (state.Run, bool, error) {
	if !v.read && !v.found {
		return state.Run{}, false, machine.ErrUnknown
	}
	return v.row, v.found, nil
}

func (v *runView) Intent(key string) (state.Intent, bool, error) {
	if r, ok := v.recs[key]; ok {
		switch {
		case r == nil:
			return state.Intent{}, false, nil
		case !r.partial:
			return r.in, true, nil
		}
	} else if !v.read {
		switch {
		case v.assume.key == key:
			return state.Intent{RunID: v.id, Key: key, State: state.IntentInFlight, Attempts: v.assume.attempt}, true, nil
		case v.assume.key == "":
			// A guard: its rule expects the key absent, which the write
			// checks.
			return state.Intent{}, false, nil
		}
	}
	v.missed.keys = append(v.missed.keys, key)
	return state.Intent{}, false, machine.ErrUnknown
}

func (v *runView) Taken(key string) (bool, error) {
	if r, ok := v.recs[key]; ok {
		return r != nil, nil
	}
	if v.taken[key] {
		return true, nil
	}
	if !v.read && v.assume.on && v.assume.key == "" {
		// A guard: its rule expects the key absent, which the write
		// checks.
		return false, nil
	}
	v.missed.keys = append(v.missed.keys, key)
	return false, machine.ErrUnknown
}

func (v *runView) Derived(base string) (int64, error) {
	if n, ok := v.derived[base]; ok {
		return n, nil
	}
	v.missed.bases = append(v.missed.bases, base)
	return 0, machine.ErrUnknown
}

func (v *runView) Usage(counter string) (int64, error) {
	if n, ok := v.usage[counter]; ok {
		return n, nil
	}
	if !v.read {
		// Decided on what was seen: 0 is never more than the counter.
		return 0, nil
	}
	v.missed.usage = append(v.missed.usage, counter)
	return 0, machine.ErrUnknown
}

func (v *runView) listed(keys []string, taken bool, want state.IntentState, miss *bool) ([]state.Intent, error) {
	if !taken {
		*miss = true
		return nil, machine.ErrUnknown
	}
	var out []*record
	for _, k := range keys {
		if r := v.recs[k]; r != nil && r.in.State == want && !slices.Contains(out, r) {
			out = append(out, r)
		}
	}
	slices.SortFunc(out, func(a, b *record) int {
		return cmp.Or(cmp.Compare(a.ord, b.ord), strings.Compare(a.in.Key, b.in.Key))
	})
	list := make([]state.Intent, len(out))
	for i, r := range out {
		list[i] = r.in
	}
	return list, nil
}

func (v *runView) InFlight() ([]state.Intent, error) {
	return v.listed(v.leases, v.leasesTaken, state.IntentInFlight, &v.missed.leases)
}

func (v *runView) Scheduled() ([]state.Intent, error) {
	return v.listed(v.sched, v.schedTaken, state.IntentScheduled, &v.missed.schedule)
}

// absorb makes the view read as the run will once m is written.
func (v *runView) absorb(m *machine.Mutation, rendered []*record) {
	if m.Create {
		v.found = true
		v.row = m.Row
		v.row.Intents = map[state.IntentState]int{}
	} else if m.RowChanged {
		counts, pruned, created := v.row.Intents, v.row.PrunedAt, v.row.CreatedAt
		v.row = m.Row
		v.row.Intents, v.row.PrunedAt, v.row.CreatedAt = counts, pruned, created
	}
	if v.row.Intents == nil {
		v.row.Intents = map[state.IntentState]int{}
	}
	m.Counts.Each(func(st state.IntentState, d int) {
		if v.row.Intents[st] += d; v.row.Intents[st] <= 0 {
			delete(v.row.Intents, st)
		}
	})
	if v.recs == nil {
		v.recs = map[string]*record{}
	}
	for i, w := range m.Intents {
		k := w.Rec.Key
		v.recs[k] = rendered[i]
		if w.Rec.State == state.IntentInFlight && !slices.Contains(v.leases, k) {
			v.leases = append(v.leases, k)
		}
		if w.Rec.State == state.IntentScheduled && !slices.Contains(v.sched, k) {
			v.sched = append(v.sched, k)
		}
	}
	if v.derived == nil {
		v.derived = map[string]int64{}
	}
	for _, d := range m.Derived {
		v.derived[d.Base] = d.N
	}
	for _, u := range m.Usage {
		if state.Named(u.Counter) && !v.names[u.Counter] && len(v.names) < maxSeenBases {
			names := make(map[string]bool, len(v.names)+1)
			maps.Copy(names, v.names)
			names[u.Counter] = true
			v.names = names
		}
	}
	for _, u := range m.Usage {
		// A counter read, or one taken as 0 unread, goes on from there; a
		// counter a read view did not read stays unknown.
		if n, ok := v.usage[u.Counter]; ok || !v.read {
			if v.usage == nil {
				v.usage = map[string]int64{}
			}
			v.usage[u.Counter] = n + u.N
		}
	}
	v.t = max(v.t, m.Now.UnixMilli())
}

// errNeedsRead is a step that cannot be written without knowing more of
// the run than its view holds (the creation ordinal of a record made
// earlier in the round): it waits for a read.
var errNeedsRead = errors.New("redis: the step needs a read of its run")

// render turns a step's mutation into the apply program's operations for
// it, appended to buf (the group's, so that a group's steps share its
// room; on an error buf is given back as it was): its checks, then its writes, then what it answers. answer: the
// caller wants the records written whole, so that the first half of one
// assumed, not read, is read back. It also gives the records as they will
// stand (in the order of m.Intents), for the view to absorb.
func render(v *runView, m *machine.Mutation, buf []any, answer bool) ([]any, int, []*record, error) {
	ops := buf
	op := func(args ...any) { ops = append(ops, args...) }
	// field names the record's field once for its check and its write.
	var lastKey, lastField string
	field := func(key string) string {
		if key != lastKey || lastField == "" {
			lastKey, lastField = key, "s:"+key
		}
		return lastField
	}
	for _, e := range m.Expect {
		switch e.Kind {
		case machine.ExpectRowAbsent:
			op("=", "status", "")
		case machine.ExpectStatus:
			op("=", "status", string(e.Status))
		case machine.ExpectVersion:
			op("=", "v", strconv.FormatInt(e.N, 10))
		case machine.ExpectCount:
			op("#", countField(e.State), e.N)
		case machine.ExpectCountAtLeast:
			op(">", countField(e.State), e.N)
		case machine.ExpectIntentAbsent:
			op("=", field(e.Key), "")
		case machine.ExpectIntentPresent:
			op("^", field(e.Key), "")
		case machine.ExpectIntentAt:
			op("^", field(e.Key), mutHead(e.State, int(e.N), e.Refusals))
		case machine.ExpectIntent:
			r := v.recs[e.Key]
			if r == nil || r.mut == "" {
				return buf, 0, nil, errNeedsRead
			}
			op("=", field(e.Key), r.mut)
		case machine.ExpectDerived:
			op("Q", e.Key, e.N)
		case machine.ExpectNotAfter:
			op("T", e.Time.UnixMilli())
		case machine.ExpectUsageAtMost:
			op("<", usageField(e.Key), e.N)
		case machine.ExpectUsageAtLeast:
			op(">", usageField(e.Key), e.N)
		}
	}
	// A row not yet counted in the totals is counted as it stands before
	// the step changes them: checked here, with the checks, counted with
	// the writes.
	counting := len(m.Tally) > 0 && !m.Create && !v.counted && v.found
	if counting {
		if !v.read {
			return buf, 0, nil, errNeedsRead
		}
		op("=", countedField, "")
	}
	// Every check is above, every write below.
	if m.Create {
		op("h", "o", "0", "H", countedField, "1")
		if text := m.Row.Budget.Text(); text != "" {
			op("h", budgetField, text)
		}
	}
	if counting {
		ops = countWrites(ops, v)
	}
	for _, d := range m.Tally {
		op("c", d.Name, d.N)
	}
	for _, u := range m.Usage {
		op("+", usageField(u.Counter), u.N)
		if state.Named(u.Counter) && !v.names[u.Counter] {
			op("a", namesField, u.Counter)
		}
	}
	if m.Create || m.RowChanged {
		h := m.Row
		op("h", "status", string(h.Status), "h", "v", strconv.FormatInt(h.CancelVersion, 10))
		for _, f := range [...]struct {
			name string
			at   time.Time
		}{{"created", h.CreatedAt}, {"updated", h.UpdatedAt}, {"cancelled", h.CancelledAt}, {"drain", h.DrainDeadline}} {
			if !f.at.IsZero() && (m.Create || f.name != "created") {
				op("h", f.name, strconv.FormatInt(f.at.UnixMilli(), 10))
			}
		}
		if h.Reason != "" {
			op("h", "reason", h.Reason)
		}
		if h.StatusReason != "" {
			op("h", "status_reason", h.StatusReason)
		}
	}
	m.Counts.Each(func(st state.IntentState, d int) { op("+", countField(st), d) })
	rendered := make([]*record, len(m.Intents))
	returns := 0
	for i, w := range m.Intents {
		in := w.Rec
		k := in.Key
		old := v.recs[k]
		r := &record{in: in, mut: mutText(in)}
		switch {
		case w.New():
			op("o", "i:"+k, immHead(in), immTail(in))
		case w.Mutable:
			if old != nil {
				r.imm, r.ord = old.imm, old.ord
			}
		default:
			if old == nil || old.ord == 0 {
				return buf, 0, nil, errNeedsRead
			}
			r.ord = old.ord
			r.imm = immText(in, old.ord)
			op("h", "i:"+k, r.imm)
		}
		if w.Mutable && (old == nil || old.imm == "") {
			// The record's first half was assumed, not read: the answer
			// takes it from the store, if one is wanted.
			if answer {
				op("R", "i:"+k)
				returns++
			}
			r.partial = true
		}
		op("h", field(k), r.mut)
		from, to := w.From, in.State
		switch {
		case to == state.IntentInFlight && from != to:
			op("N", -in.LeaseExpires.UnixMilli(), k)
		case to == state.IntentInFlight && (old == nil || !in.LeaseExpires.Equal(old.in.LeaseExpires)):
			op("L", -in.LeaseExpires.UnixMilli(), k)
		case from == state.IntentInFlight && to != from:
			op("l", k)
		}
		switch {
		case to == state.IntentScheduled && from != to:
			op("S", k)
		case from == state.IntentScheduled && to != from:
			op("s", k)
		}
		rendered[i] = r
	}
	for _, d := range m.Derived {
		op("q", d.Base, d.N)
	}
	if len(m.Events) > 0 {
		// The step's events in one field of the audit entry (eventsOf
		// reads them one by one).
		lines := make([]string, len(m.Events))
		for i, e := range m.Events {
			lines[i] = eventLine(e)
		}
		op("x", strings.Join(lines, "\n"))
	}
	if m.Publish {
		op("p", cancelChannel, m.RunID)
	}
	return ops, returns, rendered, nil
}

// countOps counts a row the view read, not counted in the totals, as it
// stands, checking that it is still not counted.
func countOps(ops []any, v *runView) []any {
	if !v.found {
		return ops
	}
	return countWrites(append(ops, "=", countedField, ""), v)
}

// countWrites are the writes of countOps.
func countWrites(ops []any, v *runView) []any {
	for _, d := range machine.TallyOf(v.row) {
		ops = append(ops, "c", d.Name, d.N)
	}
	return append(ops, "H", countedField, "1")
}

// upgradeOps moves a run of the old layout (its intents JSON in a hash of
// their own) into this one: each record into the run's hash, the leases
// scored as this layout scores them, the run's creation ordinal, and the
// old keys deleted. It checks that the run is still of the old layout,
// and leaves the view reading the run as moved.
func upgradeOps(v *runView) ([]any, error) {
	ops := []any{"=", "o", ""}
	var ord int64
	for key, raw := range v.legacy {
		in, o, err := decodeLegacy(v.id, key, raw)
		if err != nil {
			return nil, fmt.Errorf("redis: moving run %s of the old layout: %w", v.id, err)
		}
		r := &record{in: in, imm: immText(in, o), mut: mutText(in), ord: o}
		ops = append(ops, "h", "i:"+key, r.imm, "h", "s:"+key, r.mut)
		if in.State == state.IntentInFlight {
			ops = append(ops, "L", -in.LeaseExpires.UnixMilli(), key)
			if !slices.Contains(v.leases, key) {
				v.leases = append(v.leases, key)
			}
		}
		if in.State == state.IntentScheduled && !slices.Contains(v.sched, key) {
			v.sched = append(v.sched, key)
		}
		v.recs[key] = r
		ord = max(ord, o)
	}
	ops = append(ops, "h", "o", strconv.FormatInt(ord, 10), "D")
	v.ord, v.old, v.legacy = ord, false, nil
	return ops, nil
}
