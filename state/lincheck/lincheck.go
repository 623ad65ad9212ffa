// Package lincheck checks that a state.Store's guard and cancel are
// linearizable: it records histories of concurrent guards, cancels and
// reads of a few runs, from several clients (several stores on one server,
// standing for several stopgate instances), and checks each history with
// porcupine against the sequential model of one run:
//
//   - a guard is admitted only while the run is ACTIVE (and at the version
//     it observed, if it gave one); no guard is admitted after the cancel;
//   - the cancel is a compare-and-set: it changes the row once, bumping the
//     version by one; the version only grows;
//   - a read sees the status, the version and the number of admitted
//     effects that the operations linearized before it produced.
//
// An operation that ends in an error (a deadline, a store that did not
// answer) is ambiguous: it may have taken effect at any moment after its
// call, or never, and the model allows both.
//
// It owns only the model, the recorder and the check. It never decides
// what a store does; both stores run it from their own tests, as they run
// the conformance suite (package statetest).
package lincheck

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/stopgate/stopgate/state"
)

// Kind is what an operation does.
type Kind int

const (
	Guard Kind = iota
	Cancel
	Read
)

func (k Kind) String() string {
	return [...]string{"guard", "cancel", "read"}[k]
}

// Input is one operation as called.
type Input struct {
	Run  string
	Kind Kind
	// Key is the guard's explicit idempotency key (unique per guard).
	Key string
	// Observed is the version a guard carries (0: ACTIVE alone).
	Observed int64
}

// Output is what the store answered.
type Output struct {
	// Ambiguous: the call failed; it may or may not have taken effect.
	Ambiguous bool
	Err       string
	// Guard.
	Admitted bool
	Refusal  string
	// Cancel.
	Changed bool
	// The row as the answer carried it (guard, cancel, read).
	Status  state.Status
	Version int64
	// Read: the number of effects the row says were admitted.
	Effects int
}

// runState is the model's state of one run.
type runState struct {
	cancelled bool
	version   int64
	admitted  int
}

// Model is the sequential specification of one run, admitted before the
// history starts (ACTIVE at version 1, nothing admitted), partitioned by
// run so that each run is checked on its own.
func Model() porcupine.Model {
	nm := &porcupine.NondeterministicModel{
		Partition: func(history []porcupine.Operation) [][]porcupine.Operation {
			byRun := map[string][]porcupine.Operation{}
			var order []string
			for _, op := range history {
				run := op.Input.(Input).Run
				if _, ok := byRun[run]; !ok {
					order = append(order, run)
				}
				byRun[run] = append(byRun[run], op)
			}
			out := make([][]porcupine.Operation, 0, len(order))
			for _, run := range order {
				out = append(out, byRun[run])
			}
			return out
		},
		Init: func() []any { return []any{runState{version: 1}} },
		Step: func(st, in, out any) []any {
			s, i, o := st.(runState), in.(Input), out.(Output)
			switch i.Kind {
			case Guard:
				mayAdmit := !s.cancelled && (i.Observed == 0 || i.Observed == s.version)
				admitted := s
				admitted.admitted++
				switch {
				case o.Ambiguous:
					if mayAdmit {
						return []any{s, admitted}
					}
					return []any{s}
				case o.Admitted:
					if mayAdmit && o.Version == s.version && o.Status == state.StatusActive {
						return []any{admitted}
					}
				case o.Refusal == state.RefusalRunNotActive:
					if s.cancelled && o.Version == s.version {
						return []any{s}
					}
				case o.Refusal == state.RefusalStaleVersion:
					if !s.cancelled && i.Observed != 0 && i.Observed != s.version && o.Version == s.version {
						return []any{s}
					}
				}
				return nil
			case Cancel:
				cancelled := s
				cancelled.cancelled = true
				cancelled.version++
				switch {
				case o.Ambiguous:
					if s.cancelled {
						return []any{s}
					}
					return []any{s, cancelled}
				case o.Changed:
					if !s.cancelled && o.Version == cancelled.version {
						return []any{cancelled}
					}
				default:
					if s.cancelled && o.Version == s.version {
						return []any{s}
					}
				}
				return nil
			case Read:
				if o.Ambiguous {
					return []any{s}
				}
				if (o.Status == state.StatusActive) == !s.cancelled && o.Version == s.version && o.Effects == s.admitted {
					return []any{s}
				}
				return nil
			}
			return nil
		},
		Equal: func(a, b any) bool { return a.(runState) == b.(runState) },
		DescribeOperation: func(in, out any) string {
			i, o := in.(Input), out.(Output)
			var res string
			switch {
			case o.Ambiguous:
				res = "ambiguous (" + o.Err + ")"
			case i.Kind == Guard && o.Admitted:
				res = fmt.Sprintf("admitted at v%d", o.Version)
			case i.Kind == Guard:
				res = fmt.Sprintf("refused %s (%s v%d)", o.Refusal, o.Status, o.Version)
			case i.Kind == Cancel:
				res = fmt.Sprintf("changed=%v → %s v%d", o.Changed, o.Status, o.Version)
			default:
				res = fmt.Sprintf("%s v%d, %d admitted", o.Status, o.Version, o.Effects)
			}
			switch i.Kind {
			case Guard:
				return fmt.Sprintf("guard(%s, observed v%d) → %s", i.Key, i.Observed, res)
			case Cancel:
				return "cancel → " + res
			default:
				return "read → " + res
			}
		},
		DescribeState: func(st any) string {
			s := st.(runState)
			status := "ACTIVE"
			if s.cancelled {
				status = "CANCELLING"
			}
			return fmt.Sprintf("%s v%d, %d admitted", status, s.version, s.admitted)
		},
	}
	return nm.ToModel()
}

