package bench

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// Bounds of one cancel round: streams must open, and be cut, within these.
const (
	openTimeout = 10 * time.Second
	cutTimeout  = 10 * time.Second
)

// stream is one open connection of a run, held until stopgate cuts it.
type stream struct {
	kind  string
	inst  int
	ended time.Time
	// clean is an end of body without an error: the contract says a cut
	// is always an error for the client.
	clean bool
	err   error
}

// cancelPhase measures how long after a cancel is acknowledged the last
// open connection of the run, on any of three stopgate instances sharing
// one Redis, sees its cut.
func (e *env) cancelPhase(ctx context.Context, p *mainProcs) (*table, error) {
	insts := []*stopgate{p.sgEverysec}
	for i := 2; i <= 3; i++ {
		s, err := e.startStopgate(ctx, fmt.Sprintf("stopgate-everysec-%d", i), p.everysec.URL(), filepath.Join(e.dir, fmt.Sprintf("data-everysec-%d", i)))
		if err != nil {
			return nil, err
		}
		defer s.stop()
		insts = append(insts, s)
	}
	e.cfg.logf("cancel → cut: %d cancels, each of a run with 3 streams (HTTP SSE, HTTPS SSE through MITM, SSE in a pass-through tunnel) on each of 3 instances", e.cfg.Cancels)
	var fromAck, fromSend []time.Duration
	clean, uncut := map[string]int{}, 0
	for i := range e.cfg.Cancels {
		r, err := e.cancelRound(ctx, insts, fmt.Sprintf("cancel-%d", i), insts[i%len(insts)])
		if err != nil {
			return nil, fmt.Errorf("cancel round %d: %w", i, err)
		}
		fromAck = append(fromAck, r.lastCut.Sub(r.ack))
		fromSend = append(fromSend, r.lastCut.Sub(r.sent))
		for k, n := range r.clean {
			clean[k] += n
		}
		uncut += r.uncut
	}
	sortDurations(fromAck)
	sortDurations(fromSend)
	pct := func(ds []time.Duration, q float64) string { return signedDur(percentile(ds, q)) }
	e.figures.set("cancel-p99", percentile(fromAck, 99).Seconds())
	t := &table{
		title:  "Cancel → last cut connection, 3 stopgate instances on one Redis (everysec)",
		header: []string{"measured from", "p50", "p99", "max", "cancels", "connections per cancel", "clean ends (should be 0)", "not cut within 10 s"},
	}
	n := fmt.Sprint(len(fromAck))
	cleanCell := "0"
	if len(clean) > 0 {
		var parts []string
		for _, k := range []string{"http", "mitm", "tunnel"} {
			if clean[k] > 0 {
				parts = append(parts, fmt.Sprintf("%d %s", clean[k], streamName(k)))
			}
		}
		cleanCell = strings.Join(parts, ", ")
	}
	t.add("cancel acknowledged (202 read)", pct(fromAck, 50), pct(fromAck, 99), pct(fromAck, 100), n, "9", cleanCell, fmt.Sprint(uncut))
	t.add("cancel sent", pct(fromSend, 50), pct(fromSend, 99), pct(fromSend, 100), n, "9", "", "")
	t.notes = append(t.notes, "Each run holds, on each instance, an HTTP SSE stream, an HTTPS SSE stream through the MITM and an SSE stream inside a pass-through tunnel, "+
		"all open and past their first event; the cancel goes to one instance's control API (round robin). A negative time means every connection was cut before the 202 reached the client.")
	return t, nil
}

// streamName names the kinds of stream in the table.
func streamName(kind string) string {
	switch kind {
	case "http":
		return "HTTP SSE"
	case "mitm":
		return "HTTPS SSE (MITM)"
	}
	return "tunnel"
}

type roundResult struct {
	sent, ack, lastCut time.Time
	uncut              int
	// clean counts clean ends by stream kind.
	clean map[string]int
}

func (e *env) cancelRound(ctx context.Context, insts []*stopgate, run string, via *stopgate) (roundResult, error) {
	ctx, cancel := context.WithTimeout(ctx, openTimeout+cutTimeout+10*time.Second)
	defer cancel()
	var streams []*stream
	var wg sync.WaitGroup
	opened := make(chan error, 3*len(insts))
	for i, inst := range insts {
		for _, kind := range []string{"http", "mitm", "tunnel"} {
			s := &stream{kind: kind, inst: i}
			streams = append(streams, s)
			u, roots := e.up.HTTPURL, inst.roots
			switch kind {
			case "mitm":
				u = e.up.HTTPSURL
			case "tunnel":
				u, roots = e.up.TunnelURL, e.up.Roots
			}
			wg.Go(func() { s.hold(ctx, inst.proxyURL(run), u+"/sse", roots, kind != "tunnel", opened) })
		}
	}
	for range streams {
		if err := <-opened; err != nil {
			cancel()
			wg.Wait()
			return roundResult{}, err
		}
	}
	r := roundResult{sent: time.Now(), clean: map[string]int{}}
	code, body, err := via.control(ctx, http.MethodPost, "/v1/runs/"+run+"/cancel", `{"reason":"stopgate-bench cut latency"}`)
	r.ack = time.Now()
	if err != nil || code != http.StatusAccepted {
		cancel()
		wg.Wait()
		return r, fmt.Errorf("cancel %s: %d %s %v", run, code, strings.TrimSpace(body), err)
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(cutTimeout):
		cancel()
		<-done
	}
	for _, s := range streams {
		switch {
		case errors.Is(s.err, context.Canceled):
			r.uncut++
		case s.clean:
			r.clean[s.kind]++
		}
		if s.ended.After(r.lastCut) {
			r.lastCut = s.ended
		}
	}
	return r, nil
}

// hold opens the stream, reports when its first event has arrived, then
// reads until the connection ends.
func (s *stream) hold(ctx context.Context, proxy *url.URL, target string, roots *x509.CertPool, guarded bool, opened chan<- error) {
	tr := &http.Transport{
		Proxy:             http.ProxyURL(proxy),
		TLSClientConfig:   &tls.Config{RootCAs: roots},
		DisableKeepAlives: true,
		TLSNextProto:      map[string]func(string, *tls.Conn) http.RoundTripper{},
	}
	defer tr.CloseIdleConnections()
	// The open deadline applies until the first event; the stream itself
	// lives until ctx ends.
	rctx, rcancel := context.WithCancel(ctx)
	defer rcancel()
	openDeadline := time.AfterFunc(openTimeout, rcancel)
	fail := func(err error) {
		openDeadline.Stop()
		opened <- fmt.Errorf("open %s stream: %w", s.kind, err)
	}
	req, err := http.NewRequestWithContext(rctx, http.MethodGet, target, nil)
	if err != nil {
		fail(err)
		return
	}
	resp, err := tr.RoundTrip(req)
	if err != nil {
		fail(err)
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || (guarded && resp.Header.Get(headerIntent) == "") {
		fail(fmt.Errorf("%s, %s=%q", resp.Status, headerIntent, resp.Header.Get(headerIntent)))
		return
	}
	br := bufio.NewReader(resp.Body)
	line, err := br.ReadString('\n')
	if !openDeadline.Stop() {
		fail(fmt.Errorf("no first event within %s", openTimeout))
		return
	}
	if err != nil || !strings.HasPrefix(line, "data:") {
		fail(fmt.Errorf("first event %q: %v", line, err))
		return
	}
	opened <- nil
	_, err = io.Copy(io.Discard, br)
	s.ended = time.Now()
	s.err = err
	s.clean = err == nil
	if ctx.Err() != nil {
		s.err = context.Canceled
	}
}
