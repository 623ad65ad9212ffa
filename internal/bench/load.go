package bench

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// requestTimeout bounds one request of the load generator, so that a stuck
// proxy ends a measurement with errors instead of hanging it.
const requestTimeout = 10 * time.Second

// loadSpec is one closed-loop measurement: Conns clients, each on its own
// keep-alive connection, each sending its next request as soon as the
// previous answer has been read.
type loadSpec struct {
	Conns int
	// Method is GET or POST; a POST sends Body.
	Method string
	Body   []byte
	// URL is the upstream address; each request adds ?i=N so that every
	// request is its own effect.
	URL string
	// Proxy is the proxy URL with the run's credentials; nil goes direct.
	Proxy *url.URL
	// ProxyFor, if set, gives connection conn (0 to Conns-1) a proxy URL
	// of its own, in place of Proxy: each connection its own run, as a
	// fleet with one agent per run sends.
	ProxyFor func(conn int) *url.URL
	// Roots verify HTTPS: the upstream's certificate, or a proxy's CA.
	Roots *x509.CertPool
	// RequireHeader, if set, must be on every answer: proof that the
	// request went through the guard rather than around it.
	RequireHeader string
	// Warmup runs before the measured window: connections open, TLS
	// handshakes, the run's first admission. The window also waits until
	// every connection has had its first answer, which is never measured.
	Warmup, Window time.Duration
	// Watch are the processes whose CPU time is read at both ends of the
	// measured window.
	Watch []int
}

// proxyFor is connection conn's proxy URL; nil goes direct.
func (s loadSpec) proxyFor(conn int) *url.URL {
	if s.ProxyFor != nil {
		return s.ProxyFor(conn)
	}
	return s.Proxy
}

// loadResult is what one measurement saw in its window.
type loadResult struct {
	Requests int
	Errors   int
	// FirstError describes the first failed request, if any.
	FirstError string
	Elapsed    time.Duration
	// Latencies of the requests completed in the window, sorted.
	Latencies []time.Duration
	// CPU used by each watched process in the window, in Watch order.
	CPU []time.Duration
	// Self is the CPU this process (load generator and upstream) used.
	Self time.Duration
	// Others is the CPU the rest of the machine used meanwhile.
	Others time.Duration
}

func (r loadResult) rate() float64 {
	if r.Elapsed <= 0 {
		return 0
	}
	return float64(r.Requests) / r.Elapsed.Seconds()
}

// perRequest is a CPU time per request of the window, in microseconds.
func (r loadResult) perRequest(d time.Duration) float64 {
	if r.Requests == 0 {
		return 0
	}
	return float64(d.Microseconds()) / float64(r.Requests)
}

type cpuSnapshot struct {
	procs   []time.Duration
	self    time.Duration
	machine time.Duration
}

func snapshot(pids []int) (cpuSnapshot, error) {
	var s cpuSnapshot
	for _, pid := range pids {
		d, err := cpuTime(pid)
		if err != nil {
			return s, err
		}
		s.procs = append(s.procs, d)
	}
	var err error
	if s.self, err = cpuTime(os.Getpid()); err != nil {
		return s, err
	}
	s.machine, err = machineCPU()
	return s, err
}

