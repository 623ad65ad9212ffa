package redisstore

import (
	"context"
	"errors"
	"sync"
	"time"
)

// maxBatch bounds the steps of one batch call, so that one call stays a
// short step of the server.
const maxBatch = 64

// batcher joins the guards and outcomes that callers make at the same time
// into one call of the batch program (lua/batch.lua): the call's round trip
// and its own cost are shared, while each step is still its own atomic
// check-and-record with its own answer, and all of one call run in one
// atomic step of the server.
//
// Steps queue by lane. On one Redis (or a Sentinel's primary) there is one
// lane: a call carries the steps of every run queued meanwhile, grouped by
// run, so that a fleet's agents, one run each, share calls as the
// connections of one run do. On Redis Cluster a lane is a run: a call
// touches one run's keys, one slot, as every per-run program does.
//
// Leader takes what is queued, no timer: a step that finds no call in
// flight for its lane is sent at once, alone; steps that arrive while a
// call is in flight wait for it and go together in the next one. A lone
// request never waits for a batch to fill.
//
// An outcome nobody waits for (FinishLater) is the one exception: it
// queues without leading, and goes with the lane's next call, or on its
// own once Options.OutcomeDelay has passed. One connection's outcome then
// rides with its next request's guard.
type batcher struct {
	// perRun makes every run a lane of its own (Redis Cluster).
	perRun bool
	// delay is Options.OutcomeDelay.
	delay time.Duration

	mu     sync.Mutex
	queues map[string]*laneQueue
	// later holds the outcomes queued by FinishLater and not yet
	// answered, queued or in a call, for settle to wait on.
	later map[*step]struct{}
}

// laneQueue is one lane's steps waiting for the call in flight.
type laneQueue struct {
	busy    bool
	waiting []*step
	// timer sends the lane's queue once its first unled outcome has
	// waited the batcher's delay.
	timer *time.Timer
}

// step is one guard ('g') or outcome ('f', or 'l' for one nobody waits
// for, answered without its record) of a run and, once done, its answer.
type step struct {
	run  string
	op   string
	code byte
	args stepArgs
	ctx  context.Context
	done chan struct{}
	rep  reply
	err  error
	// later is set on an outcome nobody waits for; answered is then
	// called with its answer.
	later    bool
	answered func(reply, error)
}

// answer hands the step its answer.
func (st *step) answer(b *batcher) {
	close(st.done)
	if st.later {
		st.answered(st.rep, st.err)
		b.mu.Lock()
		delete(b.later, st)
		b.mu.Unlock()
	}
}

// do runs one step of runID through its lane's queue and waits for its
// answer, or for ctx to end. A caller that stops waiting does not withdraw
// a step already sent: a guard's fence (NotAfter) is what keeps a guard
// whose caller gave up from taking effect.
func (b *batcher) do(ctx context.Context, s *Store, runID, op string, code byte, args stepArgs) (reply, error) {
	st := &step{run: runID, op: op, code: code, args: args, ctx: ctx, done: make(chan struct{})}
	b.queue(s, st)
	select {
	case <-st.done:
		return st.rep, st.err
	case <-ctx.Done():
		return reply{}, s.fail(op, runID, ctx.Err())
	}
}

// doLater queues one step of runID that nobody waits for; answered is
// called with its answer.
func (b *batcher) doLater(ctx context.Context, s *Store, runID, op string, code byte, args stepArgs, answered func(reply, error)) {
	b.queue(s, &step{run: runID, op: op, code: code, args: args, ctx: ctx, done: make(chan struct{}), later: true, answered: answered})
}

