package bench

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/stopgate/stopgate/internal/redisserver"
)

// embeddedFile is the embedded store's file in a data directory. The name
// is stopgate's, not the contract's: every loaded store is checked through
// the control API after start, so a renamed file fails the phase instead
// of measuring an empty store.
const embeddedFile = "stopgate.db"

// Workers of the bulk loads: Redis serves many connections at once; the
// embedded store has one writer, so a few keep it busy.
const (
	redisLoadWorkers    = 64
	embeddedLoadWorkers = 4
)

// storedStore is one store loaded in advance and served by its own stopgate.
type storedStore struct {
	label string
	runs  int
	fat   bool
	redis *redisProc
	sg    *stopgate
}

// loadRecord is one bulk load, for the table that says how it was done
// (kept with a cached store).
type loadRecord struct {
	Store string        `json:"store"`
	What  string        `json:"what"`
	Count int           `json:"count"`
	Took  time.Duration `json:"took"`
	// Size is the Redis used_memory or the data file size it added.
	Size int64     `json:"size"`
	At   time.Time `json:"at"`
	// Cached: this run copied the store from the cache instead of loading it.
	Cached bool `json:"-"`
}

// storedPhase measures the per-request cost with few and with many runs
// already stored, and in a run that already holds many intents.
func (e *env) storedPhase(ctx context.Context) ([]*table, error) {
	var stores []*storedStore
	var loads []loadRecord
	defer func() {
		for _, s := range stores {
			if s.sg != nil {
				s.sg.stop()
			}
			if s.redis != nil {
				s.redis.stop()
			}
		}
	}()
	for _, spec := range []struct {
		redis bool
		runs  int
		fat   bool
	}{
		{true, e.cfg.StoredSmall, true}, {true, e.cfg.StoredLarge, false},
		{false, e.cfg.StoredSmall, true}, {false, e.cfg.StoredLargeEmbedded, false},
	} {
		s := &storedStore{runs: spec.runs, fat: spec.fat}
		stores = append(stores, s)
		var err error
		var recs []loadRecord
		if spec.redis {
			s.label = "Redis everysec"
			recs, err = e.loadRedis(ctx, s)
		} else {
			s.label = "embedded store"
			recs, err = e.loadEmbedded(ctx, s)
		}
		loads = append(loads, recs...)
		if err != nil {
			return nil, err
		}
	}

	type condition struct {
		store *storedStore
		run   func(rep int) string
		label string
		// reference is the store kind's row the others divide by; large
		// is the row the many-runs target reads.
		reference, large bool
	}
	var conds []condition
	for _, s := range stores {
		name := fmt.Sprintf("%s, %s runs stored", s.label, thousands(float64(s.runs)))
		fresh := func(rep int) string { return fmt.Sprintf("measured-r%d", rep) }
		conds = append(conds, condition{store: s, run: fresh, label: name + ", a new run", reference: s.fat, large: !s.fat})
		if s.fat {
			conds = append(conds, condition{store: s, run: func(int) string { return "fat" }, label: name + fmt.Sprintf(", a run holding %s intents", thousands(float64(e.cfg.FatIntents)))})
		}
	}
	results := make([][]loadResult, len(conds))
	conns := slices.Max(e.cfg.Conns)
	for rep := range e.cfg.Repeats {
		for ci, c := range conds {
			spec := loadSpec{Conns: conns, Method: http.MethodGet, URL: e.up.HTTPURL + "/small", Warmup: e.cfg.Warmup, Window: e.cfg.Window,
				Proxy: c.store.sg.proxyURL(c.run(rep)), RequireHeader: headerIntent, Watch: []int{c.store.sg.PID()}}
			if c.store.redis != nil {
				spec.Watch = append(spec.Watch, c.store.redis.PID())
			}
			res, err := runLoad(ctx, spec)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", c.label, err)
			}
			results[ci] = append(results[ci], res)
			e.cfg.logf("stored r%d: %-70s %8.0f req/s  errors %d", rep, c.label, res.rate(), res.Errors)
			if res.Errors > 0 {
				e.cfg.logf("    first error: %s", res.FirstError)
			}
		}
	}

	t := &table{
		title: fmt.Sprintf("Per-request cost with data already stored (HTTP GET, %d connections)", conns),
		header: []string{"condition", "req/s (min–max)", "× fewest stored", "p50", "p99",
			"proxy CPU µs/req", "redis CPU µs/req", "others' CPU", "errors"},
	}
	var ref []loadResult
	for ci, c := range conds {
		if c.reference {
			ref = results[ci]
		}
		s := summarize(results[ci], ref)
		if c.large {
			e.figures.set("stored-ratio/"+c.store.label, s.ratio.Median)
		}
		row := []string{c.label, rateCell(s.rate), ratioCell(s.ratio), dur(s.p50), dur(s.p99), micros(s.proxyCPU), "—", fmt.Sprintf("%.2f cores", s.others), fmt.Sprint(s.errors)}
		if c.store.redis != nil {
			row[6] = micros(s.redisCPU)
		}
		t.add(row...)
	}
	t.notes = append(t.notes, "Stored runs are finished runs (CANCELLED tombstones); the run holding intents is measured in place, so it grows during the repeats. "+
		"Ratios divide by the same store's fewest-runs row of the same repeat.")

	lt := &table{
		title:  "How the stored data was loaded (stopgate's own store code, in the bench process)",
		left:   2,
		header: []string{"store", "what", "count", "took", "per second", "Redis memory / file size added", "per item"},
	}
	cached := false
	for _, l := range loads {
		per := "—"
		if l.Count > 0 && l.Size > 0 {
			per = bytesCell(float64(l.Size) / float64(l.Count))
		}
		took := l.Took.Round(100 * time.Millisecond).String()
		if l.Cached {
			took += " (cached, " + l.At.Format("01-02 15:04") + ")"
			cached = true
		}
		lt.add(l.Store, l.What, thousands(float64(l.Count)), took,
			thousands(float64(l.Count)/l.Took.Seconds()), bytesCell(float64(l.Size)), per)
	}
	lt.notes = append(lt.notes, "Redis: concurrent store calls from 64 goroutines (the store's scripts, unchanged), then BGREWRITEAOF, awaited, before stopgate starts. "+
		"Embedded: the store's own transactions on a copy of the data file in "+e.scratchDir()+" (tmpfs: fsync costs nothing there), copied to disk before stopgate opens it.")
	if cached {
		lt.notes = append(lt.notes, "Cached: copied from "+e.cache.dir+", where the same store code (the cache key) loaded it at the time shown; -no-cache loads again.")
	}
	return []*table{t, lt}, nil
}

