package redisstore

import (
	"context"
	"sync"
	"time"
)

// maxBatch bounds the steps of one batch call, so that one call stays a
// short step of the server.
const maxBatch = 64

// batcher joins the steps that callers make at the same time into one
// round of runSteps (one call of the apply program, and of the read
// program for the runs that need one): the calls' round trips and their
// own cost are shared, while each step is still its own atomic
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

// answer hands the step its answer.
func (st *step) answer(b *batcher) {
	close(st.done)
	if st.later {
		st.answered(st.err)
		b.mu.Lock()
		delete(b.later, st)
		b.mu.Unlock()
	}
}

// do runs one step through its lane's queue and waits for its answer, or
// for ctx to end. A caller that stops waiting does not withdraw a step
// already sent: a guard's fence (NotAfter) is what keeps a guard whose
// caller gave up from taking effect.
func (b *batcher) do(ctx context.Context, s *Store, st *step) error {
	st.ctx, st.done = ctx, make(chan struct{})
	b.queue(s, st)
	select {
	case <-st.done:
		return st.err
	case <-ctx.Done():
		return s.fail(st.op, st.run, ctx.Err())
	}
}

// doLater queues one step that nobody waits for; answered is called with
// its error.
func (b *batcher) doLater(ctx context.Context, s *Store, st *step, answered func(error)) {
	st.ctx, st.done, st.later, st.answered = ctx, make(chan struct{}), true, answered
	b.queue(s, st)
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

// send decides and writes the batch and hands each step its answer.
// Steps whose callers already gave up are left out. The calls' deadline is
// the latest of its callers', and never more than OpTimeout away.
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
	ctx, cancel := context.WithDeadline(context.Background(), latest)
	defer cancel()
	s.runSteps(ctx, sent)
	for _, st := range sent {
		st.answer(b)
	}
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
