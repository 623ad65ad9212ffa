package evidence_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/chromedp"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/control/client"
	"github.com/stopgate/stopgate/internal/evidence"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/state"
)

// binary is the stopgate built once by TestMain.
var binary string

func TestMain(m *testing.M) {
	os.Exit(testkit.MainWithStopgate(m, "../..", &binary))
}

// rounds is how many times each case repeats: STOPGATE_EVIDENCE_RUNS, 2 by
// default (make test); make evidence asks for many more.
func rounds(t *testing.T) int {
	v := os.Getenv("STOPGATE_EVIDENCE_RUNS")
	if v == "" {
		return 2
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		t.Fatalf("STOPGATE_EVIDENCE_RUNS=%q: want a whole number of 1 or more", v)
	}
	return n
}

// faultCase is one injected failure.
type faultCase struct {
	name     string
	failure  string
	recovery string
	// todo, when set, says why the case is not written yet: it is printed
	// in the table as NOT RUN and the test is skipped, never passed.
	todo string
	// run appends each round to out as it ends, so that a case stopped by
	// a fatal error still shows the rounds it ran.
	run func(t *testing.T, n int, out *[]evidence.Round)
}

// TestEvidence runs every fault case, fills the table and prints it (and
// writes it to STOPGATE_EVIDENCE_TABLE when set). Each case fails on any
// round with something leaked, lost or unexplained, or with an expectation
// of the case that did not hold.
func TestEvidence(t *testing.T) {
	cases := []faultCase{
		{"KillMidPost", "stopgate killed -9 mid-POST; same Idempotency-Key retried on another instance", "kill -9 → the orphaned intent is UNKNOWN (lease expiry)", "", caseKillMidPost},
		{"RedisKilledAfterCancel", "redis-server killed -9 right after an acknowledged cancel; restarted from its AOF", "redis restarted → both instances forward requests again", "", caseRedisKilledAfterCancel},
		{"RedisPaused", "redis-server paused (SIGSTOP) during a burst, then resumed", "SIGCONT → first request forwarded again", "", caseRedisPaused},
		{"LostReplies", "replies lost on the wire after Redis ran the guard and the cancel scripts", "lost guard reply → its intent is UNKNOWN (lease expiry)", "", caseLostReplies},
		{"PubSubSilent", "pub/sub connection silent: the cancel message never arrives", "cancel acknowledged → open tunnel and stream cut (re-check, 500ms interval)", "", casePubSubSilent},
		{"ThreeInstances", "three instances on one Redis: cancel through one, traffic through the others", "cancel acknowledged → stream on another instance cut", "", caseThreeInstances},
		{"BrowserActionInFlight", "a browser action in flight when the cancel lands", "cancel acknowledged → next CDP action refused", "", caseBrowserActionInFlight},
		{"TransparentInFlight", "transparent-mode connections in flight when the cancel lands", "cancel acknowledged → the redirected uid's stream and TLS connection cut", "", caseTransparentInFlight},
		{"DiskFull", "disk full under the embedded store", "space freed → first request forwarded again", "", caseDiskFull},
		{"KillMidCommit", "stopgate killed -9 mid-commit on the embedded store; the file reopened", "kill -9 → restarted instance answers", "", caseKillMidCommit},
		{"BudgetBurst", "a burst of concurrent requests across three instances against a budget of N effects", "the budget's cancel → stream on another instance cut", "", caseBudgetBurst},
	}
	n := rounds(t)
	table := &evidence.Table{}
	t.Cleanup(func() { report(t, table) })
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Log(c.failure)
			if c.todo != "" {
				table.Add(evidence.Row{Failure: c.failure, Skipped: c.todo})
				t.Skip(c.todo)
			}
			var rs []evidence.Round
			var skip string
			finished := false
			defer func() {
				if skip != "" {
					return
				}
				table.Add(evidence.Row{Failure: c.failure, Recovery: c.recovery, Rounds: rs, Stopped: !finished})
				for i, r := range rs {
					for _, p := range r.Problems {
						t.Errorf("round %d: %s", i, p)
					}
				}
			}()
			func() {
				defer func() {
					if v := recover(); v != nil {
						s, ok := v.(skipCase)
						if !ok {
							panic(v)
						}
						skip = string(s)
					}
				}()
				c.run(t, n, &rs)
			}()
			if skip != "" {
				table.Add(evidence.Row{Failure: c.failure, Skipped: skip})
				t.Skip(skip)
			}
			finished = true
		})
	}
}

// skipCase is raised (as a panic caught by TestEvidence) by a case that
// cannot run on this machine; the table says so.
type skipCase string

func report(t *testing.T, table *evidence.Table) {
	out := table.String()
	t.Logf("the evidence:\n%s", out)
	if path := os.Getenv("STOPGATE_EVIDENCE_TABLE"); path != "" {
		if err := os.WriteFile(path, []byte(out), 0o644); err != nil {
			t.Errorf("writing the table to %s: %v", path, err)
		}
	}
}

func tctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	return c
}

// attempts is a goroutine-safe list of what clients saw.
type attempts struct {
	mu sync.Mutex
	as []evidence.Attempt
}

func (l *attempts) add(a evidence.Attempt) evidence.Attempt {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.as = append(l.as, a)
	return a
}

func (l *attempts) all() []evidence.Attempt {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]evidence.Attempt(nil), l.as...)
}

// hitsOf is the upstream's count of the keys of the given runs (keys are
// RUN-...).
func hitsOf(up *evidence.Upstream, runs ...string) map[string]int {
	out := map[string]int{}
	for k, n := range up.AllHits() {
		for _, run := range runs {
			if strings.HasPrefix(k, run+"-") {
				out[k] = n
			}
		}
	}
	return out
}

// operator calls the control API as an operator would: a 503 (the store
// did not answer in time, nothing was acknowledged) is tried again, for at
// most 15s; anything else ends the test.
func operator[T any](t *testing.T, what string, call func() (T, error)) T {
	t.Helper()
	var v T
	var err error
	eventually(15*time.Second, func() bool {
		v, err = call()
		var apiErr *client.APIError
		return err == nil || !errors.As(err, &apiErr) || apiErr.StatusCode != 503
	})
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	return v
}

