package redisstore

import (
	"context"
	"sync"
	"time"
)

// maxBatch bounds the steps of one batch call, so that one call stays a
// short step of the server.
const maxBatch = 64

// batcher joins the guards and outcomes that callers of one run make at the
// same time into one call of the batch program (lua/batch.lua): the call's
// round trip and its own cost are shared, while each step is still its own
// atomic check-and-record with its own answer, and all of one call run in
// one atomic step of the server. A batch holds steps of one run only, so
// it touches one slot and runs on Redis Cluster as any per-run program.
//
// Leader takes what is queued, no timer: a step that finds no call in
// flight for its run is sent at once, alone; steps that arrive while a call
// is in flight wait for it and go together in the next one. A lone request
// never waits for a batch to fill.
type batcher struct {
	mu     sync.Mutex
	queues map[string]*runQueue
}

// runQueue is one run's steps waiting for the call in flight.
type runQueue struct {
	busy    bool
	waiting []*step
}

// step is one guard ('g') or outcome ('f') and, once done, its answer.
type step struct {
	op   string
	code string
	args []any
	ctx  context.Context
	done chan struct{}
	rep  reply
	err  error
}

// do runs one step of runID through the run's queue and waits for its
// answer, or for ctx to end. A caller that stops waiting does not withdraw
// a step already sent: a guard's fence (NotAfter) is what keeps a guard
// whose caller gave up from taking effect.
func (b *batcher) do(ctx context.Context, s *Store, runID, op string, code byte, args []any) (reply, error) {
	st := &step{op: op, code: string(code), args: args, ctx: ctx, done: make(chan struct{})}
	b.mu.Lock()
	if b.queues == nil {
		b.queues = map[string]*runQueue{}
	}
	q := b.queues[runID]
	if q == nil {
		q = &runQueue{}
		b.queues[runID] = q
	}
	q.waiting = append(q.waiting, st)
	var batch []*step
	if !q.busy {
		q.busy = true
		batch = q.take()
	}
	b.mu.Unlock()
	if batch != nil {
		// This caller leads: it sends what is queued now (itself at
		// least), and hands whatever queued meanwhile to a goroutine, so
		// that it waits for its own call only.
		b.send(s, runID, batch)
		if next := b.next(runID, q); next != nil {
			go b.flush(s, runID, q, next)
		}
	}
	select {
	case <-st.done:
		return st.rep, st.err
	case <-ctx.Done():
		return reply{}, s.fail(op, runID, ctx.Err())
	}
}

// take removes up to maxBatch steps from the queue. The batcher's lock is held.
func (q *runQueue) take() []*step {
	n := min(len(q.waiting), maxBatch)
	batch := q.waiting[:n:n]
	q.waiting = q.waiting[n:]
	if len(q.waiting) == 0 {
		q.waiting = nil
	}
	return batch
}

// next takes the steps queued meanwhile, or ends the run's turn.
func (b *batcher) next(runID string, q *runQueue) []*step {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(q.waiting) == 0 {
		q.busy = false
		delete(b.queues, runID)
		return nil
	}
	return q.take()
}

// flush sends batches of the run's queue until it is empty.
func (b *batcher) flush(s *Store, runID string, q *runQueue, batch []*step) {
	for batch != nil {
		b.send(s, runID, batch)
		batch = b.next(runID, q)
	}
}

// send makes one call for the batch and hands each step its answer. Steps
// whose callers already gave up are left out. The call's deadline is the
// latest of its callers', and never more than OpTimeout away.
func (b *batcher) send(s *Store, runID string, batch []*step) {
	now := time.Now()
	deadline := now.Add(s.opTimeout)
	latest := time.Time{}
	args := make([]any, 1, 1+len(batch)*16)
	var sent []*step
	for _, st := range batch {
		if err := st.ctx.Err(); err != nil {
			st.err = s.fail(st.op, runID, err)
			close(st.done)
			continue
		}
		if d, ok := st.ctx.Deadline(); ok && d.Before(deadline) {
			latest = maxTime(latest, d)
		} else {
			latest = deadline
		}
		args = append(args, st.code)
		args = append(args, st.args...)
		sent = append(sent, st)
	}
	if len(sent) == 0 {
		return
	}
	args[0] = len(sent)
	ctx, cancel := context.WithDeadline(context.Background(), latest)
	defer cancel()
	v, err := s.exec(ctx, batchProgram, keysOf(runID).list(), args...).Result()
	var answers []any
	if err == nil {
		var ok bool
		if answers, ok = v.([]any); !ok || len(answers) != len(sent) {
			err = errBatchReply
		}
	}
	for i, st := range sent {
		if err != nil {
			st.err = s.fail(st.op, runID, err)
		} else if st.rep, st.err = parseReply(answers[i]); st.err == nil && st.rep.row != nil {
			s.known.add(runID)
		}
		close(st.done)
	}
}

type batchReplyError struct{}

func (batchReplyError) Error() string { return "the batch program answered a reply of the wrong shape" }

var errBatchReply error = batchReplyError{}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
