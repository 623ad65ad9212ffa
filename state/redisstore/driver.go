package redisstore

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"time"

	lru "github.com/hashicorp/golang-lru/v2"
	"github.com/redis/go-redis/v9"

	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/machine"
)

// seen is what this process last saw of a run: enough to decide a guard or
// an outcome on an ACTIVE run without reading it (the write checks it).
type seen struct {
	status  state.Status
	version int64
	// t is the run's last step as seen.
	t int64
	// derived are derived key bases seen taken, with their counters.
	derived map[string]int64
	// created and budget never change once the row exists: a rule
	// checks a run's budget on them without reading the run.
	created time.Time
	budget  state.Budget
	// counted: the row is counted in the totals.
	counted bool
	// names are the named usage counters seen listed in the run's list of
	// them (namesField), which only grows: one known there is not added
	// again. Never written in place (views share it).
	names map[string]bool
}

// maxSeenRuns and maxSeenBases bound the memory of what is remembered:
// a run forgotten is read again at its next step.
const (
	maxSeenRuns  = 16384
	maxSeenBases = 64
)

type seenRuns struct {
	c *lru.Cache[string, seen]
	// off makes every step read its run (a test compares the paths).
	off bool
}

func newSeenRuns() seenRuns {
	c, err := lru.New[string, seen](maxSeenRuns)
	if err != nil {
		panic(err) // only for a size below 1
	}
	return seenRuns{c: c}
}

func (s seenRuns) has(id string) bool { return s.c.Contains(id) }

// learn remembers the row of a run as the view holds it after a round.
func (s seenRuns) learn(v *runView) {
	if !v.found {
		return
	}
	old, _ := s.c.Peek(v.id)
	n := seen{status: v.row.Status, version: v.row.CancelVersion, t: max(v.t, old.t), counted: v.counted, created: v.row.CreatedAt, budget: v.row.Budget}
	if n.created.IsZero() {
		// A view that did not read the row (decided on what was seen).
		n.created, n.budget = old.created, old.budget
	}
	if v.row.Status == state.StatusActive {
		n.derived = old.derived
		for b, c := range v.derived {
			if n.derived == nil || len(n.derived) >= maxSeenBases {
				n.derived = map[string]int64{}
			}
			n.derived[b] = c
		}
		n.names = old.names
		if len(v.names) > len(n.names) {
			n.names = v.names
		}
	}
	s.c.Add(v.id, n)
}

// forget drops a run: the next step reads it.
func (s seenRuns) forget(id string) { s.c.Remove(id) }

// viewOf is the view a round decides a run's steps on without reading it,
// or nil when it must read: a run seen ACTIVE, for steps that all assume.
func (s seenRuns) viewOf(id string, steps []*step) *runView {
	if s.off {
		return nil
	}
	for _, st := range steps {
		if !st.assume.on {
			return nil
		}
	}
	sn, ok := s.c.Get(id)
	if !ok || sn.status != state.StatusActive {
		return nil
	}
	v := &runView{id: id, found: true, t: sn.t, counted: sn.counted, names: sn.names, row: state.Run{ID: id, Status: sn.status, CancelVersion: sn.version,
		CreatedAt: sn.created, Budget: sn.budget}}
	if len(sn.derived) > 0 {
		v.derived, v.taken = make(map[string]int64, len(sn.derived)), make(map[string]bool, len(sn.derived))
		for b, n := range sn.derived {
			// Taken: a guard of the same request again names base.n.
			v.derived[b], v.taken[b] = n, true
		}
	}
	return v
}

// group is one run's steps in a round.
type group struct {
	run   string
	steps []*step
	view  *runView
	now   int64
	// sent are the steps sent in this round, the rest wait for the next.
	sent []*step
	// moves: the first step sent moves a run of the old layout.
	moves    bool
	rendered [][]*record
	fields   []string
	bases    []string
	// ops is the room the operations of the group's steps share.
	ops []any
	// wantsRow: a step sent answers the row, which the call then reads
	// whole and answers as read.
	wantsRow bool
}

