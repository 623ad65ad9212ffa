// Package redisstore is the shared state.Store on Redis, for a fleet of
// stopgate instances: every operation that changes a run is one Lua script,
// so the check and the write of the guard are one atomic step of the server,
// and every key of a run shares the hash tag {RUN} so each script runs on a
// single Redis Cluster slot. docs/redis.md describes the key layout and the
// failure behaviour.
package redisstore

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stopgate/stopgate/state"
)

// DefaultOpTimeout bounds one store operation when Options.OpTimeout is zero.
const DefaultOpTimeout = state.DefaultTimeout

// Options tune a Store.
type Options struct {
	// OpTimeout bounds every operation (DefaultOpTimeout when zero): a slow
	// or paused Redis answers ErrUnavailable after it, so callers fail
	// closed instead of hanging.
	OpTimeout time.Duration
	// Logger receives the store's own notes (dropped cancel notifications,
	// index repairs); slog.Default() when nil.
	Logger *slog.Logger
	// CancelReplicas, when above zero, acknowledges a cancel only once that
	// many replicas of the run's primary have it (Redis WAIT, within
	// OpTimeout), so that a failover after the acknowledgement cannot lose
	// it. A cancel the replicas do not confirm in time is an error wrapping
	// state.ErrUnavailable (the API answers 503), although it is committed
	// on the primary and already refuses the run's effects there: it may be
	// lost if the primary fails before a replica has it. Cancelling again
	// is safe (nothing changes twice) and waits again. docs/redis.md.
	CancelReplicas int
	// OutcomeDelay bounds how long an outcome queued by FinishLater waits
	// for a call to ride with (state.OutcomeDelay when zero).
	OutcomeDelay time.Duration
	// Clock gives each step its time (time.Now when nil): the rules are
	// decided, and their records dated, in this process. A guard's fence
	// is still checked by the server's clock.
	Clock func() time.Time

	// The store's marker (marker.go): CheckInterval is how often it is read
	// in the background (DefaultCheckInterval when zero); MarkerFile, if
	// set, keeps what this instance saw of it across restarts.
	CheckInterval time.Duration
	MarkerFile    string
	// Password, when set, authenticates to the data nodes whatever the
	// URL's form (from a file or the environment, not the command line); a
	// URL that has a password too is refused.
	Password string
}

// Store is a state.Store on Redis. It is safe for concurrent use.
type Store struct {
	rdb       redis.UniversalClient
	scripter  onceScripter
	fns       functions
	batches   batcher
	opTimeout time.Duration
	// cancelReplicas is Options.CancelReplicas.
	cancelReplicas int
	log            *slog.Logger
	addr           string // for messages: the URL with the password hidden
	tgt            URL    // what the URL names, for Exposure's probe

	// seen is what this process last saw of runs (driver.go): a run in it
	// has a row, so its index entry exists already (index.go).
	seen  seenRuns
	clock func() time.Time

	mu     sync.Mutex
	closed bool
	subs   map[*redis.PubSub]struct{}

	// mark is what this instance saw of the store's marker (marker.go).
	mark markerWatch
	// tally is the walk that counts runs stored before totals were kept
	// (totals.go); life ends at Close, and with it the walk.
	tally   tallyWalk
	life    context.Context
	endLife context.CancelFunc
}

var _ state.Store = (*Store)(nil)