func admit(t *testing.T, sg *evidence.Stopgate, run string) {
	t.Helper()
	operator(t, "admit "+run, func() (client.Reply[state.Run], error) { return sg.API().Admit(tctx(t), run) })
}

// cancelRun cancels through sg with a drain of 30s and returns when the
// cancel was acknowledged.
func cancelRun(t *testing.T, sg *evidence.Stopgate, run, reason string) (time.Time, control.CancelResponse) {
	t.Helper()
	return cancelDrain(t, sg, run, reason, 30*time.Second)
}

// cancelDrain is cancelRun with the drain deadline given.
func cancelDrain(t *testing.T, sg *evidence.Stopgate, run, reason string, drain time.Duration) (time.Time, control.CancelResponse) {
	t.Helper()
	res := operator(t, "cancel "+run, func() (client.Reply[control.CancelResponse], error) {
		return sg.API().Cancel(tctx(t), run, client.CancelOptions{Reason: reason, Drain: &drain})
	})
	return time.Now(), res.Value
}

func audit(t *testing.T, sg *evidence.Stopgate, run string) control.Audit {
	t.Helper()
	return operator(t, "audit "+run, func() (control.Audit, error) { return sg.Audit(tctx(t), run) })
}

// past503 posts fresh keys of run through sg (keys RUN-tag-N) until the
// answer is something other than 503 store_unavailable, or d passes, and
// returns the last answer. Every attempt is logged and judged like any
// other: an instance that is reconnecting to its store fails closed.
func past503(ctx context.Context, sg *evidence.Stopgate, up *evidence.Upstream, log *attempts, run, tag string, d time.Duration) evidence.Attempt {
	var at evidence.Attempt
	k := 0
	eventually(d, func() bool {
		k++
		at = log.add(sg.Post(ctx, up, "e", run, fmt.Sprintf("%s-%s-%d", run, tag, k)))
		return at.Code != "store_unavailable"
	})
	return at
}

// samePast503 posts key of run through sg, and again under the same key
// while the answer is 503 store_unavailable (an instance slow to reach its
// store fails closed; a worker retries), for at most 10s. Every attempt is
// logged; the last is returned.
func samePast503(ctx context.Context, sg *evidence.Stopgate, up *evidence.Upstream, log *attempts, run, key string) evidence.Attempt {
	var at evidence.Attempt
	eventually(10*time.Second, func() bool {
		at = log.add(sg.Post(ctx, up, "e", run, key))
		return at.Code != "store_unavailable"
	})
	return at
}

// retry503 calls open again while it fails with a 503 (an instance
// reconnecting to its store fails closed), for at most 10s.
func retry503(open func() error) {
	eventually(10*time.Second, func() bool {
		err := open()
		return err == nil || !strings.Contains(err.Error(), "503")
	})
}