// runLoad drives spec and measures its window.
func runLoad(ctx context.Context, spec loadSpec) (loadResult, error) {
	if spec.Conns < 1 {
		return loadResult{}, fmt.Errorf("load: %d connections", spec.Conns)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		measuring atomic.Bool
		stop      atomic.Bool
		errCount  atomic.Int64
		firstErr  atomic.Pointer[string]
		wg        sync.WaitGroup
		// answered counts down the connections' first answers.
		answered sync.WaitGroup
	)
	perWorker := make([][]time.Duration, spec.Conns)
	answered.Add(spec.Conns)
	for w := range spec.Conns {
		proxy := spec.proxyFor(w)
		tr := &http.Transport{
			Proxy:               http.ProxyURL(proxy),
			TLSClientConfig:     &tls.Config{RootCAs: spec.Roots},
			MaxIdleConns:        1,
			MaxIdleConnsPerHost: 1,
			MaxConnsPerHost:     1,
			DisableCompression:  true,
			// HTTP/1.1 everywhere: one request at a time per connection.
			TLSNextProto: map[string]func(string, *tls.Conn) http.RoundTripper{},
		}
		if proxy == nil {
			tr.Proxy = nil
		}
		client := &http.Client{Transport: tr, Timeout: requestTimeout}
		wg.Go(func() {
			defer tr.CloseIdleConnections()
			firstAnswer := sync.OnceFunc(answered.Done)
			defer firstAnswer()
			lat := make([]time.Duration, 0, 4096)
			prefix := spec.URL + "?i=" + strconv.Itoa(w) + "-"
			for seq := 0; !stop.Load() && ctx.Err() == nil; seq++ {
				start := time.Now()
				err := oneRequest(ctx, client, spec, prefix+strconv.Itoa(seq))
				took := time.Since(start)
				if seq == 0 {
					// The first request opens the connection and admits
					// its run: warm-up, however long the warm-up lasted.
					firstAnswer()
					continue
				}
				if !measuring.Load() {
					continue
				}
				if err != nil {
					if errCount.Add(1) == 1 {
						msg := err.Error()
						firstErr.Store(&msg)
					}
					continue
				}
				lat = append(lat, took)
			}
			perWorker[w] = lat
		})
	}
	finish := func() { stop.Store(true); wg.Wait() }
	// The warm-up ends after its time and after every connection's first
	// answer: with a run per connection, each run is admitted before the
	// window. Every first request ends within requestTimeout, so the wait
	// is bounded even when the warm-up is too short for them.
	warmedUp := make(chan struct{})
	go func() {
		time.Sleep(spec.Warmup)
		answered.Wait()
		close(warmedUp)
	}()
	select {
	case <-warmedUp:
	case <-ctx.Done():
		finish()
		return loadResult{}, ctx.Err()
	}
	before, err := snapshot(spec.Watch)
	if err != nil {
		finish()
		return loadResult{}, err
	}
	t0 := time.Now()
	measuring.Store(true)
	select {
	case <-time.After(spec.Window):
	case <-ctx.Done():
	}
	measuring.Store(false)
	elapsed := time.Since(t0)
	after, serr := snapshot(spec.Watch)
	finish()
	if err := ctx.Err(); err != nil {
		return loadResult{}, err
	}
	if serr != nil {
		return loadResult{}, serr
	}
	res := loadResult{Elapsed: elapsed, Errors: int(errCount.Load()), Self: after.self - before.self}
	if p := firstErr.Load(); p != nil {
		res.FirstError = *p
	}
	for _, l := range perWorker {
		res.Latencies = append(res.Latencies, l...)
	}
	slices.Sort(res.Latencies)
	res.Requests = len(res.Latencies)
	var ours time.Duration
	for i := range spec.Watch {
		d := after.procs[i] - before.procs[i]
		res.CPU = append(res.CPU, d)
		ours += d
	}
	res.Others = max(0, after.machine-before.machine-ours-res.Self)
	return res, nil
}

var errStatus = errors.New("unexpected answer")

func oneRequest(ctx context.Context, client *http.Client, spec loadSpec, target string) error {
	var body io.Reader
	if spec.Method == http.MethodPost {
		body = bytes.NewReader(spec.Body)
	}
	req, err := http.NewRequestWithContext(ctx, spec.Method, target, body)
	if err != nil {
		return err
	}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	_, cerr := io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%w: %s (%s)", errStatus, resp.Status, resp.Header.Get("X-Stopgate-Refusal"))
	}
	if spec.RequireHeader != "" && resp.Header.Get(spec.RequireHeader) == "" {
		return fmt.Errorf("%w: no %s header: the request was not guarded", errStatus, spec.RequireHeader)
	}
	return cerr
}

// driveRequests sends n requests of spec from spec.Conns clients, as fast
// as they are answered; the first failure ends it.
func driveRequests(ctx context.Context, spec loadSpec, n int) error {
	var next atomic.Int64
	errs := make(chan error, spec.Conns)
	var wg sync.WaitGroup
	for w := range spec.Conns {
		tr := &http.Transport{
			Proxy:               http.ProxyURL(spec.proxyFor(w)),
			TLSClientConfig:     &tls.Config{RootCAs: spec.Roots},
			MaxIdleConnsPerHost: 1,
			MaxConnsPerHost:     1,
			DisableCompression:  true,
			TLSNextProto:        map[string]func(string, *tls.Conn) http.RoundTripper{},
		}
		client := &http.Client{Transport: tr, Timeout: requestTimeout}
		wg.Go(func() {
			defer tr.CloseIdleConnections()
			prefix := spec.URL + "?i=" + strconv.Itoa(w) + "-"
			for seq := 0; ctx.Err() == nil && next.Add(1) <= int64(n); seq++ {
				if err := oneRequest(ctx, client, spec, prefix+strconv.Itoa(seq)); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	return <-errs
}