// Open connects to the Redis the URL names (its forms: see URL) and checks
// that it answers.
func Open(ctx context.Context, url string, opts Options) (*Store, error) {
	t, err := ParseURL(url)
	if err != nil {
		return nil, err
	}
	if t, err = t.WithPassword(opts.Password); err != nil {
		return nil, err
	}
	if opts.OpTimeout < 0 {
		return nil, fmt.Errorf("%w: op timeout %s is negative", state.ErrInvalid, opts.OpTimeout)
	}
	if opts.CheckInterval < 0 {
		return nil, fmt.Errorf("%w: marker check interval %s is negative", state.ErrInvalid, opts.CheckInterval)
	}
	if opts.OpTimeout == 0 {
		opts.OpTimeout = DefaultOpTimeout
	}
	if opts.CancelReplicas < 0 {
		return nil, fmt.Errorf("%w: cancel replicas %d is negative", state.ErrInvalid, opts.CancelReplicas)
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	s := &Store{
		opTimeout:      opts.OpTimeout,
		cancelReplicas: opts.CancelReplicas,
		log:            opts.Logger.With("store", "redis"),
		addr:           t.Redacted(),
		subs:           map[*redis.PubSub]struct{}{},
		seen:           newSeenRuns(),
		clock:          opts.Clock,
	}
	if s.clock == nil {
		s.clock = time.Now
	}
	s.life, s.endLife = context.WithCancel(context.Background())
	s.rdb, s.tgt = newClient(t, opts.OpTimeout), t
	s.scripter = onceScripter{rdb: s.rdb}
	// A cluster keeps each run on its own slot: a call carries one run.
	_, s.batches.perRun = s.rdb.(*redis.ClusterClient)
	s.batches.delay = cmp.Or(opts.OutcomeDelay, state.OutcomeDelay)
	if err := s.Ping(ctx); err != nil {
		_ = s.rdb.Close()
		return nil, fmt.Errorf("open redis store: %w", err)
	}
	mctx, cancel := s.op(ctx)
	defer cancel()
	if err := s.loadLibrary(mctx); err != nil {
		_ = s.rdb.Close()
		return nil, fmt.Errorf("open redis store: %w", err)
	}
	if err := s.migrate(mctx); err != nil {
		_ = s.rdb.Close()
		return nil, fmt.Errorf("open redis store: %w", err)
	}
	if err := s.openMarker(mctx, opts); err != nil {
		_ = s.rdb.Close()
		return nil, fmt.Errorf("open redis store: %w", err)
	}
	if err := s.openTotals(mctx); err != nil {
		_ = s.rdb.Close()
		return nil, fmt.Errorf("open redis store: %w", err)
	}
	return s, nil
}

// Dialing is retried once, briefly: a connection that was refused has sent
// nothing, so retrying it is safe, but a store that is down should answer
// ErrUnavailable at once rather than after go-redis's five attempts.
const (
	dialAttempts = 2
	dialBackoff  = 50 * time.Millisecond
)

// newClient builds the go-redis client for a target.
//
// MaxRetries is -1: go-redis would otherwise re-send a command whose reply
// was lost, and a script that already ran (a cancel, a guard that admitted
// an effect) would run a second time. A failed operation is reported as
// ErrUnavailable instead, and the caller decides (the proxy fails closed).
// Timeouts follow OpTimeout so that a stopped server costs at most that.
func newClient(u URL, opTimeout time.Duration) redis.UniversalClient {
	switch u.kind {
	case KindSentinel:
		opt := *u.failover
		bound(opTimeout, &opt.MaxRetries, &opt.ContextTimeoutEnabled, &opt.DialerRetries, &opt.DialerRetryTimeout,
			&opt.DialTimeout, &opt.ReadTimeout, &opt.WriteTimeout, &opt.PoolTimeout)
		return redis.NewFailoverClient(&opt)
	case KindCluster:
		opt := *u.cluster
		bound(opTimeout, &opt.MaxRetries, &opt.ContextTimeoutEnabled, &opt.DialerRetries, &opt.DialerRetryTimeout,
			&opt.DialTimeout, &opt.ReadTimeout, &opt.WriteTimeout, &opt.PoolTimeout)
		return redis.NewClusterClient(&opt)
	default:
		opt := *u.node
		bound(opTimeout, &opt.MaxRetries, &opt.ContextTimeoutEnabled, &opt.DialerRetries, &opt.DialerRetryTimeout,
			&opt.DialTimeout, &opt.ReadTimeout, &opt.WriteTimeout, &opt.PoolTimeout)
		return redis.NewClient(&opt)
	}
}

// bound sets, in the options of any of go-redis's clients, what stopgate
// decides whatever the URL says (see newClient): no retries, every timeout
// opTimeout and enforced on the context, dials retried briefly.
func bound(opTimeout time.Duration, maxRetries *int, contextTimeout *bool, dialerRetries *int, dialerRetryTimeout *time.Duration, timeouts ...*time.Duration) {
	*maxRetries, *contextTimeout = -1, true
	*dialerRetries, *dialerRetryTimeout = dialAttempts, dialBackoff
	for _, t := range timeouts {
		*t = opTimeout
	}
}

// op bounds one operation, all its round trips together, by OpTimeout (or
// the caller's earlier deadline), once the outcomes queued by FinishLater
// are written: whatever the operation reads or changes, it comes after
// them, as it would after a Finish.
func (s *Store) op(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := s.bound(ctx)
	s.batches.settle(ctx, s)
	return ctx, cancel
}

// bound is op without waiting for queued outcomes: for the guard and the
// outcome, which queue behind them in the batcher.
func (s *Store) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	if d, ok := ctx.Deadline(); ok && time.Until(d) <= s.opTimeout {
		// Bound already (the ledger bounds every guard and outcome): a
		// second timer would end no sooner, and costs one per step.
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, s.opTimeout)
}

