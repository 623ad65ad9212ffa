package telemetry

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"time"
)

// Repeats returns a handler over h that passes a warning or an error the
// first time its message is logged, then at most once per window, carrying
// how many of its kind were held back since ("repeated"): a loop that
// retries every second while the store is down (the sweeper, the
// reconciler, the watch, the store's own client) says so once a window,
// not three times a second. Records below warn pass as they are. A
// message's kind is its text and the attributes its logger was given
// (With: the component), not the record's own (the run it concerns).
func Repeats(h slog.Handler, window time.Duration) slog.Handler {
	return &repeats{h: h, seen: &seen{window: window, now: time.Now, last: map[string]*held{}}}
}

type repeats struct {
	h      slog.Handler
	prefix string
	seen   *seen
}

// seen is what a handler and those derived from it (With) share.
type seen struct {
	window time.Duration
	now    func() time.Time
	mu     sync.Mutex
	last   map[string]*held
}

// held is one kind of message: when it was last let through, and how many
// have been held back since.
type held struct {
	at   time.Time
	held int
}

// maxKinds bounds the kinds remembered; past it the memory starts afresh
// (at worst a kind is let through once more than its window allows).
const maxKinds = 4096

func (r *repeats) Enabled(ctx context.Context, l slog.Level) bool { return r.h.Enabled(ctx, l) }

func (r *repeats) Handle(ctx context.Context, rec slog.Record) error {
	if rec.Level < slog.LevelWarn {
		return r.h.Handle(ctx, rec)
	}
	n, pass := r.seen.let(r.prefix + "\x00" + rec.Message)
	if !pass {
		return nil
	}
	if n > 0 {
		rec = rec.Clone()
		rec.AddAttrs(slog.Int("repeated", n), slog.Duration("repeat_window", r.seen.window))
	}
	return r.h.Handle(ctx, rec)
}

// let says whether a record of kind may pass now, and how many of its kind
// were held back since the last one that did.
func (s *seen) let(kind string) (int, bool) {
	at := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	k, ok := s.last[kind]
	if !ok {
		if len(s.last) >= maxKinds {
			s.last = map[string]*held{}
		}
		s.last[kind] = &held{at: at}
		return 0, true
	}
	if at.Sub(k.at) < s.window {
		k.held++
		return 0, false
	}
	n := k.held
	k.at, k.held = at, 0
	return n, true
}

func (r *repeats) WithAttrs(attrs []slog.Attr) slog.Handler {
	var b strings.Builder
	b.WriteString(r.prefix)
	for _, a := range attrs {
		b.WriteString(" " + a.String())
	}
	return &repeats{h: r.h.WithAttrs(attrs), prefix: b.String(), seen: r.seen}
}

func (r *repeats) WithGroup(name string) slog.Handler {
	return &repeats{h: r.h.WithGroup(name), prefix: r.prefix + " [" + name + "]", seen: r.seen}
}