// Config shapes one recorded history.
type Config struct {
	Seed int64
	// Runs are admitted first, then raced over; 2 when zero.
	Runs int
	// Clients issue operations concurrently, client i through stores[i %
	// len(stores)]; 6 when zero.
	Clients int
	// Ops is how many operations each client issues; 25 when zero.
	Ops int
	// Ambiguous is the share of operations given a deadline so short
	// (a fraction of a millisecond to a few) that they may fail after the
	// store acted; 0.1 when zero, none when negative.
	Ambiguous float64
}

func (c *Config) defaults() {
	if c.Runs == 0 {
		c.Runs = 2
	}
	if c.Clients == 0 {
		c.Clients = 6
	}
	if c.Ops == 0 {
		c.Ops = 25
	}
	if c.Ambiguous == 0 {
		c.Ambiguous = 0.1
	}
}

// History is one recorded history and what it holds.
type History struct {
	Ops []porcupine.Operation
	// Counts by outcome, for the report.
	Admitted, Refused, Cancels, Reads, Ambiguous int
}

// admittedOf counts the effects a row says were admitted: every intent but
// those refused before dispatch, revoked or still only scheduled.
func admittedOf(r state.Run) int {
	n := 0
	for st, c := range r.Intents {
		switch st {
		case state.IntentCancelledBeforeDispatch, state.IntentRevoked, state.IntentScheduled:
		default:
			n += c
		}
	}
	return n
}

// Record admits cfg.Runs fresh runs (named with prefix) and records one
// history of concurrent guards, cancels and reads on them. Each run is
// cancelled once by an operator at a random moment of the history; clients
// also repeat cancels now and then.
func Record(ctx context.Context, stores []state.Store, prefix string, cfg Config) (History, error) {
	cfg.defaults()
	rng := rand.New(rand.NewPCG(uint64(cfg.Seed), 0x5709))
	runs := make([]string, cfg.Runs)
	for i := range runs {
		runs[i] = fmt.Sprintf("%s-%d", prefix, i)
		if _, err := stores[0].Admit(ctx, state.AdmitRequest{RunID: runs[i], Actor: "lincheck"}); err != nil {
			return History{}, fmt.Errorf("admit %s: %w", runs[i], err)
		}
	}
	start := time.Now()
	var mu sync.Mutex
	var h History
	// do runs one operation and appends it to the history.
	do := func(client int, s state.Store, in Input, short time.Duration) {
		opCtx, cancel := ctx, context.CancelFunc(func() {})
		if short > 0 {
			opCtx, cancel = context.WithTimeout(ctx, short)
		}
		defer cancel()
		var out Output
		call := time.Since(start).Nanoseconds()
		var err error
		switch in.Kind {
		case Guard:
			var res state.GuardResult
			res, err = s.Guard(opCtx, state.GuardRequest{
				RunID: in.Run, ObservedVersion: in.Observed, Key: in.Key, ExplicitKey: true,
				Boundary: state.BoundaryHTTP, Method: "POST", Target: "https://provider.example/charge",
				LeaseOwner: "lincheck", LeaseTTL: time.Hour, Actor: fmt.Sprintf("client:%d", client),
			})
			out = Output{Admitted: res.Admitted, Refusal: res.Refusal, Status: res.Run.Status, Version: res.Run.CancelVersion}
		case Cancel:
			var res state.CancelResult
			res, err = s.Cancel(opCtx, state.CancelRequest{RunID: in.Run, Actor: fmt.Sprintf("operator:%d", client), Reason: "lincheck", DrainTimeout: time.Hour})
			out = Output{Changed: res.Changed, Status: res.Run.Status, Version: res.Run.CancelVersion}
		case Read:
			var r state.Run
			r, err = s.Get(opCtx, in.Run)
			out = Output{Status: r.Status, Version: r.CancelVersion, Effects: admittedOf(r)}
		}
		ret := time.Since(start).Nanoseconds()
		if err != nil {
			out = Output{Ambiguous: true, Err: err.Error()}
			ret = -1 // fixed below: after every other operation
		}
		mu.Lock()
		defer mu.Unlock()
		h.Ops = append(h.Ops, porcupine.Operation{ClientId: client, Input: in, Call: call, Output: out, Return: ret})
		switch {
		case out.Ambiguous:
			h.Ambiguous++
		case in.Kind == Guard && out.Admitted:
			h.Admitted++
		case in.Kind == Guard:
			h.Refused++
		case in.Kind == Cancel:
			h.Cancels++
		default:
			h.Reads++
		}
	}

	type plan struct {
		in    Input
		short time.Duration
		pause time.Duration
	}
	plans := make([][]plan, cfg.Clients)
	key := 0
	for c := range plans {
		for range cfg.Ops {
			p := plan{in: Input{Run: runs[rng.IntN(len(runs))]}, pause: time.Duration(rng.IntN(300)) * time.Microsecond}
			switch r := rng.Float64(); {
			case r < 0.65:
				key++
				p.in.Kind = Guard
				p.in.Key = "k" + strconv.Itoa(key)
				p.in.Observed = int64(rng.IntN(2)) // 0: ACTIVE alone; 1: the version admitted
			case r < 0.70:
				p.in.Kind = Cancel
			default:
				p.in.Kind = Read
			}
			if cfg.Ambiguous > 0 && rng.Float64() < cfg.Ambiguous {
				p.short = time.Duration(50+rng.IntN(3000)) * time.Microsecond
			}
			plans[c] = append(plans[c], p)
		}
	}
	// Each run is cancelled once the history holds a random share (10% to
	// 90%) of its operations, so that guards race the cancel on both sides.
	total := cfg.Clients * cfg.Ops
	cancelAfter := make([]int, len(runs))
	for i := range cancelAfter {
		cancelAfter[i] = total/10 + rng.IntN(total*8/10+1)
	}
	recorded := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(h.Ops)
	}

	var wg sync.WaitGroup
	for c, ps := range plans {
		s := stores[c%len(stores)]
		wg.Go(func() {
			for _, p := range ps {
				time.Sleep(p.pause)
				do(c, s, p.in, p.short)
			}
		})
	}
	operator := len(plans)
	wg.Go(func() {
		for i, run := range runs {
			for recorded() < cancelAfter[i] && ctx.Err() == nil {
				time.Sleep(100 * time.Microsecond)
			}
			do(operator, stores[i%len(stores)], Input{Run: run, Kind: Cancel}, 0)
		}
	})
	wg.Wait()
	// A last read of every run, once everything returned, pins the final state.
	for _, run := range runs {
		do(operator, stores[0], Input{Run: run, Kind: Read}, 0)
	}
	end := time.Since(start).Nanoseconds() + 1
	for i := range h.Ops {
		if h.Ops[i].Return < 0 {
			h.Ops[i].Return = end
		}
	}
	return h, nil
}