// fail wraps a Redis error with the operation that met it. Anything that
// says the server could not be reached or did not answer in time — network
// errors, timeouts, a closed client, and the server replies that mean "not
// now" (loading after a restart, a failover in progress) — wraps
// state.ErrUnavailable.
func (s *Store) fail(op, runID string, err error) error {
	what := "redis " + op
	if runID != "" {
		what += " run " + runID
	}
	if unavailable(err) {
		return fmt.Errorf("%s on %s: %w: %w", what, s.addr, state.ErrUnavailable, err)
	}
	return fmt.Errorf("%s on %s: %w", what, s.addr, err)
}

// unavailable reports whether err means the data could not be reached right
// now, rather than that the request was wrong.
func unavailable(err error) bool {
	var rerr redis.Error
	if !errors.As(err, &rerr) {
		// Not a reply from the server: the connection, the pool or the deadline.
		return true
	}
	// Server replies that mean "not now": loading the AOF after a restart, a
	// replica during failover, a cluster reconfiguring, a busy script, a
	// full or unwritable server.
	for _, p := range [...]string{"LOADING", "READONLY", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "BUSY", "NOREPLICAS", "MISCONF", "OOM", "MOVED", "ASK"} {
		if redis.HasErrorPrefix(err, p) {
			return true
		}
	}
	return false
}

// runOf turns a row hash (or as much of it as a script read) into a Run.
// Absent fields read as zero.
func runOf(id string, m map[string]string) state.Run {
	num := func(k string) int64 {
		n, _ := strconv.ParseInt(m[k], 10, 64)
		return n
	}
	at := func(k string) time.Time {
		if m[k] == "" {
			return time.Time{}
		}
		return msTime(num(k))
	}
	r := state.Run{
		ID:            id,
		Status:        state.Status(m["status"]),
		CancelVersion: num("v"),
		Reason:        m["reason"],
		StatusReason:  m["status_reason"],
		CreatedAt:     at("created"),
		UpdatedAt:     at("updated"),
		CancelledAt:   at("cancelled"),
		DrainDeadline: at("drain"),
		PrunedAt:      at("pruned"),
		Intents:       map[state.IntentState]int{},
		Budget:        budgetOf(m[budgetField]),
	}
	for k, v := range m {
		st, ok := strings.CutPrefix(k, "n:")
		if !ok {
			continue
		}
		if n, _ := strconv.Atoi(v); n != 0 {
			r.Intents[state.IntentState(st)] = n
		}
	}
	return r
}

func flag(b bool) string {
	if b {
		return "1"
	}
	return "0"
}

// ms is a duration in whole milliseconds, rounded up so that a positive
// duration never becomes zero.
func ms(d time.Duration) int64 {
	return int64((d + time.Millisecond - 1) / time.Millisecond)
}

// rowFields are the row's own fields in the run's hash (ROW in the
// programs: rowPrelude); the rest of the hash holds its intents.
var rowFields = []string{"status", "v", "reason", "status_reason", "created", "updated", "cancelled", "drain", "t",
	"o", "pruned", "n:IN_FLIGHT", "n:SCHEDULED", "n:RESPONDED", "n:NOT_SENT", "n:UNKNOWN",
	"n:CANCELLED_BEFORE_DISPATCH", "n:REVOKED", "n:APPLIED", "n:NOT_APPLIED", budgetField, countedField}