// needsRow reports whether a step sent answers the run's row.
func (g *group) needsRow() bool {
	for _, st := range g.sent {
		if st.settle != nil && !st.rowless {
			return true
		}
	}
	return false
}

// opsPerStep is the room a step's operations usually take.
const opsPerStep = 32

// runSteps decides and writes steps, grouped by run in the order each
// run's came, until every one is answered: in rounds, each a read of the
// runs that need one, the rules, and one call of the apply program.
func (s *Store) runSteps(ctx context.Context, steps []*step) {
	s.runStepsVia(ctx, steps, nil)
}

// execer runs one program on keys with the arguments that follow the
// command's head in cmd (headRoom(keys) slots, left for it to fill); nil
// is Store.execBuilt.
type execer func(ctx context.Context, p *program, keys []string, cmd []any) *redis.Cmd

// headRoom is the room a command's arguments leave at their front for its
// head: the command, the program, the number of keys and the keys.
func headRoom(keys []string) int { return 3 + len(keys) }

// runStepsVia is runSteps with its programs run by via.
func (s *Store) runStepsVia(ctx context.Context, steps []*step, via execer) {
	if via == nil {
		via = s.execBuilt
	}
	pending := steps
	reread := map[string]*needs{}
	contended := false
	for round := 0; len(pending) > 0; round++ {
		if round == maxRounds || ctx.Err() != nil {
			for _, st := range pending {
				st.err = fmt.Errorf("redis %s run %s on %s: %w: its run changed under it %d times in a row (other instances' steps of the same run); try again", st.op, st.run, s.addr, state.ErrUnavailable, round)
			}
			return
		}
		if contended {
			// Steps of the same run from other instances keep landing
			// between this one's read and its write: step aside a little,
			// a random while that grows with the rounds, so that the
			// instances stop meeting.
			backoff(ctx, round)
		}
		contended = false
		groups := byRunGroups(pending)
		pending = nil
		var toRead []*group
		for _, g := range groups {
			if n, again := reread[g.run]; !again {
				if g.view = s.seen.viewOf(g.run, g.steps); g.view != nil {
					continue
				}
			} else {
				for _, st := range g.steps {
					st.needs.add(*n)
				}
			}
			toRead = append(toRead, g)
		}
		clear(reread)
		for _, part := range s.calls(toRead) {
			err := s.readRuns(ctx, via, part)
			var failed failedGroups
			switch {
			case errors.As(err, &failed):
				groups = without(groups, failed)
			case err != nil:
				for _, g := range part {
					for _, st := range g.steps {
						st.err = err
					}
				}
				groups = without(groups, part)
			}
		}
		var calls []*group
		for _, g := range groups {
			deferred := s.decideGroup(g)
			if len(deferred) > 0 {
				pending = append(pending, deferred...)
				n := g.view.missed
				reread[g.run] = &n
			}
			if len(g.sent) > 0 {
				calls = append(calls, g)
			}
		}
		for _, part := range s.calls(calls) {
			results, err := s.applyGroups(ctx, via, part)
			if err != nil {
				for _, g := range part {
					s.seen.forget(g.run)
					for _, st := range g.sent {
						st.err = s.fail(st.op, st.run, err)
					}
				}
				continue
			}
			for i, g := range part {
				stale := s.settleGroup(g, results[i])
				if len(stale) > 0 {
					contended = true
					pending = append(stale, pending...)
					if reread[g.run] == nil {
						reread[g.run] = &needs{}
					}
				}
			}
		}
		pending = byRunOrder(pending, steps)
	}
}

// clockSlack is how far a run's last step (written by another instance)
// may be ahead of a step's time and the step still be dated by its own
// clock: instances' clocks differ by that much. Further behind, the step
// is decided again from a read, at the run's last step.
const clockSlack = time.Second