// eventually polls cond until it holds or d passes, and says how long it took.
func eventually(d time.Duration, cond func() bool) (time.Duration, bool) {
	start := time.Now()
	for {
		if cond() {
			return time.Since(start), true
		}
		if time.Since(start) > d {
			return time.Since(start), false
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// settle waits until the run's record holds no intent IN_FLIGHT (leases of
// dead carriers expire into UNKNOWN; finished requests are recorded) and a
// cancelled run has moved on from CANCELLING, then returns the record as
// two reads in a row agree on it (the audit is read in several steps).
func settle(t *testing.T, sg *evidence.Stopgate, run string, within time.Duration) control.Audit {
	t.Helper()
	var a control.Audit
	eventually(within, func() bool {
		a = audit(t, sg, run)
		if a.Run.Intents[state.IntentInFlight] > 0 || a.Run.Status == state.StatusCancelling {
			return false
		}
		b := audit(t, sg, run)
		same := b.Run.Status == a.Run.Status && len(b.Events) == len(a.Events)
		a = b
		return same
	})
	return a
}

// reconcile settles the run, then resolves each UNKNOWN intent from the
// upstream's count, as a provider lookup would (applied when the upstream
// saw the key), and returns the record once settled again.
func reconcile(t *testing.T, sg *evidence.Stopgate, up *evidence.Upstream, run string, r *evidence.Round) control.Audit {
	t.Helper()
	return reconcileBy(t, sg, run, r, func(in state.Intent) int { return up.Hits(in.Key) })
}

// reconcileBy is reconcile with the provider's count of each intent's
// effect given by count: an effect that the provider cannot count under the
// intent's own key (a browser action, whose effect is the page's request; a
// tunnel, whose requests stopgate never saw) is counted where it landed.
func reconcileBy(t *testing.T, sg *evidence.Stopgate, run string, r *evidence.Round, count func(state.Intent) int) control.Audit {
	t.Helper()
	a := settle(t, sg, run, 5*time.Second)
	for _, in := range a.Intents {
		if in.State != state.IntentUnknown {
			continue
		}
		outcome, hits := "not_applied", count(in)
		if hits > 0 {
			outcome = "applied"
		}
		req := control.ResolveRequest{Outcome: outcome, Source: "operator", Note: fmt.Sprintf("the provider counted it %d time(s)", hits)}
		operator(t, "resolve "+run+"/"+in.Key, func() (client.Reply[state.Intent], error) { return sg.API().Resolve(tctx(t), run, in.Key, req) })
		r.Reconciled++
	}
	return settle(t, sg, run, 5*time.Second)
}

// judge applies the three checks to one round's runs.
func judge(r *evidence.Round, as []evidence.Attempt, hits map[string]int, cancelled map[string]time.Time, reasons map[string]string, audits map[string]control.Audit) {
	r.Requests = len(as)
	evidence.CountLeaks(r, as, hits, cancelled, audits)
	refused := evidence.RefusedKeys(as)
	for run, a := range audits {
		if reason, ok := reasons[run]; ok {
			evidence.CheckCancelKept(r, a, reason)
		}
		evidence.Explain(r, a, refused)
	}
}

// judgeRun is judge for a round of the one run cancelled at ack.
func judgeRun(r *evidence.Round, log *attempts, up *evidence.Upstream, run string, ack time.Time, reason string, final control.Audit) {
	judge(r, log.all(), hitsOf(up, run), map[string]time.Time{run: ack}, map[string]string{run: reason}, map[string]control.Audit{run: final})
}

// expect records a broken expectation of the case: it fails the test, and
// the table's columns do not count it.
func expect(r *evidence.Round, ok bool, format string, args ...any) {
	if !ok {
		r.Problems = append(r.Problems, "expected: "+fmt.Sprintf(format, args...))
	}
}

const storeFlags = "--store-timeout=500ms --lease-ttl=1500ms --sweep-interval=100ms --recheck-interval=500ms"

func flags(extra ...string) []string {
	return append(strings.Fields(storeFlags), extra...)
}

// startOn starts an instance on the store at url, with the suite's flags.
func startOn(t *testing.T, url string) *evidence.Stopgate {
	return evidence.Start(t, binary, evidence.Config{Store: url, Flags: flags()})
}

// startInstances starts k instances sharing the store at url.
func startInstances(t *testing.T, url string, k int) []*evidence.Stopgate {
	sgs := make([]*evidence.Stopgate, k)
	for i := range sgs {
		sgs[i] = startOn(t, url)
	}
	return sgs
}

func caseKillMidPost(t *testing.T, n int, out *[]evidence.Round) {
	redis := startRedis(t, false)
	a := startOn(t, redis.URL())
	b := startOn(t, redis.URL())
	up := evidence.StartUpstream(t)
	for i := range n {
		var r evidence.Round
		ctx := tctx(t)
		run, reason := fmt.Sprintf("kill9-%d", i), "operator stop after a crash"
		key := run + "-charge"
		var log attempts
		admit(t, b, run)
		first := make(chan evidence.Attempt, 1)
		go func() { first <- a.Post(ctx, up, "slow", run, key) }()
		select {
		case <-up.Arrived(key):
		case <-time.After(10 * time.Second):
			t.Fatal("the slow POST never reached the upstream")
		}
		a.Kill9()
		killed := time.Now()
		log.add(<-first)
		retry := samePast503(ctx, b, up, &log, run, key)
		expect(&r, retry.Code == state.RefusalInProgress, "the retry on the other instance is refused intent_in_progress, got %d %s", retry.Status, retry.Code)
		ack, _ := cancelRun(t, b, run, reason)
		log.add(b.Post(ctx, up, "e", run, key))
		log.add(b.Post(ctx, up, "e", run, run+"-after"))
		_, ok := eventually(10*time.Second, func() bool {
			in, err := b.API().Intent(ctx, run, key)
			return err == nil && in.Value.State == state.IntentUnknown
		})
		expect(&r, ok, "the dead instance's intent turns UNKNOWN")
		r.Recover = time.Since(killed)
		log.add(b.Post(ctx, up, "e", run, key))
		operator(t, "resolve", func() (client.Reply[state.Intent], error) {
			return b.API().Resolve(ctx, run, key, control.ResolveRequest{Outcome: "applied", Source: "operator", Note: "the provider counted it once"})
		})
		r.Reconciled++
		log.add(b.Post(ctx, up, "e", run, key))
		expect(&r, up.Hits(key) == 1, "the key reached the upstream once, got %d", up.Hits(key))
		final := settle(t, b, run, 5*time.Second)
		expect(&r, final.Run.Status == state.StatusCancelled, "the run is CANCELLED once its unknown is reconciled, got %s", final.Run.Status)
		judgeRun(&r, &log, up, run, ack, reason, final)
		*out = append(*out, r)
		a.Restart()
	}
}

func caseRedisKilledAfterCancel(t *testing.T, n int, out *[]evidence.Round) {
	redis := startRedis(t, true)
	a := startOn(t, redis.URL())
	b := startOn(t, redis.URL())
	up := evidence.StartUpstream(t)
	for i := range n {
		var r evidence.Round
		ctx := tctx(t)
		victim, bystander, reason := fmt.Sprintf("rk-v%d", i), fmt.Sprintf("rk-b%d", i), "stop, then redis dies"
		var log attempts
		admit(t, a, victim)
		admit(t, a, bystander)
		log.add(a.Post(ctx, up, "e", victim, victim+"-0"))
		log.add(b.Post(ctx, up, "e", bystander, bystander+"-0"))
		ack, _ := cancelRun(t, a, victim, reason)
		redis.Kill()
		for j, sg := range []*evidence.Stopgate{a, b, a, b} {
			run := []string{victim, bystander}[j/2]
			at := log.add(sg.Post(ctx, up, "e", run, fmt.Sprintf("%s-down%d", run, j)))
			expect(&r, at.Code == "store_unavailable", "with redis down: 503 store_unavailable, got %d %s", at.Status, at.Code)
		}
		redis.Restart()
		restarted := time.Now()
		// Each instance recovers on its own: until it has a live connection
		// again, it answers 503 (fail closed). The victim is refused 409 by
		// both once they answer at all.
		for _, sg := range []*evidence.Stopgate{a, b} {
			at := past503(ctx, sg, up, &log, bystander, "up-"+sg.Proxy, 15*time.Second)
			expect(&r, at.Status == 200, "the bystander's requests are forwarded again after the restart, got %d %s", at.Status, at.Code)
		}
		r.Recover = time.Since(restarted)
		for _, sg := range []*evidence.Stopgate{a, b} {
			at := past503(ctx, sg, up, &log, victim, "late-"+sg.Proxy, 5*time.Second)
			expect(&r, at.Code == state.RefusalRunNotActive, "the victim after the restart: 409 run_not_active, got %d %s", at.Status, at.Code)
		}
		audits := map[string]control.Audit{victim: settle(t, a, victim, 5*time.Second), bystander: settle(t, a, bystander, 5*time.Second)}
		judge(&r, log.all(), hitsOf(up, victim, bystander), map[string]time.Time{victim: ack}, map[string]string{victim: reason}, audits)
		*out = append(*out, r)
	}
}

func caseRedisPaused(t *testing.T, n int, out *[]evidence.Round) {
	redis := startRedis(t, false)
	a := startOn(t, redis.URL())
	up := evidence.StartUpstream(t)
	for i := range n {
		var r evidence.Round
		ctx := tctx(t)
		run, reason := fmt.Sprintf("pause-%d", i), "stop after the pause"
		var log attempts
		admit(t, a, run)
		var stop sync.WaitGroup
		done := make(chan struct{})
		var paused, resumed time.Time
		var mu sync.Mutex
		for w := range 4 {
			stop.Go(func() {
				for j := 0; ; j++ {
					select {
					case <-done:
						return
					default:
					}
					log.add(a.Post(ctx, up, "e", run, fmt.Sprintf("%s-w%d-%d", run, w, j)))
				}
			})
		}
		time.Sleep(200 * time.Millisecond)
		redis.Pause()
		mu.Lock()
		paused = time.Now()
		mu.Unlock()
		time.Sleep(time.Second)
		// Read before the resume, as paused was read after the pause: on a
		// loaded machine this goroutine may wait long between the two.
		mu.Lock()
		resumed = time.Now()
		mu.Unlock()
		redis.Resume()
		took, ok := eventually(10*time.Second, func() bool {
			for _, at := range log.all() {
				if at.Status == 200 && at.Started.After(resumed) {
					return true
				}
			}
			return false
		})
		expect(&r, ok, "requests are forwarded again after the resume")
		r.Recover = took
		time.Sleep(100 * time.Millisecond)
		close(done)
		stop.Wait()
		for _, at := range log.all() {
			// Started once the pause was surely felt, answered before the resume.
			if at.Started.After(paused.Add(50*time.Millisecond)) && at.Ended.Before(resumed) {
				expect(&r, at.Code == "store_unavailable", "a request during the pause gets 503 store_unavailable, got %d %s", at.Status, at.Code)
			}
		}
		ack, _ := cancelRun(t, a, run, reason)
		after := samePast503(ctx, a, up, &log, run, run+"-after")
		expect(&r, after.Code == state.RefusalRunNotActive, "after the cancel: 409, got %d %s", after.Status, after.Code)
		// A guard whose reply was held in the paused server's buffer ran in
		// time, but its caller had answered 503: its lease expires into
		// UNKNOWN, reconciled here. A guard that ran after its caller gave
		// up would be a late record, which Explain counts.
		final := reconcile(t, a, up, run, &r)
		judgeRun(&r, &log, up, run, ack, reason, final)
		*out = append(*out, r)
	}
}

func caseLostReplies(t *testing.T, n int, out *[]evidence.Round) {
	redis := startRedis(t, false)
	relay := startRelay(t, redis.Addr())
	a := startOn(t, "redis://"+relay.Addr()+"/0")
	up := evidence.StartUpstream(t)
	ctx := tctx(t)
	// Warm up: the store's programs are loaded (a function library, or
	// scripts), so the calls below are the ones that run. The rules below
	// match what a call carries (the intent's key; the cancel broadcast's
	// channel and the run), not how it is sent (FCALL or EVALSHA).
	admit(t, a, "warm")
	a.Post(ctx, up, "e", "warm", "warm-0")
	cancelRun(t, a, "warm", "warm up")
	for i := range n {
		var r evidence.Round
		run, reason := fmt.Sprintf("lost-%d", i), "stop, reply lost"
		key := run + "-charge"
		var log attempts
		admit(t, a, run)

		fired := relay.DropNextReply(key)
		lostAt := time.Now()
		first := log.add(a.Post(ctx, up, "e", run, key))
		expect(&r, isClosed(fired), "the relay lost the guard's reply")
		expect(&r, first.Code == "store_unavailable", "the guard whose reply was lost: 503, got %d %s", first.Status, first.Code)
		again := samePast503(ctx, a, up, &log, run, key)
		expect(&r, again.Code == state.RefusalInProgress, "the retry finds the key admitted once (intent_in_progress), got %d %s", again.Status, again.Code)

		fired = relay.DropNextReply("sg:cancels", run)
		drain := 30 * time.Second
		_, err := a.API().Cancel(ctx, run, client.CancelOptions{Reason: reason, Drain: &drain})
		var apiErr *client.APIError
		expect(&r, isClosed(fired), "the relay lost the cancel's reply")
		expect(&r, errors.As(err, &apiErr) && apiErr.StatusCode == 503, "the cancel whose reply was lost: 503, got %v", err)
		ack, res := cancelRun(t, a, run, reason)
		expect(&r, !res.Changed && res.Run.CancelVersion == 2, "the repeated cancel changes nothing: got changed=%v at version %d", res.Changed, res.Run.CancelVersion)
		log.add(a.Post(ctx, up, "e", run, run+"-after"))

		in := func() state.Intent {
			v := operator(t, "intent", func() (client.Reply[state.Intent], error) { return a.API().Intent(ctx, run, key) })
			return v.Value
		}
		_, ok := eventually(10*time.Second, func() bool { return in().State == state.IntentUnknown })
		expect(&r, ok, "the intent whose reply was lost turns UNKNOWN at its lease's end")
		r.Recover = time.Since(lostAt)
		expect(&r, in().Attempts == 1, "one intent, admitted once, under the key: got %d attempts", in().Attempts)
		operator(t, "resolve", func() (client.Reply[state.Intent], error) {
			return a.API().Resolve(ctx, run, key, control.ResolveRequest{Outcome: "not_applied", Source: "operator", Note: "the provider never saw it"})
		})
		r.Reconciled++
		final := settle(t, a, run, 5*time.Second)
		expect(&r, final.Run.Status == state.StatusCancelled, "the run is CANCELLED once reconciled, got %s", final.Run.Status)
		judgeRun(&r, &log, up, run, ack, reason, final)
		*out = append(*out, r)
	}
}

func casePubSubSilent(t *testing.T, n int, out *[]evidence.Round) {
	redis := startRedis(t, false)
	relay := startRelay(t, redis.Addr())
	end := evidence.StartTunnelEnd(t)
	policy := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(policy, []byte("pass_through: [\""+end.Addr()+"\"]\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	a := evidence.Start(t, binary, evidence.Config{Store: "redis://" + relay.Addr() + "/0", Flags: flags("--config", policy)})
	b := startOn(t, redis.URL())
	up := evidence.StartUpstream(t)
	for i := range n {
		var r evidence.Round
		ctx := tctx(t)
		run, reason := fmt.Sprintf("silent-%d", i), "stop while pub/sub is silent"
		var log attempts
		admit(t, b, run)
		// A's connections to Redis were cut at the end of the last round:
		// it answers 503 until it has live ones again.
		var tunnel, stream *conn
		var err error
		retry503(func() error { tunnel, err = openTunnel(a.Proxy, run, end.Addr()); return err })
		if err != nil {
			t.Fatalf("tunnel: %v", err)
		}
		retry503(func() error { stream, err = openStream(ctx, a, up, run, run+"-stream"); return err })
		if err != nil {
			t.Fatalf("stream: %v", err)
		}
		log.add(evidence.Attempt{Run: run, Key: run + "-stream", Started: time.Now(), Status: 200})
		relay.Silence("subscribe")
		before := relay.SilencedBytes()
		ack, _ := cancelRun(t, b, run, reason)
		tunnelCut, streamCut := tunnel.cutWithin(10*time.Second), stream.cutWithin(10*time.Second)
		judgeCuts(&r, "a connection of run "+run, cut{"the tunnel", tunnelCut}, cut{"the stream", streamCut})
		expect(&r, relay.SilencedBytes() > before, "the cancel message was lost on the silent connection")
		conns := end.Conns()
		_, err = openTunnel(a.Proxy, run, end.Addr())
		expect(&r, err != nil && strings.Contains(err.Error(), "409"), "a new tunnel after the cancel: 409, got %v", err)
		expect(&r, end.Conns() == conns, "no new connection reaches the tunnel's end after the cancel")
		log.add(a.Post(ctx, up, "e", run, run+"-after"))
		final := settle(t, b, run, 5*time.Second)
		judgeRun(&r, &log, up, run, ack, reason, final)
		*out = append(*out, r)
		relay.Heal()
		relay.CutAll()
	}
}

func caseThreeInstances(t *testing.T, n int, out *[]evidence.Round) {
	redis := startRedis(t, false)
	sgs := startInstances(t, redis.URL(), 3)
	up := evidence.StartUpstream(t)
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 3))
	for i := range n {
		var r evidence.Round
		ctx := tctx(t)
		run, reason := fmt.Sprintf("three-%d", i), "stop through the first instance"
		var log attempts
		admit(t, sgs[0], run)
		stream := mustStream(t, ctx, sgs[2], up, &log, run)
		done := make(chan struct{})
		var wg sync.WaitGroup
		for w := range 6 {
			sg := sgs[1+w%2]
			wg.Go(func() {
				for j := 0; ; j++ {
					select {
					case <-done:
						return
					default:
					}
					log.add(sg.Post(ctx, up, "e", run, fmt.Sprintf("%s-w%d-%d", run, w, j)))
				}
			})
		}
		time.Sleep(time.Duration(50+rng.IntN(200)) * time.Millisecond)
		ack, _ := cancelRun(t, sgs[0], run, reason)
		cut := stream.cutWithin(10 * time.Second)
		expect(&r, cut >= 0, "the stream on the third instance is cut")
		r.Recover = cut
		time.Sleep(300 * time.Millisecond)
		close(done)
		wg.Wait()
		forwardedAfter := 0
		for _, at := range log.all() {
			if at.Started.After(ack) && at.Status == 200 {
				forwardedAfter++
			}
		}
		expect(&r, forwardedAfter == 0, "no request started after the cancel is forwarded, got %d", forwardedAfter)
		final := settle(t, sgs[1], run, 5*time.Second)
		judgeRun(&r, &log, up, run, ack, reason, final)
		*out = append(*out, r)
	}
}

// caseBudgetBurst: twelve clients, four through each of three instances
// on one Redis, post as fast as they can under one run admitted with a
// budget of N effects, a stream of the run open on the third instance.
// Exactly N are admitted and reach the provider (the stream among them),
// the one that would cross the budget is refused budget_exceeded and its
// guard cancels the run (budget:max_effects, by stopgate, once), nothing
// that started after that refusal is forwarded, and the stream is cut as
// for any cancel.
func caseBudgetBurst(t *testing.T, n int, out *[]evidence.Round) {
	redis := startRedis(t, false)
	sgs := startInstances(t, redis.URL(), 3)
	up := evidence.StartUpstream(t)
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 11))
	for i := range n {
		var r evidence.Round
		ctx := tctx(t)
		run := fmt.Sprintf("budget-%d", i)
		limit := int64(10 + rng.IntN(31))
		operator(t, "admit "+run, func() (client.Reply[state.Run], error) {
			return sgs[0].API().AdmitWith(ctx, control.AdmitRequest{RunID: run, Budget: &control.BudgetRequest{MaxEffects: limit, DrainTimeout: "30s"}})
		})
		var log attempts
		stream := mustStream(t, ctx, sgs[2], up, &log, run)
		cutAt := make(chan time.Time, 1)
		go func() {
			<-stream.ended
			cutAt <- time.Now()
		}()
		var crossed sync.Once
		var ack time.Time
		var wg sync.WaitGroup
		var byInstance [3]atomic.Int64
		byInstance[2].Add(1) // the stream
		for w := range 12 {
			sg := sgs[w%3]
			wg.Go(func() {
				for j := 0; ; j++ {
					a := log.add(sg.Post(ctx, up, "e", run, fmt.Sprintf("%s-w%d-%d", run, w, j)))
					if a.Status == 200 {
						byInstance[w%3].Add(1)
					}
					if a.Code == state.RefusalBudgetExceeded {
						crossed.Do(func() { ack = a.Ended })
					}
					if a.Status != 200 || j > 4*int(limit) {
						return
					}
				}
			})
		}
		wg.Wait()
		select {
		case at := <-cutAt:
			if !ack.IsZero() {
				r.Recover = max(at.Sub(ack), time.Microsecond)
			}
		case <-time.After(10 * time.Second):
			expect(&r, false, "the stream on the third instance is cut by the budget's cancel")
		}
		admitted, budget, after := 0, 0, 0
		for _, a := range log.all() {
			if a.Status == 200 {
				admitted++
				if !ack.IsZero() && a.Started.After(ack) {
					after++
				}
			}
			if a.Code == state.RefusalBudgetExceeded {
				budget++
			}
		}
		expect(&r, int64(admitted) == limit, "exactly %d effects admitted over three instances, got %d", limit, admitted)
		expect(&r, budget == 1, "exactly one effect refused budget_exceeded, got %d", budget)
		expect(&r, after == 0, "no request started after the budget's cancel is forwarded, got %d", after)
		hits := hitsOf(up, run)
		sent := 0
		for _, h := range hits {
			sent += h
		}
		expect(&r, int64(sent) == limit, "the provider counted %d effects of the run, want exactly %d", sent, limit)
		t.Logf("round %d: budget %d, %d attempts; admitted %d (%d, %d, %d through the three instances), the provider counted %d, %d refused budget_exceeded, %d forwarded after the budget's cancel",
			i, limit, len(log.all()), admitted, byInstance[0].Load(), byInstance[1].Load(), byInstance[2].Load(), sent, budget, after)
		final := settle(t, sgs[1], run, 10*time.Second)
		expect(&r, final.Run.Usage[state.CounterEffects] == limit, "the row counts %d effects, want %d", final.Run.Usage[state.CounterEffects], limit)
		for _, e := range final.Events {
			if e.Kind == state.EventRunCancelled {
				expect(&r, e.Actor == state.ActorStopgate, "the cancel is stopgate's, got %q", e.Actor)
			}
		}
		if ack.IsZero() {
			ack = time.Now()
		}
		judge(&r, log.all(), hits, map[string]time.Time{run: ack}, map[string]string{run: state.BudgetReason(state.LimitEffects)}, map[string]control.Audit{run: final})
		*out = append(*out, r)
	}
}

func caseDiskFull(t *testing.T, n int, out *[]evidence.Round) {
	mnt := mountTmpfs(t, "16m")
	up := evidence.StartUpstream(t)
	for i := range n {
		var r evidence.Round
		ctx := tctx(t)
		dir := filepath.Join(mnt, fmt.Sprintf("data-%d", i))
		a := evidence.Start(t, binary, evidence.Config{DataDir: dir, Flags: flags()})
		run, reason := fmt.Sprintf("full-%d", i), "stop on a full disk"
		var log attempts
		admit(t, a, run)
		log.add(a.Post(ctx, up, "e", run, run+"-0"))
		filler := fill(t, mnt)
		// Effects until the store cannot commit any more: bbolt first uses
		// the free pages already in its file, then needs to grow it.
		full := false
		for j := 1; j <= 3000 && !full; j++ {
			at := log.add(a.Post(ctx, up, "e", run, fmt.Sprintf("%s-%d", run, j)))
			full = at.Code == "store_unavailable"
			expect(&r, at.Status == 200 || at.Code == "store_unavailable", "on a full disk: 200 or 503, got %d %s", at.Status, at.Code)
		}
		expect(&r, full, "the full disk is felt: some request gets 503")
		drain := 30 * time.Second
		_, cancelErr := a.API().Cancel(ctx, run, client.CancelOptions{Reason: reason, Drain: &drain})
		if err := os.Remove(filler); err != nil {
			t.Fatal(err)
		}
		freed := time.Now()
		k := 0
		_, ok := eventually(10*time.Second, func() bool {
			k++
			at := log.add(a.Post(ctx, up, "e", run, fmt.Sprintf("%s-free%d", run, k)))
			return at.Status == 200 || at.Code == state.RefusalRunNotActive
		})
		expect(&r, ok, "the store commits again once space is freed")
		r.Recover = time.Since(freed)
		if cancelErr != nil {
			var apiErr *client.APIError
			expect(&r, errors.As(cancelErr, &apiErr) && apiErr.StatusCode == 503, "a cancel the full disk cannot take is refused 503, got %v", cancelErr)
			t.Logf("round %d: the cancel on the full disk was refused (%v); cancelling again", i, cancelErr)
		}
		ack, _ := cancelRun(t, a, run, reason)
		a.Kill9()
		a.Restart()
		final := reconcile(t, a, up, run, &r)
		judgeRun(&r, &log, up, run, ack, reason, final)
		*out = append(*out, r)
		a.Kill9()
	}
}

func caseKillMidCommit(t *testing.T, n int, out *[]evidence.Round) {
	up := evidence.StartUpstream(t)
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 10))
	for i := range n {
		var r evidence.Round
		ctx := tctx(t)
		a := evidence.Start(t, binary, evidence.Config{Flags: flags()})
		runs := []string{fmt.Sprintf("commit-%d-a", i), fmt.Sprintf("commit-%d-b", i), fmt.Sprintf("commit-%d-c", i)}
		for _, run := range runs {
			admit(t, a, run)
		}
		var log attempts
		done := make(chan struct{})
		var wg sync.WaitGroup
		for w := range 4 {
			wg.Go(func() {
				for j := 0; ; j++ {
					select {
					case <-done:
						return
					default:
					}
					run := runs[(w+j)%len(runs)]
					log.add(a.Post(ctx, up, "e", run, fmt.Sprintf("%s-w%d-%d", run, w, j)))
				}
			})
		}
		acked := map[string]time.Time{}
		reasons := map[string]string{}
		var ackMu sync.Mutex
		pauses := []time.Duration{time.Duration(20+rng.IntN(150)) * time.Millisecond, time.Duration(20+rng.IntN(150)) * time.Millisecond}
		wg.Go(func() {
			for k, run := range runs[:2] {
				time.Sleep(pauses[k])
				drain := 30 * time.Second
				reason := "stop " + run
				if _, err := a.API().Cancel(ctx, run, client.CancelOptions{Reason: reason, Drain: &drain}); err == nil {
					ackMu.Lock()
					acked[run], reasons[run] = time.Now(), reason
					ackMu.Unlock()
				}
			}
		})
		time.Sleep(time.Duration(100+rng.IntN(300)) * time.Millisecond)
		a.Kill9()
		killed := time.Now()
		close(done)
		wg.Wait()
		a.Restart()
		r.Recover = time.Since(killed)
		audits := map[string]control.Audit{}
		ackMu.Lock()
		for _, run := range runs {
			audits[run] = reconcile(t, a, up, run, &r)
			if _, ok := acked[run]; ok {
				at := samePast503(ctx, a, up, &log, run, run+"-after")
				expect(&r, at.Code == state.RefusalRunNotActive, "a cancelled run after the restart: 409, got %d %s", at.Status, at.Code)
				audits[run] = audit(t, a, run)
			}
		}
		judge(&r, log.all(), hitsOf(up, runs...), acked, reasons, audits)
		ackMu.Unlock()
		*out = append(*out, r)
		a.Kill9()
	}
}