// queue puts st in its lane's queue, and sends the queue if st leads.
func (b *batcher) queue(s *Store, st *step) {
	lane := ""
	if b.perRun {
		lane = st.run
	}
	b.mu.Lock()
	if b.queues == nil {
		b.queues = map[string]*laneQueue{}
	}
	q := b.queues[lane]
	if q == nil {
		q = &laneQueue{}
		b.queues[lane] = q
	}
	q.waiting = append(q.waiting, st)
	if st.later {
		if b.later == nil {
			b.later = map[*step]struct{}{}
		}
		b.later[st] = struct{}{}
	}
	var batch []*step
	switch {
	case q.busy:
	case st.later:
		if q.timer == nil {
			q.timer = time.AfterFunc(b.delay, func() { b.lead(s, lane, q) })
		}
	default:
		batch = b.start(q)
	}
	b.mu.Unlock()
	if batch != nil {
		// This caller leads: it sends what is queued now (itself at
		// least), and hands whatever queued meanwhile to a goroutine, so
		// that it waits for its own call only.
		b.send(s, batch)
		if next := b.next(lane, q); next != nil {
			go b.flush(s, lane, q, next)
		}
	}
}

// start gives the lane's turn to a caller and takes its first batch. The
// batcher's lock is held.
func (b *batcher) start(q *laneQueue) []*step {
	q.busy = true
	if q.timer != nil {
		q.timer.Stop()
		q.timer = nil
	}
	return q.take()
}

// lead sends a lane's queue if nobody is sending it: an outcome's delay
// has passed, or a reader waits for the queued outcomes.
func (b *batcher) lead(s *Store, lane string, q *laneQueue) {
	b.mu.Lock()
	if q.busy || len(q.waiting) == 0 || b.queues[lane] != q {
		b.mu.Unlock()
		return
	}
	batch := b.start(q)
	b.mu.Unlock()
	b.flush(s, lane, q, batch)
}

// settle returns once every outcome queued by FinishLater before it was
// called is answered (or ctx ends), sending the lanes nobody is sending.
func (b *batcher) settle(ctx context.Context, s *Store) {
	b.mu.Lock()
	if len(b.later) == 0 {
		b.mu.Unlock()
		return
	}
	waits := make([]chan struct{}, 0, len(b.later))
	for st := range b.later {
		waits = append(waits, st.done)
	}
	idle := map[string]*laneQueue{}
	for lane, q := range b.queues {
		if !q.busy && len(q.waiting) > 0 {
			idle[lane] = q
		}
	}
	b.mu.Unlock()
	for lane, q := range idle {
		b.lead(s, lane, q) // finds out itself if the lane was sent meanwhile
	}
	for _, done := range waits {
		select {
		case <-done:
		case <-ctx.Done():
			return
		}
	}
}

// take removes up to maxBatch steps from the queue. The batcher's lock is held.
func (q *laneQueue) take() []*step {
	n := min(len(q.waiting), maxBatch)
	batch := q.waiting[:n:n]
	q.waiting = q.waiting[n:]
	if len(q.waiting) == 0 {
		q.waiting = nil
	}
	return batch
}

// next takes the steps queued meanwhile, or ends the lane's turn.
func (b *batcher) next(lane string, q *laneQueue) []*step {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(q.waiting) == 0 {
		q.busy = false
		delete(b.queues, lane)
		return nil
	}
	return q.take()
}

// flush sends batches of the lane's queue until it is empty.
func (b *batcher) flush(s *Store, lane string, q *laneQueue, batch []*step) {
	for batch != nil {
		b.send(s, batch)
		batch = b.next(lane, q)
	}
}