// budgetField is the row's budget (state.Budget.Text), written when the
// row is created and never after; budgetAt is its place in rowFields.
const (
	budgetField = "budget"
	budgetAt    = 20
)

// countedField is set ("1") on a row counted in the totals (totals.go).
const countedField = "g"

// counted reports whether the values of an HMGET of rowFields are of a
// row counted in the totals.
func counted(vals []any) bool {
	v, _ := vals[len(rowFields)-1].(string)
	return v == "1"
}

// rowOfValues is the row the values of an HMGET of rowFields make, without
// a map between; false for a run never seen. It reads as runOf does.
func rowOfValues(id string, vals []any) (state.Run, bool) {
	if len(vals) < len(rowFields) || vals[0] == nil {
		return state.Run{}, false
	}
	str := func(i int) string { s, _ := vals[i].(string); return s }
	num := func(i int) int64 {
		if str(i) == "" {
			// Absent: no parse, whose error would cost an allocation.
			return 0
		}
		n, _ := strconv.ParseInt(str(i), 10, 64)
		return n
	}
	at := func(i int) time.Time {
		if str(i) == "" {
			return time.Time{}
		}
		return msTime(num(i))
	}
	r := state.Run{ID: id, Status: state.Status(str(0)), CancelVersion: num(1), Reason: str(2), StatusReason: str(3),
		CreatedAt: at(4), UpdatedAt: at(5), CancelledAt: at(6), DrainDeadline: at(7), PrunedAt: at(10),
		Intents: make(map[state.IntentState]int, 4)}
	for i, st := range state.IntentStates {
		if n := num(firstCount + i); n != 0 {
			r.Intents[st] = int(n)
		}
	}
	r.Budget = budgetOf(str(budgetAt))
	return r, true
}

// budgetOf reads a row's budget field; one that cannot be read (written
// by a later layout) is no budget rather than no row.
func budgetOf(text string) state.Budget {
	if text == "" {
		return state.Budget{}
	}
	b, _ := state.ParseBudgetText(text)
	return b
}

// firstCount is where the counts start in rowFields, in the order of
// state.IntentStates.
const firstCount = 11

func init() {
	for i, st := range state.IntentStates {
		if rowFields[firstCount+i] != countField(st) {
			panic("redisstore: rowFields does not list the counts in the order of state.IntentStates")
		}
	}
	if rowFields[budgetAt] != budgetField {
		panic("redisstore: budgetAt is not the place of the budget in rowFields")
	}
}

// rowOf turns the values of an HMGET of rowFields into a row hash; nil
// for a run never seen.
func rowOf(vals []any) map[string]string {
	if len(vals) == 0 || vals[0] == nil {
		return nil
	}
	m := make(map[string]string, len(vals))
	for i, v := range vals {
		if s, ok := v.(string); ok {
			m[rowFields[i]] = s
		}
	}
	return m
}

// Get returns the row. One HMGET: a script writes the row's fields in one
// HSET, so a read sees one step's result or the next.
func (s *Store) Get(ctx context.Context, runID string) (state.Run, error) {
	if err := state.ValidateRunID(runID); err != nil {
		return state.Run{}, err
	}
	ctx, cancel := s.op(ctx)
	defer cancel()
	vals, err := s.rdb.HMGet(ctx, keysOf(runID).row, rowFields...).Result()
	if err != nil {
		return state.Run{}, s.fail("get", runID, err)
	}
	m := rowOf(vals)
	if m == nil {
		return state.Run{}, fmt.Errorf("%w: run %s", state.ErrNotFound, runID)
	}
	row := runOf(runID, m)
	if err := s.usageOfRuns(ctx, "get", []*state.Run{&row}); err != nil {
		return state.Run{}, err
	}
	return row, nil
}

