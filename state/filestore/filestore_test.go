package filestore_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/filestore"
	"github.com/stopgate/stopgate/state/statetest"
)

const lease = 30 * time.Second

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

func open(t testing.TB, path string) *filestore.Store {
	t.Helper()
	s, err := filestore.Open(path, filestore.Options{Logger: quiet()})
	if err != nil {
		t.Fatalf("open %s: %v", path, err)
	}
	return s
}

func testCtx(t testing.TB) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return c
}

func TestConformance(t *testing.T) {
	statetest.Run(t, func(t *testing.T) state.Store {
		return open(t, filepath.Join(t.TempDir(), "stopgate.db"))
	})
}

func TestOutcomeRidesWithTheNextCommit(t *testing.T) {
	path := filepath.Join(t.TempDir(), "stopgate.db")
	s, err := filestore.Open(path, filestore.Options{Logger: quiet(), OutcomeDelay: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	statetest.LaterRidesAlong(t, s, func() state.Store { return open(t, path) })
}

// admitGuardCancel leaves run r CANCELLING v2 with one IN_FLIGHT intent
// admitted before the cancel and one refused after it.
func admitGuardCancel(ctx context.Context, s state.Store, run string) error {
	if _, err := s.Admit(ctx, state.AdmitRequest{RunID: run, Actor: "test"}); err != nil {
		return err
	}
	g, err := s.Guard(ctx, state.GuardRequest{RunID: run, ObservedVersion: 1, Key: "before", ExplicitKey: true,
		Boundary: state.BoundaryHTTP, Method: "POST", Target: "https://api.example/charge", LeaseOwner: "p", LeaseTTL: lease, Actor: "p"})
	if err != nil {
		return err
	}
	if !g.Admitted {
		return fmt.Errorf("guard on an ACTIVE run refused: %+v", g)
	}
	res, err := s.Cancel(ctx, state.CancelRequest{RunID: run, Actor: "operator", Reason: "stop pressed", DrainTimeout: time.Minute})
	if err != nil {
		return err
	}
	if !res.Changed || res.Run.Status != state.StatusCancelling {
		return fmt.Errorf("cancel: %+v", res)
	}
	return nil
}

// wantCancelled checks what a reopened store must still know about a run
// admitGuardCancel left.
func wantCancelled(t *testing.T, s state.Store, run string) {
	t.Helper()
	ctx := testCtx(t)
	r, err := s.Get(ctx, run)
	if err != nil {
		t.Fatalf("get after reopen: %v", err)
	}
	if r.Status != state.StatusCancelling || r.CancelVersion != 2 || r.Reason != "stop pressed" {
		t.Fatalf("row after reopen: %+v, want CANCELLING v2", r)
	}
	g, err := s.Guard(ctx, state.GuardRequest{RunID: run, ObservedVersion: 1, Key: "after", ExplicitKey: true,
		Boundary: state.BoundaryHTTP, LeaseOwner: "p", LeaseTTL: lease, Actor: "p"})
	if err != nil {
		t.Fatal(err)
	}
	if g.Admitted || g.Refusal != state.RefusalRunNotActive {
		t.Fatalf("guard after reopen admitted work of a cancelled run: %+v", g)
	}
	ins, err := s.Intents(ctx, run)
	if err != nil {
		t.Fatal(err)
	}
	if len(ins) != 2 || ins[0].Key != "before" || ins[0].State != state.IntentInFlight || ins[1].Key != "after" || ins[1].State != state.IntentCancelledBeforeDispatch {
		t.Fatalf("intents after reopen: %+v", ins)
	}
	evs, err := s.Events(ctx, run)
	if err != nil {
		t.Fatal(err)
	}
	var kinds []string
	for _, e := range evs {
		kinds = append(kinds, e.Kind)
	}
	want := []string{state.EventRunAdmitted, state.EventIntentAdmitted, state.EventRunCancelled, state.EventIntentRefused}
	if strings.Join(kinds, " ") != strings.Join(want, " ") {
		t.Fatalf("events after reopen %v, want %v", kinds, want)
	}
}

func TestCancelSurvivesReopen(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data", "nested")
	path := filepath.Join(dir, "stopgate.db")
	s := open(t, path)
	if err := admitGuardCancel(testCtx(t), s, "r1"); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]os.FileMode{dir: 0o700, path: 0o600} {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if got := fi.Mode().Perm(); got != want {
			t.Errorf("%s has mode %o, want %o", p, got, want)
		}
	}
	s = open(t, path)
	defer s.Close()
	wantCancelled(t, s, "r1")
}

const helperEnv = "STOPGATE_FILESTORE_HELPER_PATH"

// TestHelperProcess is the child of TestCancelSurvivesKill9, not a test of
// its own: it acknowledges a cancel and then waits to be killed.
func TestHelperProcess(t *testing.T) {
	path := os.Getenv(helperEnv)
	if path == "" {
		t.Skip("runs only as the child of TestCancelSurvivesKill9")
	}
	s, err := filestore.Open(path, filestore.Options{Logger: quiet()})
	if err != nil {
		fmt.Fprintln(os.Stderr, "helper:", err)
		os.Exit(2)
	}
	if err := admitGuardCancel(context.Background(), s, "killed"); err != nil {
		fmt.Fprintln(os.Stderr, "helper:", err)
		os.Exit(2)
	}
	fmt.Println("acked")
	// Never Close: the parent kills this process with the file open. The
	// bound only matters if the parent died first.
	time.Sleep(time.Minute)
	os.Exit(3)
}

func TestCancelSurvivesKill9(t *testing.T) {
	path := filepath.Join(t.TempDir(), "stopgate.db")
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), helperEnv+"="+path)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })

	acked := make(chan error, 1)
	go func() {
		line, err := bufio.NewReader(stdout).ReadString('\n')
		if err == nil && strings.TrimSpace(line) != "acked" {
			err = fmt.Errorf("child printed %q", line)
		}
		acked <- err
		_, _ = io.Copy(io.Discard, stdout)
	}()
	select {
	case err := <-acked:
		if err != nil {
			t.Fatalf("child did not ack the cancel: %v; stderr: %s", err, stderr.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("no ack from the child within 30s; stderr: %s", stderr.String())
	}

	if err := cmd.Process.Signal(os.Kill); err != nil {
		t.Fatal(err)
	}
	err = cmd.Wait()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != -1 {
		t.Fatalf("child was not killed by the signal: %v", err)
	}

	s, err := filestore.Open(path, filestore.Options{Logger: quiet(), Timeout: 5 * time.Second})
	if err != nil {
		t.Fatalf("reopen after kill -9: %v", err)
	}
	defer s.Close()
	wantCancelled(t, s, "killed")
}

func TestSecondProcessGetsClearError(t *testing.T) {
	path := filepath.Join(t.TempDir(), "stopgate.db")
	s := open(t, path)
	defer s.Close()
	// flock conflicts between two opens of the file even in one process,
	// which is what a second stopgate process would meet.
	start := time.Now()
	_, err := filestore.Open(path, filestore.Options{Logger: quiet(), Timeout: 100 * time.Millisecond})
	if err == nil {
		t.Fatal("a second open of a file in use succeeded")
	}
	if msg := err.Error(); !strings.Contains(msg, path) || !strings.Contains(msg, "in use") {
		t.Fatalf("error %q does not name the file and say it is in use", msg)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("second open took %v to fail, want about its 100ms timeout", d)
	}
	if err := s.Ping(testCtx(t)); err != nil {
		t.Fatalf("the first store stopped answering: %v", err)
	}
}

func TestCorruptFileIsAClearError(t *testing.T) {
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(1, 2))
	random := make([]byte, 64<<10)
	for i := range random {
		random[i] = byte(rng.Uint32())
	}
	for name, content := range map[string][]byte{
		"random":    random,
		"text":      []byte("this is not a database\n"),
		"zeros":     make([]byte, 16<<10),
		"truncated": truncatedStore(t, dir),
	} {
		t.Run(name, func(t *testing.T) {
			path := filepath.Join(dir, name+".db")
			if err := os.WriteFile(path, content, 0o600); err != nil {
				t.Fatal(err)
			}
			// Twice: a failed open must not leave the file locked.
			for range 2 {
				s, err := filestore.Open(path, filestore.Options{Logger: quiet(), Timeout: 100 * time.Millisecond})
				if err == nil {
					s.Close()
					t.Fatalf("open of a corrupt file succeeded")
				}
				if msg := err.Error(); !strings.Contains(msg, path) || strings.Contains(msg, "in use") {
					t.Fatalf("error %q does not name the file, or blames another process", msg)
				}
				t.Log(err)
			}
		})
	}
}