func (e *env) scratchDir() string {
	if e.cfg.ScratchDir != "" {
		return e.cfg.ScratchDir
	}
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		return "/dev/shm"
	}
	return e.dir
}

func (e *env) loadRedis(ctx context.Context, s *storedStore) ([]loadRecord, error) {
	name := fmt.Sprintf("redis-stored-%d", s.runs)
	dir := filepath.Join(e.dir, name)
	entry := fmt.Sprintf("redis-%d-%d", s.runs, s.fatIntents(e))
	recs, hit, err := e.cache.restore(entry, dir)
	if err != nil {
		return nil, err
	}
	// A restored million-run data set takes a while to load.
	if s.redis, err = startRedis(name, dir, redisserver.Options{AppendFsyncEverySec: true, StartTimeout: 5 * time.Minute}); err != nil {
		return nil, err
	}
	if hit {
		e.cfg.logf("stored: %s restored from the cache", entry)
		return e.startStored(ctx, s, "stopgate-"+name, s.redis.URL(), filepath.Join(e.dir, "data-"+name), cachedRecs(recs))
	}
	recs, err = e.fillRedis(ctx, s)
	if err != nil {
		return recs, err
	}
	if err := e.cache.save(entry, dir, recs); err != nil {
		return recs, err
	}
	return e.startStored(ctx, s, "stopgate-"+name, s.redis.URL(), filepath.Join(e.dir, "data-"+name), recs)
}

func (s *storedStore) fatIntents(e *env) int {
	if s.fat {
		return e.cfg.FatIntents
	}
	return 0
}

func cachedRecs(recs []loadRecord) []loadRecord {
	for i := range recs {
		recs[i].Cached = true
	}
	return recs
}

// startStored starts the stopgate of a loaded store and checks it sees the data.
func (e *env) startStored(ctx context.Context, s *storedStore, name, store, dataDir string, recs []loadRecord) ([]loadRecord, error) {
	var err error
	if s.sg, err = e.startStopgate(ctx, name, store, dataDir); err != nil {
		return recs, err
	}
	return recs, e.checkLoaded(ctx, s)
}