// Intent returns one intent: its two fields in the run's hash, read in
// one HMGET with the row's layout mark (a run not yet moved to layout 2
// keeps its intents in a hash of their own).
func (s *Store) Intent(ctx context.Context, runID, key string) (state.Intent, error) {
	if err := state.ValidateRunID(runID); err != nil {
		return state.Intent{}, err
	}
	if err := state.ValidateKey(key); err != nil {
		return state.Intent{}, err
	}
	ctx, cancel := s.op(ctx)
	defer cancel()
	k := keysOf(runID)
	vals, err := s.rdb.HMGet(ctx, k.row, "status", "o", "i:"+key, "s:"+key).Result()
	if err != nil {
		return state.Intent{}, s.fail("intent", runID, err)
	}
	str := func(i int) (string, bool) { v, ok := vals[i].(string); return v, ok }
	notFound := fmt.Errorf("%w: intent %s of run %s", state.ErrNotFound, key, runID)
	if _, ok := str(0); !ok {
		return state.Intent{}, notFound
	}
	if _, ok := str(1); !ok {
		raw, err := s.rdb.HGet(ctx, k.legacy, key).Result()
		if errors.Is(err, redis.Nil) {
			return state.Intent{}, notFound
		}
		if err != nil {
			return state.Intent{}, s.fail("intent", runID, err)
		}
		in, _, err := decodeLegacy(runID, key, raw)
		return in, err
	}
	imm, ok1 := str(2)
	mut, ok2 := str(3)
	if !ok1 || !ok2 {
		return state.Intent{}, notFound
	}
	in, _, err := decodeIntent(runID, key, imm, mut)
	if err != nil {
		return state.Intent{}, fmt.Errorf("redis intent: %w", err)
	}
	return in, nil
}

// Intents returns the run's intents in creation order (each record's
// ordinal), read in one MULTI/EXEC so that the run's hash and a legacy
// intents hash agree.
func (s *Store) Intents(ctx context.Context, runID string) ([]state.Intent, error) {
	if err := state.ValidateRunID(runID); err != nil {
		return nil, err
	}
	ctx, cancel := s.op(ctx)
	defer cancel()
	k := keysOf(runID)
	var all, legacy *redis.MapStringStringCmd
	_, err := s.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		all = p.HGetAll(ctx, k.row)
		legacy = p.HGetAll(ctx, k.legacy)
		return nil
	})
	if err != nil {
		return nil, s.fail("intents", runID, err)
	}
	h := all.Val()
	if len(h) == 0 {
		return nil, fmt.Errorf("%w: run %s", state.ErrNotFound, runID)
	}
	type ordered struct {
		in  state.Intent
		ord int64
	}
	var recs []ordered
	for field, imm := range h {
		key, ok := strings.CutPrefix(field, "i:")
		if !ok {
			continue
		}
		mut, ok := h["s:"+key]
		if !ok {
			continue
		}
		in, ord, err := decodeIntent(runID, key, imm, mut)
		if err != nil {
			return nil, fmt.Errorf("redis intents: %w", err)
		}
		recs = append(recs, ordered{in, ord})
	}
	for key, raw := range legacy.Val() {
		in, ord, err := decodeLegacy(runID, key, raw)
		if err != nil {
			return nil, fmt.Errorf("redis intents: %w", err)
		}
		recs = append(recs, ordered{in, ord})
	}
	slices.SortFunc(recs, func(a, b ordered) int {
		if c := cmp.Compare(a.ord, b.ord); c != 0 {
			return c
		}
		return strings.Compare(a.in.Key, b.in.Key)
	})
	out := make([]state.Intent, len(recs))
	for i, r := range recs {
		out[i] = r.in
	}
	return out, nil
}