// truncatedStore returns the first page of a real data file: valid-looking
// meta, nothing behind it.
func truncatedStore(t *testing.T, dir string) []byte {
	path := filepath.Join(dir, "whole.db")
	s := open(t, path)
	if _, err := s.Admit(testCtx(t), state.AdmitRequest{RunID: "r", Actor: "t"}); err != nil {
		t.Fatal(err)
	}
	s.Close()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return raw[:len(raw)/4]
}

func TestBackupIsAnOpenableCopy(t *testing.T) {
	dir := t.TempDir()
	s := open(t, filepath.Join(dir, "stopgate.db"))
	defer s.Close()
	if err := admitGuardCancel(testCtx(t), s, "b1"); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(filepath.Join(dir, "backup.db"), os.O_CREATE|os.O_WRONLY|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Backup(testCtx(t), f); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	b := open(t, f.Name())
	defer b.Close()
	wantCancelled(t, b, "b1")
}

func TestSlowSubscriberNeverBlocksCancels(t *testing.T) {
	s := open(t, filepath.Join(t.TempDir(), "stopgate.db"))
	ctx := testCtx(t)
	stuck, err := s.Cancels(ctx) // never read
	if err != nil {
		t.Fatal(err)
	}
	for i := range 100 {
		if _, err := s.Cancel(ctx, state.CancelRequest{RunID: fmt.Sprintf("r%d", i), Actor: "op"}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	n := 0
	for range stuck {
		n++
	}
	if n == 0 || n >= 100 {
		t.Fatalf("slow subscriber got %d of 100 cancels, want some dropped and the channel closed", n)
	}
	if _, err := s.Cancels(ctx); !errors.Is(err, state.ErrUnavailable) {
		t.Fatalf("subscribe after close: got %v, want ErrUnavailable", err)
	}
	if _, err := s.Get(ctx, "r1"); !errors.Is(err, state.ErrUnavailable) {
		t.Fatalf("get after close: got %v, want ErrUnavailable", err)
	}
}

func TestSubscriptionEndsWithContext(t *testing.T) {
	s := open(t, filepath.Join(t.TempDir(), "stopgate.db"))
	defer s.Close()
	ctx, cancel := context.WithCancel(testCtx(t))
	ch, err := s.Cancels(ctx)
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	select {
	case _, ok := <-ch:
		if ok {
			t.Fatal("got a cancel nobody made")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("subscription outlived its context")
	}
}

func TestNoOpsDoNotCommit(t *testing.T) {
	// A tick with nothing to do, an idempotent admit or a repeated cancel
	// must not commit: every commit is an fsync, and ticks run for every
	// live run. bbolt rewrites a meta page on each commit, so an unchanged
	// file is the proof.
	path := filepath.Join(t.TempDir(), "stopgate.db")
	s := open(t, path)
	defer s.Close()
	ctx := testCtx(t)
	if _, err := s.Admit(ctx, state.AdmitRequest{RunID: "n", Actor: "t"}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Cancel(ctx, state.CancelRequest{RunID: "c", Actor: "t"}); err != nil {
		t.Fatal(err)
	}
	before, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if _, err := s.Admit(ctx, state.AdmitRequest{RunID: "n", Actor: "t"}); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Tick(ctx, state.TickRequest{RunID: "n", Actor: "t"}); err != nil {
			t.Fatal(err)
		}
		if res, err := s.Cancel(ctx, state.CancelRequest{RunID: "c", Actor: "t"}); err != nil || res.Changed {
			t.Fatalf("repeated cancel: %+v %v", res, err)
		}
		if res, err := s.Guard(ctx, state.GuardRequest{RunID: "unseen", Key: "k", Boundary: state.BoundaryHTTP, LeaseTTL: lease}); err != nil || res.Refusal != state.RefusalRunNotAdmitted {
			t.Fatalf("guard of an unseen run: %+v %v", res, err)
		}
	}
	after, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(before, after) {
		t.Fatal("no-ops committed a transaction")
	}
}

func BenchmarkGuard(b *testing.B) {
	s := open(b, filepath.Join(b.TempDir(), "stopgate.db"))
	defer s.Close()
	ctx := context.Background()
	if _, err := s.Admit(ctx, state.AdmitRequest{RunID: "bench", Actor: "bench"}); err != nil {
		b.Fatal(err)
	}
	i := 0
	for b.Loop() {
		i++
		res, err := s.Guard(ctx, state.GuardRequest{RunID: "bench", ObservedVersion: 1, Key: fmt.Sprintf("k%d", i), ExplicitKey: true,
			Boundary: state.BoundaryHTTP, Method: "POST", Target: "https://api.example/charge", BodyDigest: "d",
			LeaseOwner: "proxy", LeaseTTL: lease, Actor: "proxy"})
		if err != nil || !res.Admitted {
			b.Fatalf("guard: %v %+v", err, res)
		}
	}
}

// BenchmarkGuardParallel shows the cost of the single writer: concurrent
// guards queue for it, each still paying its own fsync.
func BenchmarkGuardParallel(b *testing.B) {
	s := open(b, filepath.Join(b.TempDir(), "stopgate.db"))
	defer s.Close()
	ctx := context.Background()
	if _, err := s.Admit(ctx, state.AdmitRequest{RunID: "bench", Actor: "bench"}); err != nil {
		b.Fatal(err)
	}
	var n atomic.Int64
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			res, err := s.Guard(ctx, state.GuardRequest{RunID: "bench", ObservedVersion: 1, Key: fmt.Sprintf("k%d", n.Add(1)), ExplicitKey: true,
				Boundary: state.BoundaryHTTP, Method: "POST", Target: "https://api.example/charge", BodyDigest: "d",
				LeaseOwner: "proxy", LeaseTTL: lease, Actor: "proxy"})
			if err != nil || !res.Admitted {
				b.Errorf("guard: %v %+v", err, res)
				return
			}
		}
	})
}

// A data file written before the retention index existed gets one at
// Open: its final runs are pruned like any other.
func TestOpenIndexesFinalRunsOfAnOlderFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "stopgate.db")
	s := open(t, path)
	ctx := testCtx(t)
	if err := admitGuardCancel(ctx, s, "cancelled"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Admit(ctx, state.AdmitRequest{RunID: "done", Actor: "t"}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Complete(ctx, state.CompleteRequest{RunID: "done", Version: 1, Actor: "w"}); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Update(func(tx *bolt.Tx) error { return tx.DeleteBucket([]byte("final")) }); err != nil {
		t.Fatal(err)
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}

	s = open(t, path)
	defer s.Close()
	time.Sleep(5 * time.Millisecond)
	n, err := s.Prune(ctx, state.PruneRequest{FinalBefore: time.Now(), Limit: 10})
	if err != nil || n != 1 {
		t.Fatalf("prune after reopening an older file: %d %v, want the completed run", n, err)
	}
	if r, _ := s.Get(ctx, "done"); r.PrunedAt.IsZero() {
		t.Fatalf("the completed run of the older file was not pruned: %+v", r)
	}
	if ins, _ := s.Intents(ctx, "cancelled"); len(ins) != 1 {
		t.Fatalf("the CANCELLING run of the older file lost its intents: %+v", ins)
	}
}

// A data file of format 1 (JSON records, no retention index) opens: its
// records read as they were, its run moves on, and the file becomes
// format 2.
func TestFormatOneFileOpensAndMovesOn(t *testing.T) {
	path := filepath.Join(t.TempDir(), "stopgate.db")
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC().Truncate(time.Millisecond)
	ts := now.Format(time.RFC3339Nano)
	seq := func(n uint64) []byte { return binary.BigEndian.AppendUint64(nil, n) }
	err = db.Update(func(tx *bolt.Tx) error {
		meta, _ := tx.CreateBucket([]byte("meta"))
		_ = meta.Put([]byte("format"), []byte("1"))
		runs, _ := tx.CreateBucket([]byte("runs"))
		_ = runs.Put([]byte("old"), []byte(`{"run_id":"old","status":"ACTIVE","cancel_version":1,"created_at":"`+ts+`","updated_at":"`+ts+`","intents":{"IN_FLIGHT":1}}`))
		status, _ := tx.CreateBucket([]byte("status"))
		_ = status.Put([]byte("ACTIVE/old"), nil)
		run, _ := tx.CreateBucket([]byte("run"))
		b, _ := run.CreateBucket([]byte("old"))
		for _, name := range []string{"intents", "order", "pending", "seq", "events"} {
			_, _ = b.CreateBucket([]byte(name))
		}
		_ = b.Bucket([]byte("intents")).Put([]byte("k"), []byte(`{"run_id":"old","key":"k","boundary":"http","state":"IN_FLIGHT","method":"POST","target":"https://a/x","attempts":1,"lease_owner":"p","lease_expires":"`+now.Add(time.Hour).Format(time.RFC3339Nano)+`","created_at":"`+ts+`","updated_at":"`+ts+`","seq":1}`))
		_ = b.Bucket([]byte("order")).Put(seq(1), []byte("k"))
		_ = b.Bucket([]byte("pending")).Put(seq(1), []byte("k"))
		_ = b.Bucket([]byte("events")).Put(seq(1), []byte(`{"at":"`+ts+`","run_id":"old","actor":"t","kind":"run.admitted","to":"ACTIVE","cancel_version":1}`))
		// Format 1 numbered creation order and events by bucket sequence.
		_ = b.Bucket([]byte("order")).SetSequence(1)
		_ = b.Bucket([]byte("events")).SetSequence(1)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}

	s := open(t, path)
	ctx := testCtx(t)
	if r, err := s.Get(ctx, "old"); err != nil || r.Status != state.StatusActive || r.Intents[state.IntentInFlight] != 1 {
		t.Fatalf("row of the format 1 file: %+v %v", r, err)
	}
	in, err := s.Intent(ctx, "old", "k")
	if err != nil || in.State != state.IntentInFlight || in.Target != "https://a/x" || in.Attempts != 1 {
		t.Fatalf("intent of the format 1 file: %+v %v", in, err)
	}
	if _, err := s.Finish(ctx, state.FinishRequest{RunID: "old", Key: "k", Attempt: 1, Outcome: state.IntentResponded, StatusCode: 200, Actor: "p"}); err != nil {
		t.Fatal(err)
	}
	g, err := s.Guard(ctx, state.GuardRequest{RunID: "old", Key: "k2", ExplicitKey: true, Boundary: state.BoundaryHTTP, LeaseOwner: "p", LeaseTTL: lease, Actor: "p"})
	if err != nil || !g.Admitted {
		t.Fatalf("guard on the format 1 run: %+v %v", g, err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s = open(t, path)
	defer s.Close()
	ins, err := s.Intents(ctx, "old")
	if err != nil || len(ins) != 2 || ins[0].State != state.IntentResponded || ins[1].Key != "k2" {
		t.Fatalf("intents after reopening: %+v %v", ins, err)
	}
	evs, err := s.Events(ctx, "old")
	if err != nil || len(evs) != 3 || evs[0].Kind != state.EventRunAdmitted || !evs[0].At.Equal(now) {
		t.Fatalf("events after reopening: %+v %v", evs, err)
	}
}

// A derived key's counter as files written before the counter became
// lazy hold it (1 after the first dispatch of a base) goes on to base.2,
// and a file that has none for a base already dispatched goes on to the
// same key: both layouts number a base's dispatches alike.
func TestDerivedKeyCounterOfAnOlderFileGoesOn(t *testing.T) {
	for _, counter := range []bool{true, false} {
		t.Run(fmt.Sprintf("counter=%v", counter), func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "stopgate.db")
			ctx := testCtx(t)
			guard := func(s *filestore.Store) string {
				t.Helper()
				g, err := s.Guard(ctx, state.GuardRequest{RunID: "r", Key: "base", Boundary: state.BoundaryHTTP,
					AutoAdmit: true, LeaseOwner: "p", LeaseTTL: lease, Actor: "p"})
				if err != nil || !g.Admitted {
					t.Fatalf("guard: %+v %v", g, err)
				}
				return g.Intent.Key
			}
			s := open(t, path)
			if k := guard(s); k != "base" {
				t.Fatalf("first dispatch under %q, want base", k)
			}
			if err := s.Close(); err != nil {
				t.Fatal(err)
			}
			db, err := bolt.Open(path, 0o600, nil)
			if err != nil {
				t.Fatal(err)
			}
			err = db.Update(func(tx *bolt.Tx) error {
				seq := tx.Bucket([]byte("run")).Bucket([]byte("r")).Bucket([]byte("seq"))
				if !counter {
					return seq.Delete([]byte("base"))
				}
				return seq.Put([]byte("base"), binary.BigEndian.AppendUint64(nil, 1))
			})
			if err != nil {
				t.Fatal(err)
			}
			if err := db.Close(); err != nil {
				t.Fatal(err)
			}
			s = open(t, path)
			defer s.Close()
			for _, want := range []string{"base.2", "base.3"} {
				if k := guard(s); k != want {
					t.Fatalf("next dispatch under %q, want %s", k, want)
				}
			}
		})
	}
}