// caseBrowserActionInFlight: a guarded Chromium that A launched for the run
// (POST /v1/runs/RUN/browsers), driven with chromedp through A's browser
// guard, runs a script whose POST the provider holds; the cancel goes
// through B while the script's action is in flight. In even rounds the
// provider answers within the drain (the action finishes and is recorded
// answered); in odd rounds it holds the POST past a 2s drain deadline,
// which cuts it. Either way the script then tries one more POST, and the
// agent one more action: both must be refused, and reach nothing.
func caseBrowserActionInFlight(t *testing.T, n int, out *[]evidence.Round) {
	chromium := testkit.Chromium(t)
	redis := startRedis(t, false)
	// The browser of a run that is over stops 1s later, so that rounds do
	// not keep browsers running on a shared machine.
	a := evidence.Start(t, binary, evidence.Config{Store: redis.URL(), Flags: flags("--chromium", chromium, "--browser-linger", "1s")})
	b := startOn(t, redis.URL())
	up := evidence.StartUpstream(t)
	// The CDP error of an action the guard refused: the method, the
	// refusal, the run's state and what was recorded.
	cdpRefusal := regexp.MustCompile(`stopgate refused (\S+): (run_not_active): run \S+ is ([A-Z]+) at cancel_version 2 \(the request observed 1\): nothing was sent; recorded (CANCELLED_BEFORE_DISPATCH)`)
	for i := range n {
		var r evidence.Round
		ctx := tctx(t)
		run, reason := fmt.Sprintf("browser-%d", i), "stop while a browser action waits"
		pageKey, heldKey, lateKey, nextKey := run+"-page", run+"-held", run+"-late", run+"-next"
		cutByDeadline := i%2 == 1
		drain := 30 * time.Second
		if cutByDeadline {
			drain = 2 * time.Second
		}
		var log attempts
		admit(t, b, run)
		launched := operator(t, "browser "+run, func() (client.Reply[control.BrowserResponse], error) {
			return a.API().Browser(ctx, run, control.BrowserRequest{CancelVersion: 1})
		})
		tab, detach := testkit.Attach(ctx, launched.Value.WSURL)

		// The page comes from the provider, so that its script's requests
		// are same-origin and may carry an Idempotency-Key; the navigation
		// carries one too, for the time of the load.
		started := time.Now()
		err := chromedp.Do(tab,
			setHeaders(network.Headers{"Idempotency-Key": pageKey}),
			chromedp.Navigate(up.URL()+"/page/"+run+"/"+pageKey),
			setHeaders(network.Headers{}),
		)
		if err != nil {
			t.Fatalf("navigate while ACTIVE: %v\nserve log:\n%s", err, a.Log())
		}
		log.add(evidence.Attempt{Run: run, Key: pageKey, Started: started, Ended: time.Now(), Status: 200})

		// The action in flight: the script's POST is held by the provider;
		// once it ends (answered or cut), the script sends one more.
		script := fmt.Sprintf(`(async () => {
  const post = (path, key) => fetch(path, {method: "POST", headers: {"Idempotency-Key": key}, body: "amount=1"});
  const answer = async (p) => {
    try {
      const r = await p;
      return {status: r.status, refusal: r.headers.get("X-Stopgate-Refusal") || "", body: await r.text()};
    } catch (e) {
      return {status: -1, refusal: "", body: String(e)};
    }
  };
  const held = await answer(post(%q, %q));
  const late = await answer(post(%q, %q));
  return {held, late};
})()`, "/slow/"+run+"/"+heldKey, heldKey, "/e/"+run+"/"+lateKey, lateKey)
		type scriptResult struct {
			Held pageAnswer `json:"held"`
			Late pageAnswer `json:"late"`
		}
		heldStarted := time.Now()
		done := make(chan error, 1)
		var res scriptResult
		go func() {
			var err error
			res, err = chromedp.Run(tab, chromedp.Evaluate[scriptResult](script, chromedp.EvalAwaitPromise))
			done <- err
		}()
		select {
		case <-up.Arrived(heldKey):
		case err := <-done:
			t.Fatalf("the script ended before its POST reached the provider: %v %+v\nserve log:\n%s", err, res, a.Log())
		case <-time.After(20 * time.Second):
			t.Fatalf("the script's POST never reached the provider\nserve log:\n%s", a.Log())
		}

		ack, _ := cancelDrain(t, b, run, reason, drain)
		// The agent's next action, while the first is still in flight.
		nextStarted := time.Now()
		nextErr := chromedp.Do(tab, chromedp.Navigate(up.URL()+"/e/"+run+"/"+nextKey))
		r.Recover = time.Since(ack)
		next := evidence.Attempt{Run: run, Key: nextKey, Started: nextStarted, Ended: time.Now(), Err: nextErr}
		m := cdpRefusal.FindStringSubmatch(fmt.Sprint(nextErr))
		if m != nil && m[1] == "Page.navigate" {
			next.Code, next.Recorded = m[2], m[4]
		}
		log.add(next)
		expect(&r, m != nil && m[1] == "Page.navigate" && m[3] != "", "the next action after the cancel gets a CDP error naming the run's state, got %v", nextErr)
		if !cutByDeadline && m != nil {
			// The held POST keeps the run draining until it is answered.
			expect(&r, m[3] == string(state.StatusCancelling), "the next action is refused while the run is CANCELLING, got %s", m[3])
		}

		if !cutByDeadline {
			up.Release(heldKey)
		}
		var scriptErr error
		select {
		case scriptErr = <-done:
		case <-time.After(30 * time.Second):
			t.Fatalf("the script in flight at the cancel never ended\nserve log:\n%s", a.Log())
		}
		if scriptErr == nil {
			log.add(res.Held.attempt(run, heldKey, heldStarted))
			// The late POST began once the held one had ended, after nextStarted.
			log.add(res.Late.attempt(run, lateKey, nextStarted))
		} else {
			// The script's answer was lost with its connection: the held
			// POST was sent, what came of it the page never said.
			log.add(evidence.Attempt{Run: run, Key: heldKey, Started: heldStarted, Ended: time.Now(), Err: scriptErr})
		}
		if cutByDeadline {
			// The script may be answered, or its connection may close as the
			// UNKNOWN run's browser stops: either is explained below.
			expect(&r, scriptErr != nil || res.Held.Status != 200, "the POST cut by the drain deadline ends as an error for the page, got %+v", res.Held)
		} else {
			expect(&r, scriptErr == nil && res.Held.Status == 200, "the POST answered within the drain reaches the page: got %+v, %v", res.Held, scriptErr)
		}
		expect(&r, scriptErr != nil || (res.Late.Status == 409 && res.Late.Refusal == state.RefusalRunNotActive),
			"the script's POST after the cancel: 409 run_not_active, got %+v", res.Late)
		// Time for a leak to land before the provider's counts are read.
		time.Sleep(200 * time.Millisecond)
		for key, want := range map[string]int{pageKey: 1, heldKey: 1, lateKey: 0, nextKey: 0} {
			expect(&r, up.Hits(key) == want, "the provider counted %s %d time(s), want %d", key, up.Hits(key), want)
		}

		settled := settle(t, b, run, 10*time.Second)
		var evals, refused, post []state.Intent
		for _, in := range settled.Intents {
			switch {
			// chromedp evaluates scripts of its own while it navigates: the
			// script in flight is the one admitted after it was sent.
			case in.Boundary == state.BoundaryBrowser && in.Method == "Runtime.evaluate" && !in.CreatedAt.Before(heldStarted.Truncate(time.Millisecond)):
				evals = append(evals, in)
			case in.Boundary == state.BoundaryBrowser && in.Method == "Page.navigate" && in.Target == up.URL()+"/e/"+run+"/"+nextKey:
				refused = append(refused, in)
			case in.Key == heldKey:
				post = append(post, in)
			}
		}
		expect(&r, len(evals) == 1, "one script action recorded after it was sent, got %d: %+v", len(evals), evals)
		expect(&r, len(refused) == 1 && refused[0].State == state.IntentCancelledBeforeDispatch, "the next action recorded CANCELLED_BEFORE_DISPATCH, got %+v", refused)
		expect(&r, len(post) == 1, "the page's held POST recorded under its key, got %d", len(post))
		if len(evals) == 1 {
			st := evals[0].State
			expect(&r, st == state.IntentResponded || (cutByDeadline && st == state.IntentUnknown && evals[0].Reason != ""),
				"the action in flight at the cancel ends answered (or UNKNOWN with a reason once the deadline cut it), never refused: %s (%s)", st, evals[0].Reason)
		}
		if len(post) == 1 {
			want := state.IntentResponded
			if cutByDeadline {
				want = state.IntentUnknown
			}
			expect(&r, post[0].State == want, "the page's held POST is %s, want %s (%s)", post[0].State, want, post[0].Reason)
		}
		final := reconcileBy(t, b, run, &r, func(in state.Intent) int {
			if len(evals) == 1 && in.Key == evals[0].Key {
				return up.Hits(heldKey)
			}
			return up.Hits(in.Key)
		})
		expect(&r, final.Run.Status == state.StatusCancelled, "the run is CANCELLED once reconciled, got %s", final.Run.Status)
		judgeRun(&r, &log, up, run, ack, reason, final)
		*out = append(*out, r)
		detach()
	}
}