// backoff waits a random while, up to a millisecond doubled each round
// (capped at 32), or until ctx ends.
func backoff(ctx context.Context, round int) {
	limit := time.Millisecond << min(round, 5)
	t := time.NewTimer(rand.N(limit) + time.Millisecond/10)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

// calls splits groups into the calls that may carry them: all in one on
// one Redis; on Redis Cluster a run a call, a program touching one slot.
func (s *Store) calls(groups []*group) [][]*group {
	if len(groups) == 0 {
		return nil
	}
	if !s.batches.perRun {
		return [][]*group{groups}
	}
	out := make([][]*group, len(groups))
	for i, g := range groups {
		out[i] = []*group{g}
	}
	return out
}

// decideGroup runs the rules of a run's steps on its view, in order, and
// renders what they write. It returns the steps that wait for a read of
// the run: the first whose rule asked for what the view did not know, and
// every step after it.
func (s *Store) decideGroup(g *group) []*step {
	v := g.view
	g.now = max(s.clock().UnixMilli(), v.t)
	now := time.UnixMilli(g.now).UTC()
	if v.old {
		// A run of the old layout is moved into this one first, by a
		// step of its own.
		ops, err := upgradeOps(v)
		if err != nil {
			for _, st := range g.steps {
				st.err = err
			}
			return nil
		}
		g.sent = append(g.sent, &step{run: g.run, op: "upgrade", ops: ops})
		g.rendered = append(g.rendered, nil)
		g.moves = true
	}
	if g.ops == nil {
		g.ops = make([]any, 0, opsPerStep*len(g.steps))
	}
	for i, st := range g.steps {
		if st.count {
			if !v.read {
				return g.steps[i:]
			}
			st.ops = nil
			if v.found && !v.counted {
				st.ops = countOps(nil, v)
				v.counted = true
			}
			g.sent = append(g.sent, st)
			g.rendered = append(g.rendered, nil)
			continue
		}
		if st.touch != nil {
			st.ops = append(append([]any(nil), st.touch...), "h", "t", strconv.FormatInt(g.now, 10))
			g.sent = append(g.sent, st)
			g.rendered = append(g.rendered, nil)
			continue
		}
		v.assume = st.assume
		// Decided again: what the last decision wrote is not needed.
		machine.Release(st.mut)
		st.mut = nil
		m, err := st.decide(v, now)
		var ops []any
		var rendered []*record
		if err == nil && m != nil {
			start := len(g.ops)
			g.ops, st.returns, rendered, err = render(v, m, g.ops, !st.later)
			ops = g.ops[start:len(g.ops):len(g.ops)]
		}
		if err == machine.ErrUnknown || err == errNeedsRead {
			machine.Release(m)
			g.ask(v, i+1, now)
			return g.steps[i:]
		}
		st.mut, st.ops, st.err = m, ops, err
		if m != nil && err == nil {
			v.absorb(m, rendered)
			if m.Create || len(m.Tally) > 0 {
				v.counted = true
			}
		}
		g.sent = append(g.sent, st)
		g.rendered = append(g.rendered, rendered)
	}
	return nil
}

// ask runs the rules of the group's steps from the i-th on, after one
// that must wait for a read, only for what they ask of the run that the
// view does not know: one read then takes what all of them ask, where a
// run's steps that each name a record of their own (repeated requests,
// each under a derived key) would otherwise be read again one by one.
// What they decide is thrown away; they are decided again on the read.
func (g *group) ask(v *runView, i int, now time.Time) {
	for _, st := range g.steps[i:] {
		if st.decide == nil {
			continue
		}
		v.assume = st.assume
		m, _ := st.decide(v, now)
		machine.Release(m)
	}
}

// settleGroup answers the steps of a group the program wrote, and returns
// those it did not (stale), to be read and decided again.
func (s *Store) settleGroup(g *group, res groupResult) []*step {
	if res.failed != nil {
		s.seen.forget(g.run)
		for _, st := range g.sent {
			st.err = s.fail(st.op, st.run, res.failed)
		}
		return nil
	}
	row, found := res.row, res.found
	wasCounted := res.counted
	if !g.wantsRow {
		// Not answered: no step needs it, and the view holds the row as
		// the steps leave it (the status, the version, the counted mark
		// it was decided on, which the checks held to).
		row, found, wasCounted = g.view.row, g.view.found, g.view.counted
	}
	answers := res.answers
	for i, st := range g.sent {
		switch res.results[i] {
		case 'o':
		case 'l':
			st.err = fmt.Errorf("redis guard run %s on %s: %w: Redis ran the guard after its deadline (by the server's clock); nothing was recorded",
				st.run, s.addr, state.ErrUnavailable)
			s.seen.forget(g.run)
			return decided(g.sent[i+1:])
		default:
			s.seen.forget(g.run)
			return decided(g.sent[i:])
		}
		if st.mut == nil || st.err != nil {
			continue
		}
		if g.wantsRow {
			row, found = advance(row, found, st.mut)
		}
		recs := g.rendered[i]
		for j, w := range st.mut.Intents {
			r := recs[j]
			if w.Mutable && r.imm == "" && len(answers) > 0 {
				r.imm, answers = answers[0], answers[1:]
				in, ord, err := decodeIntent(g.run, w.Rec.Key, r.imm, r.mut)
				if err != nil {
					st.err = fmt.Errorf("redis %s run %s: %w", st.op, st.run, err)
					continue
				}
				r.in, r.ord, r.partial = in, ord, false
			}
		}
		if st.settle != nil {
			if err := st.settle(row, recs); err != nil {
				st.err = err
			}
		}
		if st.mut.Publish && st.op != "cancel" {
			// A run cancelled by one of its own steps.
			s.indexCancelled(st.run)
		}
		machine.Release(st.mut)
		st.mut = nil
	}
	v := g.view
	v.row, v.found = row, found
	v.counted = v.counted || wasCounted
	v.t = max(v.t, g.now)
	s.seen.learn(v)
	return nil
}

// decided leaves out the steps no rule decided (an upgrade), which a
// later round makes again if it must.
func decided(steps []*step) []*step {
	var out []*step
	for _, st := range steps {
		if st.decide != nil || st.touch != nil || st.count {
			out = append(out, st)
		}
	}
	return out
}

// advance is the row after m, from the row before it.
func advance(row state.Run, found bool, m *machine.Mutation) (state.Run, bool) {
	if m.Create {
		row = m.Row
		row.Intents = map[state.IntentState]int{}
		found = true
	} else if m.RowChanged {
		counts, pruned, created := row.Intents, row.PrunedAt, row.CreatedAt
		row = m.Row
		row.Intents, row.PrunedAt, row.CreatedAt = counts, pruned, created
	}
	if row.Intents == nil {
		row.Intents = map[state.IntentState]int{}
	} else {
		counts := make(map[state.IntentState]int, len(row.Intents)+1)
		for k, n := range row.Intents {
			counts[k] = n
		}
		row.Intents = counts
	}
	m.Counts.Each(func(st state.IntentState, d int) {
		if row.Intents[st] += d; row.Intents[st] <= 0 {
			delete(row.Intents, st)
		}
	})
	return row, found
}

// byRunGroups groups steps by run, the runs in the order of their first
// step, each run's steps in their order.
func byRunGroups(steps []*step) []*group {
	var out []*group
	at := map[string]*group{}
	for _, st := range steps {
		g := at[st.run]
		if g == nil {
			g = &group{run: st.run}
			at[st.run] = g
			out = append(out, g)
		}
		g.steps = append(g.steps, st)
	}
	return out
}

func without(groups, drop []*group) []*group {
	var out []*group
	for _, g := range groups {
		keep := true
		for _, d := range drop {
			if d == g {
				keep = false
			}
		}
		if keep {
			out = append(out, g)
		}
	}
	return out
}

// byRunOrder puts steps back in the order they were given.
func byRunOrder(pending, order []*step) []*step {
	if len(pending) < 2 {
		return pending
	}
	in := make(map[*step]bool, len(pending))
	for _, st := range pending {
		in[st] = true
	}
	out := pending[:0:0]
	for _, st := range order {
		if in[st] {
			out = append(out, st)
		}
	}
	return out
}

// applyGroups makes one call of the apply program for the groups' steps.
func (s *Store) applyGroups(ctx context.Context, via execer, groups []*group) ([]groupResult, error) {
	keys := make([]string, 0, 7*len(groups))
	size := 1
	for _, g := range groups {
		g.wantsRow = g.needsRow()
		fields, bases := g.reads()
		size += 9 + len(fields) + len(bases) + len(g.sent)
		for _, st := range g.sent {
			size += len(st.ops)
		}
	}
	for _, g := range groups {
		keys = append(keys, keysOf(g.run).list()...)
	}
	// The totals' hash, last: a call's runs share one (totals.go).
	keys = append(keys, s.totalsKeyOf(groups[0].run))
	head := headRoom(keys)
	args := make([]any, head+1, head+size)
	args[head] = len(groups)
	for _, g := range groups {
		fields, bases := g.fields, g.bases
		at := len(args)
		args = append(args, 0, g.now, clockSlack.Milliseconds(), len(g.sent), flag(g.moves), flag(g.wantsRow), len(fields))
		for _, f := range fields {
			args = append(args, f)
		}
		args = append(args, len(bases))
		for _, b := range bases {
			args = append(args, b)
		}
		for _, st := range g.sent {
			args = append(args, len(st.ops))
			args = append(args, st.ops...)
		}
		args[at] = len(args) - at - 1
	}
	v, err := via(ctx, applyProgram, keys, args).Result()
	if err != nil {
		return nil, err
	}
	list, ok := v.([]any)
	if !ok || len(list) != len(groups) {
		return nil, fmt.Errorf("the apply program answered %T of %d groups for %d", v, len(list), len(groups))
	}
	out := make([]groupResult, len(groups))
	for i, x := range list {
		r, err := parseGroup(x, groups[i])
		if err != nil {
			return nil, err
		}
		out[i] = r
	}
	return out, nil
}

// opArity is the number of arguments of an operation (lua/apply.lua's
// ARITY: '<' and 'a' take two, as most do).
func opArity(op string) int {
	switch op {
	case "o":
		return 3
	case "T", "l", "S", "s", "x", "R":
		return 1
	case "D":
		return 0
	}
	return 2
}

// reads lists the fields of the run's hash the group's steps touch besides
// the row's own (which the program always reads first), and the
// derived-key counters. A field named twice is read twice, which changes
// nothing.
func (g *group) reads() ([]string, []string) {
	fields := make([]string, 0, 4*len(g.sent)+3)
	if !g.wantsRow {
		// What the program reads of every run it writes.
		fields = append(fields, "status", "t", "o")
	}
	var bases []string
	for _, st := range g.sent {
		for i := 0; i < len(st.ops); i += 1 + opArity(st.ops[i].(string)) {
			switch st.ops[i].(string) {
			case "=", "#", ">", "<", "^", "h", "H", "+", "a", "o", "R":
				if f := st.ops[i+1].(string); !g.wantsRow || !isRowField[f] {
					fields = append(fields, f)
				}
			case "Q", "q":
				bases = append(bases, st.ops[i+1].(string))
			case "N":
				// Where the lease goes: the lone one, when it is the
				// run's only effect in flight (lua/apply.lua).
				fields = append(fields, loneLease, countField(state.IntentInFlight))
			case "L", "l":
				fields = append(fields, loneLease)
			}
		}
	}
	g.fields, g.bases = fields, bases
	return fields, bases
}

// isRowField is rowFields as a set.
var isRowField = func() map[string]bool {
	m := make(map[string]bool, len(rowFields))
	for _, f := range rowFields {
		m[f] = true
	}
	return m
}()

// groupResult is the apply program's answer for one group.
type groupResult struct {
	results string
	// failed is the error the group's steps met, none written.
	failed error
	// row is the row as read before the steps (found false: no row).
	row     state.Run
	found   bool
	counted bool
	answers []string
}

func parseGroup(x any, g *group) (groupResult, error) {
	a, ok := x.([]any)
	if ok && len(a) == 2 && a[0] == "failed" {
		msg, _ := a[1].(string)
		return groupResult{failed: groupError(msg)}, nil
	}
	if !ok || len(a) != 3 {
		return groupResult{}, fmt.Errorf("the apply program answered %T for a group, not its three parts", x)
	}
	res, _ := a[0].(string)
	if len(res) != len(g.sent) {
		return groupResult{}, fmt.Errorf("the apply program answered %d results for %d steps", len(res), len(g.sent))
	}
	out := groupResult{results: res}
	if g.wantsRow {
		read, _ := a[1].([]any)
		if len(read) != len(rowFields) {
			return groupResult{}, fmt.Errorf("the apply program answered %d of the row's %d fields", len(read), len(rowFields))
		}
		out.row, out.found = rowOfValues(g.run, read)
		out.counted = counted(read)
	}
	answers, _ := a[2].([]any)
	for _, v := range answers {
		s, _ := v.(string)
		out.answers = append(out.answers, s)
	}
	return out, nil
}

// readRuns reads what the groups' steps ask of their runs, each run in one
// atomic step, and makes each group's view of it.
func (s *Store) readRuns(ctx context.Context, via execer, groups []*group) error {
	keys := make([]string, 0, 7*len(groups))
	for _, g := range groups {
		keys = append(keys, keysOf(g.run).list()...)
	}
	args := make([]any, headRoom(keys)+1, headRoom(keys)+1+32*len(groups))
	args[headRoom(keys)] = len(groups)
	starts := make([]int, len(groups))
	type asked struct {
		fields []string
		bases  []string
		n      needs
	}
	var all []asked
	for _, g := range groups {
		var n needs
		for _, st := range g.steps {
			n.add(st.needs)
			if st.key != "" {
				n.add(needs{keys: []string{st.key}})
				if st.derived {
					n.add(needs{bases: []string{st.key}})
				}
			}
		}
		starts[len(all)] = len(args)
		args = append(args, 0)
		fields := make([]string, 0, 1+2*len(n.keys))
		fields = append(fields, "l")
		for _, k := range n.keys {
			fields = append(fields, "i:"+k, "s:"+k)
		}
		for _, u := range n.usage {
			fields = append(fields, usageField(u))
		}
		args = append(args, len(fields))
		for _, f := range fields {
			args = append(args, f)
		}
		args = append(args, len(n.bases))
		for _, b := range n.bases {
			args = append(args, b)
		}
		args = append(args, flag(n.leases), flag(n.schedule))
		args[starts[len(all)]] = len(args) - starts[len(all)] - 1
		all = append(all, asked{fields, n.bases, n})
	}
	v, err := via(ctx, readProgram, keys, args).Result()
	if err != nil {
		return s.fail("read", groups[0].run, err)
	}
	list, ok := v.([]any)
	if !ok || len(list) != len(groups) {
		return fmt.Errorf("redis read: the read program answered %T for %d runs", v, len(groups))
	}
	var failed []*group
	for i, g := range groups {
		if a, ok := list[i].([]any); ok && len(a) == 2 && a[0] == "failed" {
			msg, _ := a[1].(string)
			for _, st := range g.steps {
				st.err = s.fail("read", g.run, groupError(msg))
			}
			failed = append(failed, g)
			continue
		}
		view, err := viewOfRead(g.run, all[i].fields, all[i].bases, all[i].n, list[i])
		if err != nil {
			return err
		}
		g.view = view
	}
	if len(failed) > 0 {
		return failedGroups(failed)
	}
	return nil
}

// failedGroups is the error of a read whose runs in groups failed alone,
// their steps answered already: the caller leaves them out.
type failedGroups []*group

func (f failedGroups) Error() string { return fmt.Sprintf("%d runs could not be read", len(f)) }

// viewOfRead makes a view of what the read program answered for a run.
func viewOfRead(id string, fields, bases []string, n needs, x any) (*runView, error) {
	a, ok := x.([]any)
	if !ok || len(a) != 7 {
		return nil, fmt.Errorf("redis read run %s: the read program answered %T, not its seven parts", id, x)
	}
	str := func(x any) (string, bool) { s, ok := x.(string); return s, ok }
	vals, _ := a[0].([]any)
	if len(vals) != len(rowFields)+len(fields) {
		return nil, fmt.Errorf("redis read run %s: %d values for %d fields", id, len(vals), len(rowFields)+len(fields))
	}
	v := &runView{id: id, read: true, recs: map[string]*record{}, derived: map[string]int64{}}
	rowVals := vals[:len(rowFields)]
	if m := rowOf(rowVals); m != nil {
		v.found = true
		v.counted = m[countedField] == "1"
		v.row = runOf(id, m)
		v.t, _ = strconv.ParseInt(m["t"], 10, 64)
		v.ord, _ = strconv.ParseInt(m["o"], 10, 64)
		_, hasOrd := m["o"]
		v.old = !hasOrd
	}
	rec := func(key string, imm, mut any) error {
		i, ok1 := str(imm)
		m, ok2 := str(mut)
		if !ok1 || !ok2 {
			v.recs[key] = nil
			return nil
		}
		in, ord, err := decodeIntent(id, key, i, m)
		if err != nil {
			return fmt.Errorf("redis read: %w", err)
		}
		v.recs[key] = &record{in: in, imm: i, mut: m, ord: ord}
		return nil
	}
	for j, k := range n.keys {
		at := len(rowFields) + 1 + 2*j
		if err := rec(k, vals[at], vals[at+1]); err != nil {
			return nil, err
		}
	}
	v.usage = make(map[string]int64, len(n.usage))
	for j, u := range n.usage {
		c, _ := str(vals[len(rowFields)+1+2*len(n.keys)+j])
		v.usage[u], _ = strconv.ParseInt(c, 10, 64)
	}
	seq, _ := a[1].([]any)
	for j, b := range bases {
		var c int64
		if j < len(seq) {
			if s, ok := str(seq[j]); ok {
				c, _ = strconv.ParseInt(s, 10, 64)
			}
		}
		v.derived[b] = c
	}
	members := func(list []any, step int) []string {
		var out []string
		for j := 0; j < len(list); j += step {
			if m, ok := str(list[j]); ok && !isLeaseMark(m) {
				out = append(out, m)
			}
		}
		return out
	}
	if n.leases {
		// The set's members, each with its score, and their records in
		// the same order.
		leases, _ := a[2].([]any)
		recs, _ := a[3].([]any)
		v.leasesTaken = true
		v.leases = members(leases, 2)
		for j := 0; j+1 < len(leases); j += 2 {
			m, _ := str(leases[j])
			if _, known := v.recs[m]; !known && !isLeaseMark(m) && j+1 < len(recs) {
				if err := rec(m, recs[j], recs[j+1]); err != nil {
					return nil, err
				}
			}
		}
	}
	if n.schedule {
		sched, _ := a[4].([]any)
		recs, _ := a[5].([]any)
		v.schedTaken = true
		v.sched = members(sched, 1)
		for j, x := range sched {
			m, _ := str(x)
			if _, known := v.recs[m]; !known && 2*j+1 < len(recs) {
				if err := rec(m, recs[2*j], recs[2*j+1]); err != nil {
					return nil, err
				}
			}
		}
	}
	if legacy, _ := a[6].([]any); len(legacy) > 0 {
		v.legacy = map[string]string{}
		for j := 0; j+1 < len(legacy); j += 2 {
			k, _ := str(legacy[j])
			raw, _ := str(legacy[j+1])
			v.legacy[k] = raw
		}
	}
	return v, nil
}

// isLeaseMark tells the member an older layout kept in a large lease set
// (it has spaces, which no key has).
func isLeaseMark(m string) bool {
	for i := 0; i < len(m); i++ {
		if m[i] == ' ' {
			return true
		}
	}
	return false
}

// groupError is the error the apply program met on the steps of one run of
// a call, and only on those: it reads as the same error from the server
// would have for a call of that run alone.
type groupError string

func (e groupError) Error() string { return string(e) }

// RedisError marks it a reply of the server, as go-redis's own errors are.
func (groupError) RedisError() {}
