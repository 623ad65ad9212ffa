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

	// known holds ids whose row this process has seen exist; see index.go.
	known knownRuns

	mu     sync.Mutex
	closed bool
	subs   map[*redis.PubSub]struct{}
}

var _ state.Store = (*Store)(nil)

// Open connects to the Redis the URL names and checks that it answers.
// URLs: redis://[[user]:pass@]host:port/DB, rediss://… (TLS),
// redis-sentinel://[[user]:pass@]host:port[,host:port…]/DB?master=NAME,
// redis-cluster://[[user]:pass@]host:port[,host:port…].
func Open(ctx context.Context, url string, opts Options) (*Store, error) {
	t, err := parseURL(url)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", state.ErrInvalid, err)
	}
	if opts.OpTimeout < 0 {
		return nil, fmt.Errorf("%w: op timeout %s is negative", state.ErrInvalid, opts.OpTimeout)
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
		addr:           Redact(url),
		subs:           map[*redis.PubSub]struct{}{},
	}
	s.rdb = newClient(t, opts.OpTimeout)
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
func newClient(t target, opTimeout time.Duration) redis.UniversalClient {
	switch t.kind {
	case "sentinel":
		return redis.NewFailoverClient(&redis.FailoverOptions{
			MasterName:            t.master,
			SentinelAddrs:         t.addrs,
			SentinelPassword:      t.sentinelPassword,
			Username:              t.username,
			Password:              t.password,
			DB:                    t.db,
			MaxRetries:            -1,
			DialTimeout:           opTimeout,
			ReadTimeout:           opTimeout,
			WriteTimeout:          opTimeout,
			PoolTimeout:           opTimeout,
			ContextTimeoutEnabled: true,
			DialerRetries:         dialAttempts,
			DialerRetryTimeout:    dialBackoff,
		})
	case "cluster":
		return redis.NewClusterClient(&redis.ClusterOptions{
			Addrs:                 t.addrs,
			Username:              t.username,
			Password:              t.password,
			MaxRetries:            -1,
			DialTimeout:           opTimeout,
			ReadTimeout:           opTimeout,
			WriteTimeout:          opTimeout,
			PoolTimeout:           opTimeout,
			ContextTimeoutEnabled: true,
			DialerRetries:         dialAttempts,
			DialerRetryTimeout:    dialBackoff,
		})
	default:
		opt := *t.node
		opt.MaxRetries = -1
		opt.DialTimeout = opTimeout
		opt.ReadTimeout = opTimeout
		opt.WriteTimeout = opTimeout
		opt.PoolTimeout = opTimeout
		opt.ContextTimeoutEnabled = true
		opt.DialerRetries = dialAttempts
		opt.DialerRetryTimeout = dialBackoff
		return redis.NewClient(&opt)
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

// reply is what every per-run script answers (lua/prelude.lua, reply): one
// RESP array, or for a step on the batch's common path one string
// (lua/batch.lua, parseCommon), so that neither side encodes or parses JSON
// on the hot path.
type reply struct {
	// result is ok, refused, conflict, notfound or late.
	result string
	// code is the refusal or conflict code, or what was not found.
	code    string
	changed bool
	// row is as much of the run's row as the step read (nil: none).
	row map[string]string
	// intent is the record the step wrote or found.
	intent *keyedRecord
	// admitted is set instead (its key not empty) for a guard on the
	// batch's common path: the key and time of the record it wrote, which
	// guardResult puts together from its request. A value, not a pointer:
	// every guard's answer holds one.
	admitted admission
	detail   string
	// more are further records (Renew: every lease renewed).
	more []keyedRecord
}

// keyedRecord is an intent as a script answers it: its key and its two
// stored fields.
type keyedRecord struct {
	key, imm, mut string
}

// admission is the answer of a guard on the batch's common path.
type admission struct {
	key string
	at  int64 // the step's time, Unix ms
}

func (k *keyedRecord) intent(runID string) (state.Intent, error) {
	in, _, err := decodeIntent(runID, k.key, k.imm, k.mut)
	return in, err
}

func parseReply(v any) (reply, error) {
	if common, ok := v.(string); ok {
		return parseCommon(common)
	}
	a, ok := v.([]any)
	str := func(x any) string { s, _ := x.(string); return s }
	if ok && len(a) == 2 && a[0] == "failed" {
		// The batch program's steps of this run failed (an error inside
		// them); the other runs' steps of the call are answered.
		msg, _ := a[1].(string)
		return reply{}, groupError(msg)
	}
	if !ok || len(a) < 6 {
		return reply{}, fmt.Errorf("the script answered %T, not its reply array", v)
	}
	r := reply{result: str(a[0]), code: str(a[1]), detail: str(a[5])}
	if n, _ := a[2].(int64); n == 1 {
		r.changed = true
	}
	if flat, ok := a[3].([]any); ok {
		r.row = make(map[string]string, len(flat)/2)
		for i := 0; i+1 < len(flat); i += 2 {
			r.row[str(flat[i])] = str(flat[i+1])
		}
	}
	keyed := func(x any) (keyedRecord, bool) {
		rec, ok := x.([]any)
		if !ok || len(rec) != 3 {
			return keyedRecord{}, false
		}
		return keyedRecord{key: str(rec[0]), imm: str(rec[1]), mut: str(rec[2])}, true
	}
	if k, ok := keyed(a[4]); ok {
		r.intent = &k
	}
	for _, x := range a[6:] {
		if k, ok := keyed(x); ok {
			r.more = append(r.more, k)
		}
	}
	return r, nil
}

// parseCommon reads the answer of a step on the batch's common path
// (lua/batch.lua): ok and changed, no code or detail, one string. A guard's
// is one line, "admitted status version key time" (the row's status and
// version, the step's time in Unix ms); an outcome's first line is
// "recorded key", then the record's two fields, i:KEY in four lines, then
// s:KEY; an outcome nobody waits for ('l') answers "recorded" alone.
func parseCommon(s string) (reply, error) {
	bad := func() (reply, error) {
		return reply{}, fmt.Errorf("the batch program answered %.80q, not a step's record", s)
	}
	if s == "recorded" {
		return reply{result: "ok", changed: true}, nil
	}
	var f [5]string
	if cut(s, ' ', f[:]) && f[0] == "admitted" {
		at, err := strconv.ParseInt(f[4], 10, 64)
		if err != nil || f[3] == "" {
			return bad()
		}
		return reply{result: "ok", changed: true, row: map[string]string{"status": f[1], "v": f[2]},
			admitted: admission{key: f[3], at: at}}, nil
	}
	head, rest, ok := strings.Cut(s, "\n")
	if !ok || !cut(head, ' ', f[:2]) || f[0] != "recorded" {
		return bad()
	}
	// i:KEY is its first four lines.
	end := -1
	for range 4 {
		i := strings.IndexByte(rest[end+1:], '\n')
		if i < 0 {
			return bad()
		}
		end += i + 1
	}
	return reply{result: "ok", changed: true, intent: &keyedRecord{key: f[1], imm: rest[:end], mut: rest[end+1:]}}, nil
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

// call runs one per-run script and reads its reply. The caller has bounded
// ctx by OpTimeout.
func (s *Store) call(ctx context.Context, op, runID string, p *program, args ...any) (reply, error) {
	v, err := s.exec(ctx, p, keysOf(runID).list(), args...).Result()
	if err != nil {
		return reply{}, s.fail(op, runID, err)
	}
	return s.decode(op, runID, v)
}

// decode reads a per-run program's reply.
func (s *Store) decode(op, runID string, v any) (reply, error) {
	r, err := parseReply(v)
	if err != nil {
		return reply{}, fmt.Errorf("redis %s run %s: %w", op, runID, err)
	}
	if r.row != nil {
		s.known.add(runID)
	}
	return r, nil
}

// failure is the error a script's reply stands for, or nil for ok and
// refused: a conflict, a run or intent not found.
func failure(runID, key string, r reply) error {
	switch r.result {
	case "ok", "refused":
		return nil
	case "notfound":
		if r.code == "intent" {
			return fmt.Errorf("%w: intent %s of run %s", state.ErrNotFound, key, runID)
		}
		return fmt.Errorf("%w: run %s", state.ErrNotFound, runID)
	case "conflict":
		c := &state.Conflict{Code: r.code, Run: runOf(runID, r.row), Detail: r.detail}
		if r.intent != nil {
			in, err := r.intent.intent(runID)
			if err != nil {
				return err
			}
			c.Intent = &in
		}
		return c
	}
	return fmt.Errorf("redis run %s: the script answered %q", runID, r.result)
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

// Admit creates the run ACTIVE at version 1, or returns an ACTIVE row as it is.
func (s *Store) Admit(ctx context.Context, req state.AdmitRequest) (state.AdmitResult, error) {
	if err := req.Validate(); err != nil {
		return state.AdmitResult{}, err
	}
	ctx, cancel := s.op(ctx)
	defer cancel()
	if err := s.index(ctx, "admit", req.RunID, indexCreate); err != nil {
		return state.AdmitResult{}, err
	}
	r, err := s.call(ctx, "admit", req.RunID, admitProgram, req.Actor, req.Reason)
	if err != nil {
		return state.AdmitResult{}, err
	}
	if err := failure(req.RunID, "", r); err != nil {
		return state.AdmitResult{}, err
	}
	return state.AdmitResult{Run: runOf(req.RunID, r.row), Created: r.changed}, nil
}

// Cancel is the compare-and-set ACTIVE → CANCELLING (or a tombstone for an
// unseen run); a changed row is announced on the cancel channel in the same
// step.
func (s *Store) Cancel(ctx context.Context, req state.CancelRequest) (state.CancelResult, error) {
	if err := req.Validate(); err != nil {
		return state.CancelResult{}, err
	}
	ctx, cancel := s.op(ctx)
	defer cancel()
	// A tombstone is a row, and a cancelled run drains: index it first.
	if err := s.index(ctx, "cancel", req.RunID, indexCancel); err != nil {
		return state.CancelResult{}, err
	}
	var r reply
	var err error
	if s.cancelReplicas > 0 {
		r, err = s.cancelReplicated(ctx, req)
	} else {
		r, err = s.call(ctx, "cancel", req.RunID, cancelProgram, req.Actor, req.Reason, ms(req.DrainTimeout), cancelChannel, req.RunID, "0")
	}
	if err != nil {
		return state.CancelResult{}, err
	}
	if err := failure(req.RunID, "", r); err != nil {
		return state.CancelResult{}, err
	}
	res := state.CancelResult{Run: runOf(req.RunID, r.row), Changed: r.changed}
	if res.Run.Final() {
		// Nothing to drain (a run never admitted, or with nothing in
		// flight): its draining entry would only be read and dropped
		// by every instance's next sweep.
		s.dropFinal(ctx, req.RunID)
	}
	return res, nil
}

// cancelReplicated runs the cancel script, then WAIT, on one connection to
// the run's primary: WAIT counts the replicas that have the last write of
// its own connection. Neither is retried (MaxRetries -1 on every node
// client).
func (s *Store) cancelReplicated(ctx context.Context, req state.CancelRequest) (reply, error) {
	k := keysOf(req.RunID)
	node, err := s.primary(ctx, k.row)
	if err != nil {
		return reply{}, s.fail("cancel", req.RunID, err)
	}
	conn := node.Conn()
	defer conn.Close()
	v, err := s.execOn(ctx, conn, cancelProgram, k.list(), req.Actor, req.Reason, ms(req.DrainTimeout), cancelChannel, req.RunID, "1").Result()
	if err != nil {
		return reply{}, s.fail("cancel", req.RunID, err)
	}
	r, err := s.decode("cancel", req.RunID, v)
	if err != nil || r.result != "ok" {
		return r, err
	}
	// WAIT must answer before the operation's deadline, or its answer is lost.
	wait := time.Second
	if dl, ok := ctx.Deadline(); ok {
		wait = time.Until(dl) * 4 / 5
	}
	wait = max(wait, time.Millisecond)
	got, err := conn.Do(ctx, "WAIT", s.cancelReplicas, ms(wait)).Int()
	if err != nil {
		err = s.fail("cancel wait", req.RunID, err)
		return reply{}, fmt.Errorf("%w (the cancel ran on the primary; cancel again to confirm it reached %d replicas)", err, s.cancelReplicas)
	}
	if got < s.cancelReplicas {
		return reply{}, fmt.Errorf("redis cancel run %s on %s: %w: only %d of %d replicas confirmed the cancel within %s; "+
			"it is committed on the primary, which refuses the run's effects, but a failover now could lose it: cancel again to confirm",
			req.RunID, s.addr, state.ErrUnavailable, got, s.cancelReplicas, wait.Round(time.Millisecond))
	}
	return r, nil
}

// primary is the client of the node that holds key's slot: the cluster's
// master for it, or the one server (Sentinel's current master).
func (s *Store) primary(ctx context.Context, key string) (*redis.Client, error) {
	switch c := s.rdb.(type) {
	case *redis.ClusterClient:
		return c.MasterForKey(ctx, key)
	case *redis.Client:
		return c, nil
	default:
		return nil, fmt.Errorf("no primary for a %T", s.rdb)
	}
}

// Complete moves ACTIVE → COMPLETED at the observed version.
func (s *Store) Complete(ctx context.Context, req state.CompleteRequest) (state.Run, error) {
	if err := req.Validate(); err != nil {
		return state.Run{}, err
	}
	ctx, cancel := s.op(ctx)
	defer cancel()
	if err := s.index(ctx, "complete", req.RunID, indexEnd); err != nil {
		return state.Run{}, err
	}
	r, err := s.call(ctx, "complete", req.RunID, completeProgram, req.Actor, req.Reason, req.Version)
	if err != nil {
		return state.Run{}, err
	}
	if err := failure(req.RunID, "", r); err != nil {
		return state.Run{}, err
	}
	return runOf(req.RunID, r.row), nil
}

// Guard is the one atomic check-and-record of an effect. An admitted
// guard's Run carries the row's status and version only (the script reads
// no more of it); a refusal carries the whole row.
func (s *Store) Guard(ctx context.Context, req state.GuardRequest) (state.GuardResult, error) {
	if err := req.Validate(); err != nil {
		return state.GuardResult{}, err
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	req = req.Fenced(ctx)
	// Only an auto-admitting guard can create the row; once this process
	// has seen the row, its index entry exists and the extra round trip is
	// skipped (the hot path).
	if req.AutoAdmit && !s.known.has(req.RunID) {
		if err := s.index(ctx, "guard", req.RunID, indexCreate); err != nil {
			return state.GuardResult{}, err
		}
	}
	r, err := s.batches.do(ctx, s, req.RunID, "guard", 'g', guardArgs(req))
	if err != nil {
		return state.GuardResult{}, err
	}
	return s.guardResult(ctx, req, r)
}

// stepArgs are one step's arguments for the batch program: its own, and
// its texts, which a call sends once for every step that shares them
// (batchCall).
type stepArgs struct {
	own   []any
	texts stepTexts
}

// stepTexts are what the steps of an instance mostly share: the actor and,
// for a guard, its lease's owner and TTL (ms).
type stepTexts struct {
	actor, owner string
	ttl          int64
}

// guardFlags is a guard's flags argument, three characters 1/0: explicit
// key, auto-admit, allow cancelling. Each is a constant, so that sending it
// makes no string and boxes none.
func guardFlags(req state.GuardRequest) any {
	switch e, a, c := req.ExplicitKey, req.AutoAdmit, req.AllowCancelling; {
	case !e && !a && !c:
		return "000"
	case !e && !a && c:
		return "001"
	case !e && a && !c:
		return "010"
	case !e && a && c:
		return "011"
	case e && !a && !c:
		return "100"
	case e && !a && c:
		return "101"
	case e && a && !c:
		return "110"
	}
	return "111"
}

// boundaryArg is a guard's boundary as an argument: a constant for every
// boundary stopgate names, boxed once by the compiler, not per guard.
func boundaryArg(b state.Boundary) any {
	switch b {
	case state.BoundaryHTTP:
		return string(state.BoundaryHTTP)
	case state.BoundaryTunnel:
		return string(state.BoundaryTunnel)
	case state.BoundaryClaim:
		return string(state.BoundaryClaim)
	case state.BoundaryRetry:
		return string(state.BoundaryRetry)
	case state.BoundaryBrowser:
		return string(state.BoundaryBrowser)
	case state.BoundaryDelivery:
		return string(state.BoundaryDelivery)
	case state.BoundaryCustom:
		return string(state.BoundaryCustom)
	}
	return string(b)
}

func guardArgs(req state.GuardRequest) stepArgs {
	notBefore := ""
	if !req.NotBefore.IsZero() {
		notBefore = strconv.FormatInt(req.NotBefore.UnixMilli(), 10)
	}
	// An int64 goes out as its decimal text, as the string would, without
	// the string.
	var notAfter any = ""
	if !req.NotAfter.IsZero() {
		notAfter = req.NotAfter.UnixMilli()
	}
	return stepArgs{
		own: []any{req.ObservedVersion, req.Key, guardFlags(req), boundaryArg(req.Boundary),
			escape(req.Method) + "\n" + escape(req.Target) + "\n" + escape(req.BodyDigest), notBefore, notAfter, req.Refuse},
		texts: stepTexts{actor: req.Actor, owner: req.LeaseOwner, ttl: ms(req.LeaseTTL)},
	}
}

func (s *Store) guardResult(ctx context.Context, req state.GuardRequest, r reply) (state.GuardResult, error) {
	switch r.result {
	case "late":
		return state.GuardResult{}, fmt.Errorf("redis guard run %s on %s: %w: Redis ran the guard after its deadline %s (by the server's clock); nothing was recorded",
			req.RunID, s.addr, state.ErrUnavailable, req.NotAfter.UTC().Format(time.RFC3339Nano))
	case "ok", "refused":
	default:
		return state.GuardResult{}, fmt.Errorf("redis guard run %s: the script answered %q", req.RunID, r.result)
	}
	res := state.GuardResult{Admitted: r.result == "ok", Refusal: r.code, Run: state.Run{ID: req.RunID}}
	if r.row != nil {
		res.Run = runOf(req.RunID, r.row)
	}
	switch {
	case r.admitted.key != "":
		res.Intent = admittedIntent(req, r.admitted.key, r.admitted.at)
	case r.intent != nil:
		in, err := r.intent.intent(req.RunID)
		if err != nil {
			return state.GuardResult{}, err
		}
		res.Intent = in
	}
	if !res.Admitted && res.Run.Final() && !res.Run.PrunedAt.IsZero() {
		// A refusal recorded against a pruned run: retention must find
		// the run again. The record is written already; if this step
		// fails it stays until the next refusal puts the entry back.
		if err := s.index(ctx, "guard", req.RunID, indexEnd); err != nil {
			s.log.Warn("a refusal of a pruned run is not in the retention index", "run_id", req.RunID, "err", err)
		}
	}
	return res, nil
}

// Finish records the outcome of an IN_FLIGHT intent, then finalizes the run.
func (s *Store) Finish(ctx context.Context, req state.FinishRequest) (state.Intent, error) {
	if err := req.Validate(); err != nil {
		return state.Intent{}, err
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	r, err := s.batches.do(ctx, s, req.RunID, "finish", 'f', finishArgs(req))
	if err != nil {
		return state.Intent{}, err
	}
	return finishResult(req, r)
}

// FinishLater queues the outcome in the batcher without leading a call:
// it goes with the next guard or outcome of its lane, or on its own after
// Options.OutcomeDelay. The call that carries it is bounded by OpTimeout,
// as every call is; ctx only withdraws it if it ends before then. Its step
// ('l') is answered without the record, which nobody reads.
func (s *Store) FinishLater(ctx context.Context, req state.FinishRequest, done func(error)) {
	if err := req.Validate(); err != nil {
		done(err)
		return
	}
	s.batches.doLater(ctx, s, req.RunID, "finish", 'l', finishArgs(req), func(r reply, err error) {
		if err == nil {
			err = failure(req.RunID, req.Key, r)
		}
		done(err)
	})
}

func finishArgs(req state.FinishRequest) stepArgs {
	return stepArgs{
		own:   []any{req.Key, req.Attempt, string(req.Outcome), req.StatusCode, req.Reason, req.Source},
		texts: stepTexts{actor: req.Actor},
	}
}

func finishResult(req state.FinishRequest, r reply) (state.Intent, error) {
	if err := failure(req.RunID, req.Key, r); err != nil {
		return state.Intent{}, err
	}
	if r.intent == nil {
		return state.Intent{}, fmt.Errorf("redis finish run %s: the script answered no intent", req.RunID)
	}
	return r.intent.intent(req.RunID)
}

// Note appends one event about an intent and changes nothing else.
func (s *Store) Note(ctx context.Context, req state.NoteRequest) error {
	if err := req.Validate(); err != nil {
		return err
	}
	ctx, cancel := s.op(ctx)
	defer cancel()
	r, err := s.call(ctx, "note", req.RunID, noteProgram, req.Actor, req.Key, req.Kind, req.Reason)
	if err != nil {
		return err
	}
	return failure(req.RunID, req.Key, r)
}

// Resolve reconciles an UNKNOWN intent, then finalizes the run.
func (s *Store) Resolve(ctx context.Context, req state.ResolveRequest) (state.Intent, error) {
	if err := req.Validate(); err != nil {
		return state.Intent{}, err
	}
	ctx, cancel := s.op(ctx)
	defer cancel()
	r, err := s.call(ctx, "resolve", req.RunID, resolveProgram,
		req.Actor, req.Key, flag(req.Applied), req.Source, req.Note)
	if err != nil {
		return state.Intent{}, err
	}
	if err := failure(req.RunID, req.Key, r); err != nil {
		return state.Intent{}, err
	}
	return r.intent.intent(req.RunID)
}

// Renew extends the owner's leases: one script per run named in refs.
func (s *Store) Renew(ctx context.Context, req state.RenewRequest) (state.RenewResult, error) {
	if err := req.Validate(); err != nil {
		return state.RenewResult{}, err
	}
	byRun := map[string][]any{}
	var runs []string
	for _, ref := range req.Refs {
		if _, ok := byRun[ref.RunID]; !ok {
			runs = append(runs, ref.RunID)
		}
		byRun[ref.RunID] = append(byRun[ref.RunID], ref.Key)
	}
	ctx, cancel := s.op(ctx)
	defer cancel()
	out := state.RenewResult{Runs: map[string]state.Run{}}
	for _, id := range runs {
		args := append([]any{req.Owner, ms(req.TTL)}, byRun[id]...)
		r, err := s.call(ctx, "renew", id, renewProgram, args...)
		if err != nil {
			return state.RenewResult{}, err
		}
		if r.row != nil {
			out.Runs[id] = runOf(id, r.row)
		}
		for _, k := range r.more {
			in, err := k.intent(id)
			if err != nil {
				return state.RenewResult{}, err
			}
			out.Renewed = append(out.Renewed, in)
		}
	}
	return out, nil
}

// Tick expires leases and moves a cancelled run on.
func (s *Store) Tick(ctx context.Context, req state.TickRequest) (state.Run, error) {
	if err := req.Validate(); err != nil {
		return state.Run{}, err
	}
	ctx, cancel := s.op(ctx)
	defer cancel()
	r, err := s.call(ctx, "tick", req.RunID, tickProgram, req.Actor)
	if err != nil {
		return state.Run{}, err
	}
	if err := failure(req.RunID, "", r); err != nil {
		return state.Run{}, err
	}
	return runOf(req.RunID, r.row), nil
}

// rowFields are the row's own fields in the run's hash (lua/prelude.lua,
// ROW); the rest of the hash holds its intents.
var rowFields = []string{"status", "v", "reason", "status_reason", "created", "updated", "cancelled", "drain", "t",
	"o", "pruned", "n:IN_FLIGHT", "n:SCHEDULED", "n:RESPONDED", "n:NOT_SENT", "n:UNKNOWN",
	"n:CANCELLED_BEFORE_DISPATCH", "n:REVOKED", "n:APPLIED", "n:NOT_APPLIED"}

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
	return runOf(runID, m), nil
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

// Ping reports whether Redis answers within OpTimeout.
func (s *Store) Ping(ctx context.Context) error {
	ctx, cancel := s.op(ctx)
	defer cancel()
	if err := s.rdb.Ping(ctx).Err(); err != nil {
		return s.fail("ping", "", err)
	}
	return nil
}

// Close writes the outcomes queued by FinishLater (waiting at most
// OpTimeout), ends the cancel subscriptions and closes the client. Later
// calls return nil.
func (s *Store) Close() error {
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