// fillRedis loads the store's runs (and intents) into its Redis, then lets
// the AOF rewrite finish.
func (e *env) fillRedis(ctx context.Context, s *storedStore) ([]loadRecord, error) {
	st, err := openRedisStore(ctx, s.redis.URL())
	if err != nil {
		return nil, err
	}
	defer st.Close()
	var recs []loadRecord
	measure := func(what string, n int, load func() error) error {
		e.cfg.logf("stored: loading %s %s into Redis", thousands(float64(n)), what)
		before, err := s.redis.usedMemory(ctx)
		if err != nil {
			return err
		}
		t0 := time.Now()
		if err := load(); err != nil {
			return err
		}
		took := time.Since(t0)
		after, err := s.redis.usedMemory(ctx)
		if err != nil {
			return err
		}
		recs = append(recs, loadRecord{Store: "Redis everysec", What: what, Count: n, Took: took, Size: after - before, At: time.Now()})
		return nil
	}
	if err := measure("finished runs", s.runs, func() error { return preloadRuns(ctx, st, "stored", s.runs, redisLoadWorkers) }); err != nil {
		return recs, err
	}
	if s.fat {
		if err := measure("intents in one run", e.cfg.FatIntents, func() error {
			return preloadIntents(ctx, st, "fat", e.up.HTTPURL+"/small", e.cfg.FatIntents, redisLoadWorkers)
		}); err != nil {
			return recs, err
		}
	}
	return recs, s.redis.settle(ctx)
}

func (e *env) loadEmbedded(ctx context.Context, s *storedStore) ([]loadRecord, error) {
	name := fmt.Sprintf("embedded-stored-%d", s.runs)
	dataDir := filepath.Join(e.dir, "data-"+name)
	entry := fmt.Sprintf("embedded-%d-%d", s.runs, s.fatIntents(e))
	recs, hit, err := e.cache.restore(entry, dataDir)
	if err != nil {
		return nil, err
	}
	if hit {
		e.cfg.logf("stored: %s restored from the cache", entry)
		return e.startStored(ctx, s, "stopgate-"+name, "", dataDir, cachedRecs(recs))
	}
	scratch, err := os.MkdirTemp(e.scratchDir(), "stopgate-bench-"+name+"-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(scratch)
	path := filepath.Join(scratch, embeddedFile)
	st, err := openEmbeddedStore(path)
	if err != nil {
		return nil, err
	}
	size := func() int64 {
		fi, err := os.Stat(path)
		if err != nil {
			return 0
		}
		return fi.Size()
	}
	measure := func(what string, n int, load func() error) error {
		e.cfg.logf("stored: loading %s %s into the embedded store", thousands(float64(n)), what)
		before, t0 := size(), time.Now()
		if err := load(); err != nil {
			return err
		}
		recs = append(recs, loadRecord{Store: "embedded", What: what, Count: n, Took: time.Since(t0), Size: size() - before, At: time.Now()})
		return nil
	}
	err = measure("finished runs", s.runs, func() error { return preloadRuns(ctx, st, "stored", s.runs, embeddedLoadWorkers) })
	if err == nil && s.fat {
		err = measure("intents in one run", e.cfg.FatIntents, func() error {
			return preloadIntents(ctx, st, "fat", e.up.HTTPURL+"/small", e.cfg.FatIntents, embeddedLoadWorkers)
		})
	}
	if cerr := st.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return recs, err
	}
	if err := e.cache.save(entry, scratch, recs); err != nil {
		return recs, err
	}
	if err := copyFile(path, filepath.Join(dataDir, embeddedFile)); err != nil {
		return recs, err
	}
	return e.startStored(ctx, s, "stopgate-"+name, "", dataDir, recs)
}

// checkLoaded asks the running stopgate for a loaded run, so that a store
// it did not open (or opened empty) fails the phase.
func (e *env) checkLoaded(ctx context.Context, s *storedStore) error {
	probes := []string{fmt.Sprintf("stored-%d", s.runs-1)}
	if s.fat {
		probes = append(probes, "fat")
	}
	for _, run := range probes {
		code, body, err := s.sg.control(ctx, http.MethodGet, "/v1/runs/"+run, "")
		if err != nil || code != http.StatusOK {
			return fmt.Errorf("%s: the loaded run %s is not in the store stopgate opened: %d %s %v", s.label, run, code, strings.TrimSpace(body), err)
		}
	}
	return nil
}

func copyFile(from, to string) error {
	if err := os.MkdirAll(filepath.Dir(to), 0o700); err != nil {
		return err
	}
	src, err := os.Open(from)
	if err != nil {
		return err
	}
	defer src.Close()
	dst, err := os.OpenFile(to, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(dst, src); err != nil {
		_ = dst.Close()
		return fmt.Errorf("copy %s: %w", from, err)
	}
	if err := dst.Sync(); err != nil {
		_ = dst.Close()
		return err
	}
	return dst.Close()
}