// pageAnswer is what a page's fetch got: the status (-1: no answer), the
// refusal header and the body.
type pageAnswer struct {
	Status  int    `json:"status"`
	Refusal string `json:"refusal"`
	Body    string `json:"body"`
}

// attempt is the answer as an Attempt of key, started at started.
func (p pageAnswer) attempt(run, key string, started time.Time) evidence.Attempt {
	a := evidence.Attempt{Run: run, Key: key, Started: started, Ended: time.Now(), Status: max(p.Status, 0), Code: p.Refusal}
	if p.Status < 0 {
		a.Err = errors.New(p.Body)
	}
	if a.Code != "" {
		var body struct {
			Recorded string `json:"recorded"`
		}
		_ = json.Unmarshal([]byte(p.Body), &body)
		a.Recorded = body.Recorded
	}
	return a
}

// setHeaders sets the extra HTTP headers the page sends with every request
// (none: an empty map).
func setHeaders(h network.Headers) chromedp.Action[chromedp.Void] {
	return chromedp.Func(func(ctx context.Context, tg *chromedp.Target) error {
		_, err := cdp.Call(ctx, tg, network.SetExtraHTTPHeaders, network.SetExtraHTTPHeadersParams{Headers: h})
		return err
	})
}

func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	case <-time.After(2 * time.Second):
		return false
	}
}