// Check runs porcupine on a history; it never takes longer than timeout
// (the result is then porcupine.Unknown).
func Check(h History, timeout time.Duration) (porcupine.CheckResult, porcupine.LinearizationInfo) {
	return porcupine.CheckOperationsVerbose(Model(), h.Ops, timeout)
}

// Seeds is how many histories a store's test records:
// STOPGATE_LIN_SEEDS, else def.
func Seeds(t testing.TB, def int) int {
	v := os.Getenv("STOPGATE_LIN_SEEDS")
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		t.Fatalf("STOPGATE_LIN_SEEDS=%q: want a whole number of 1 or more", v)
	}
	return n
}

// Open returns the stores a history is recorded through: one, or several
// on one server standing for several instances. They are closed by the test.
type Open func(t *testing.T) []state.Store

// Run records and checks seeds histories on the stores open returns, and
// fails the test on any history that is not linearizable, writing
// porcupine's visualization of it next to the test's temporary files (or
// into STOPGATE_LIN_DIR). It logs one summary line, "lincheck: NAME: ...".
func Run(t *testing.T, name string, seeds int, cfg Config, open Open) {
	t.Helper()
	stores := open(t)
	var total History
	for seed := range seeds {
		cfg.Seed = int64(seed)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		h, err := Record(ctx, stores, fmt.Sprintf("lin%d", seed), cfg)
		cancel()
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		res, info := Check(h, 30*time.Second)
		total.Ops = append(total.Ops, h.Ops...)
		total.Admitted += h.Admitted
		total.Refused += h.Refused
		total.Cancels += h.Cancels
		total.Reads += h.Reads
		total.Ambiguous += h.Ambiguous
		if res != porcupine.Ok {
			path := visualize(t, name, seed, info)
			t.Errorf("seed %d: history of %d operations is %s against the model (no guard admitted after the cancel; the version only grows); visualization: %s", seed, len(h.Ops), res, path)
		}
	}
	verdict := "every history linearizable"
	if t.Failed() {
		verdict = "NOT linearizable (see above)"
	}
	t.Logf("lincheck: %s: %d seeds, %d operations (%d guards admitted, %d refused, %d cancels, %d reads, %d ambiguous): %s",
		name, seeds, len(total.Ops), total.Admitted, total.Refused, total.Cancels, total.Reads, total.Ambiguous, verdict)
}

func visualize(t *testing.T, name string, seed int, info porcupine.LinearizationInfo) string {
	dir := os.Getenv("STOPGATE_LIN_DIR")
	if dir == "" {
		dir = t.TempDir()
	}
	path := filepath.Join(dir, fmt.Sprintf("lincheck-%s-seed%d.html", name, seed))
	if err := porcupine.VisualizePath(Model(), info, path); err != nil {
		return "(not written: " + err.Error() + ")"
	}
	return path
}