// Events returns the run's audit log (a stream) in commit order.
func (s *Store) Events(ctx context.Context, runID string) ([]state.Event, error) {
	if err := state.ValidateRunID(runID); err != nil {
		return nil, err
	}
	ctx, cancel := s.op(ctx)
	defer cancel()
	k := keysOf(runID)
	var exists *redis.IntCmd
	var entries *redis.Cmd
	_, err := s.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		exists = p.Exists(ctx, k.row)
		// Read raw, not with XRange: an entry holds a field e per event,
		// and a map of its fields would keep one.
		entries = p.Do(ctx, "XRANGE", k.events, "-", "+")
		return nil
	})
	if err != nil {
		return nil, s.fail("events", runID, err)
	}
	if exists.Val() == 0 {
		return nil, fmt.Errorf("%w: run %s", state.ErrNotFound, runID)
	}
	list, _ := entries.Val().([]any)
	out := make([]state.Event, 0, len(list))
	for _, x := range list {
		entry, ok := x.([]any)
		if !ok || len(entry) != 2 {
			return nil, fmt.Errorf("redis events run %s: an entry of the audit stream is %T, not [id fields]", runID, x)
		}
		id, _ := entry[0].(string)
		raw, _ := entry[1].([]any)
		fields := make([]string, len(raw))
		for i, f := range raw {
			fields[i], _ = f.(string)
		}
		out = append(out, eventsOf(runID, id, fields)...)
	}
	return out, nil
}

// Ping reports whether Redis answers within OpTimeout, and is
// state.ErrInconsistent while the store's marker says reset: an instance
// that admits nothing is not ready.
func (s *Store) Ping(ctx context.Context) error {
	ctx, cancel := s.op(ctx)
	defer cancel()
	if err := s.rdb.Ping(ctx).Err(); err != nil {
		return s.fail("ping", "", err)
	}
	return s.refuseWhileReset("ping", "")
}

// Close writes the outcomes queued by FinishLater (waiting at most
// OpTimeout), ends the cancel subscriptions and closes the client. Later
// calls return nil.
func (s *Store) Close() error {
	s.endLife()
	s.stopMarker()
	ctx, cancel := context.WithTimeout(context.Background(), s.opTimeout)
	s.batches.settle(ctx, s)
	cancel()
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	subs := s.subs
	s.subs = nil
	s.mu.Unlock()
	for ps := range subs {
		_ = ps.Close()
	}
	if err := s.rdb.Close(); err != nil {
		return fmt.Errorf("close redis client for %s: %w", s.addr, err)
	}
	return nil
}

// Cancels subscribes to the cancel channel and delivers run ids until ctx
// ends. go-redis reconnects the subscription after a network failure;
// messages published while it was down are lost, which is why callers also
// re-check rows periodically. A slow reader never holds up the store: when
// the buffer is full a notification is dropped and logged.
func (s *Store) Cancels(ctx context.Context) (<-chan string, error) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, fmt.Errorf("redis cancels on %s: %w: %w", s.addr, state.ErrUnavailable, redis.ErrClosed)
	}
	s.mu.Unlock()

	ps := s.rdb.Subscribe(ctx, cancelChannel)
	// Wait for the subscription to be confirmed, so a cancel committed after
	// Cancels returns is delivered.
	octx, cancel := s.op(ctx)
	_, err := ps.Receive(octx)
	cancel()
	if err != nil {
		_ = ps.Close()
		return nil, s.fail("subscribe", "", err)
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		_ = ps.Close()
		return nil, fmt.Errorf("redis cancels on %s: %w: %w", s.addr, state.ErrUnavailable, redis.ErrClosed)
	}
	s.subs[ps] = struct{}{}
	s.mu.Unlock()

	out := make(chan string, 256)
	msgs := ps.Channel()
	go func() {
		defer close(out)
		defer func() {
			s.mu.Lock()
			if s.subs != nil {
				delete(s.subs, ps)
			}
			s.mu.Unlock()
			_ = ps.Close()
		}()
		for {
			select {
			case <-ctx.Done():
				return
			case m, ok := <-msgs:
				if !ok {
					return
				}
				select {
				case out <- m.Payload:
				default:
					s.log.Warn("cancel notification dropped: the reader is behind; it will see the cancel at its next re-check", "run_id", m.Payload)
				}
			}
		}
	}()
	return out, nil
}

// validStatus accepts "" (all) or a known status.
func validStatus(st state.Status) error {
	if st == "" || slices.Contains(state.Statuses, st) {
		return nil
	}
	return fmt.Errorf("%w: unknown run status %q", state.ErrInvalid, st)
}