// send makes one call for the batch and hands each step its answer. Steps
// whose callers already gave up are left out. The call's deadline is the
// latest of its callers', and never more than OpTimeout away.
//
// The call holds the batch's steps grouped by run, each run's in the order
// they queued, and a group's keys are the run's keys: the program sets the
// run's keys before its steps, and answers every step in the order sent.
func (b *batcher) send(s *Store, batch []*step) {
	now := time.Now()
	deadline := now.Add(s.opTimeout)
	latest := time.Time{}
	var sent []*step
	for _, st := range batch {
		if err := st.ctx.Err(); err != nil {
			st.err = s.fail(st.op, st.run, err)
			st.answer(b)
			continue
		}
		if d, ok := st.ctx.Deadline(); ok && d.Before(deadline) {
			latest = maxTime(latest, d)
		} else {
			latest = deadline
		}
		sent = append(sent, st)
	}
	if len(sent) == 0 {
		return
	}
	sent = byRun(sent)
	keys, args := batchCall(sent)
	ctx, cancel := context.WithDeadline(context.Background(), latest)
	defer cancel()
	v, err := s.exec(ctx, batchProgram, keys, args...).Result()
	var answers []any
	if err == nil {
		var ok bool
		if answers, ok = v.([]any); !ok || len(answers) != len(sent) {
			err = errBatchReply
		}
	}
	for i, st := range sent {
		if err != nil {
			st.err = s.fail(st.op, st.run, err)
		} else if st.rep, st.err = parseReply(answers[i]); errors.As(st.err, new(groupError)) {
			st.err = s.fail(st.op, st.run, st.err)
		} else if st.err == nil && st.rep.row != nil {
			s.known.add(st.run)
		}
		st.answer(b)
	}
}

// batchCall is the KEYS and ARGV of one call of the batch program for
// steps grouped by run (byRun): the number of groups; the call's head, the
// texts of its first guard (of its first step if none is a guard); then
// each group's length and steps. A step whose texts are the head's sends
// its code and its own arguments; one whose texts differ sends them too,
// after the others, its code in upper case. Every argument costs Redis
// its parsing, a string and a slot in ARGV, and the process a boxed value,
// and an instance's steps share their texts: so a guard sends ten, not
// thirteen.
func batchCall(steps []*step) ([]string, []any) {
	head := steps[0].args.texts
	for _, st := range steps {
		if st.code == 'g' {
			head = st.args.texts
			break
		}
	}
	keys := make([]string, 0, 7)
	args := make([]any, 4, 4+len(steps)*12)
	args[1], args[2], args[3] = head.actor, head.owner, head.ttl
	groups := 0
	for i, st := range steps {
		if i == 0 || st.run != steps[i-1].run {
			groups++
			keys = append(keys, keysOf(st.run).list()...)
			args = append(args, runLength(steps[i:]))
		}
		t := st.args.texts
		guard := st.code == 'g'
		own := t.actor != head.actor || guard && (t.owner != head.owner || t.ttl != head.ttl)
		args = append(args, stepCode(st.code, own))
		args = append(args, st.args.own...)
		switch {
		case own && guard:
			args = append(args, t.actor, t.owner, t.ttl)
		case own:
			args = append(args, t.actor)
		}
	}
	args[0] = groups
	return keys, args
}

// stepCode is a step's code in the call: upper case when the step sends
// its own texts.
func stepCode(code byte, own bool) string {
	switch {
	case code == 'g' && own:
		return "G"
	case code == 'g':
		return "g"
	case code == 'l' && own:
		return "L"
	case code == 'l':
		return "l"
	case own:
		return "F"
	}
	return "f"
}

// byRun orders steps by run, the runs in the order of their first step and
// each run's steps in the order they came: a run's steps keep their order,
// and each run is one group of the call.
func byRun(steps []*step) []*step {
	out := make([]*step, 0, len(steps))
	taken := make([]bool, len(steps))
	for i, st := range steps {
		if taken[i] {
			continue
		}
		for j := i; j < len(steps); j++ {
			if !taken[j] && steps[j].run == st.run {
				taken[j] = true
				out = append(out, steps[j])
			}
		}
	}
	return out
}

// runLength is how many steps at the head of steps belong to its first's run.
func runLength(steps []*step) int {
	n := 1
	for n < len(steps) && steps[n].run == steps[0].run {
		n++
	}
	return n
}

// groupError is the error a call met on the steps of one of its runs, and
// only on those (lua/batch.lua runs each run's steps under pcall): it reads
// as the same error from the server would have for a call of that run alone.
type groupError string

func (e groupError) Error() string { return string(e) }

// RedisError marks it a reply of the server, as go-redis's own errors are.
func (groupError) RedisError() {}

type batchReplyError struct{}

func (batchReplyError) Error() string { return "the batch program answered a reply of the wrong shape" }

var errBatchReply error = batchReplyError{}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
