package main

import (
	"bufio"
	"bytes"
	"encoding/base64"
	"fmt"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestLoadHeldConnections measures what a stopgate process holds while
// clients hold connections open and say nothing: 2 000 CONNECTs that never
// start their TLS handshake, then 2 000 request bodies trickling a byte a
// second. It prints the serve process's resident memory and open file
// descriptors at each step, with the default caps and with caps raised
// past the load. It is an instrument, run by hand (make load), not part of
// make test; what it asserts is that the descriptors stay under the cap
// and come back once the clients are let go — never how fast.
func TestLoadHeldConnections(t *testing.T) {
	if os.Getenv("STOPGATE_LOAD") == "" {
		t.Skip("set STOPGATE_LOAD=1 (make load) to measure held connections")
	}
	n := 2000
	if v := os.Getenv("STOPGATE_LOAD_CONNS"); v != "" {
		n, _ = strconv.Atoi(v)
	}
	up, _ := upstreamCounter(t)
	for _, tc := range []struct {
		name string
		args []string
		cap  int
	}{
		{"default caps (--max-conns 1024, --max-conns-per-run 256)", nil, 1024},
		{"caps raised past the load (--max-conns 4096, --max-conns-per-run 4096)", []string{"--max-conns", "4096", "--max-conns-per-run", "4096"}, 4096},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := startServe(t, append([]string{"--data-dir", t.TempDir(), "--log-level", "warn"}, tc.args...)...)
			pid := s.Pid()
			var rows []string
			measure := func(phase string, held, accepted, refused int) {
				rss, hwm, fds := procStats(t, pid)
				rows = append(rows, fmt.Sprintf("%-44s %6d %8d %8d %9.1f %9.1f %6d", phase, held, accepted, refused, rss, hwm, fds))
				if fds > tc.cap+200 {
					t.Errorf("%s: %d descriptors open, past the cap of %d exchanges", phase, fds, tc.cap)
				}
			}
			measure("baseline", 0, 0, 0)

			// 2 000 CONNECTs to an intercepted host, then silence.
			conns, accepted, refused := openMany(t, s.proxyAddr(), n, func(i int) string {
				return fmt.Sprintf("CONNECT %s HTTP/1.1\r\nHost: x\r\nProxy-Authorization: %s\r\n\r\n",
					up.Listener.Addr(), basic(fmt.Sprintf("idle-%d:1", i)))
			}, http.MethodConnect)
			measure(fmt.Sprintf("%d idle CONNECTs held by the clients", n), len(conns), accepted, refused)
			waitFor(t, 60*time.Second, "the proxy lets the silent tunnels go", func() bool { return openFDs(pid) < 100 })
			measure("after --tunnel-handshake-timeout (10s)", len(conns), 0, 0)
			closeAll(conns)

			// 2 000 POSTs of 1 MB whose bodies come a byte a second.
			conns, accepted, refused = openMany(t, s.proxyAddr(), n, func(i int) string {
				return fmt.Sprintf("POST %s/upload HTTP/1.1\r\nHost: %s\r\nProxy-Authorization: %s\r\nContent-Length: 1000000\r\n\r\n0123456789",
					up.URL, up.Listener.Addr(), basic(fmt.Sprintf("slow-%d:1", i)))
			}, http.MethodPost)
			stop := trickle(conns)
			time.Sleep(15 * time.Second)
			measure(fmt.Sprintf("%d slow bodies, 15s at a byte a second", n), len(conns), accepted, refused)
			stop()
			closeAll(conns)
			waitFor(t, 60*time.Second, "the proxy lets the closed clients go", func() bool { return openFDs(pid) < 100 })
			measure("after the clients closed", 0, 0, 0)

			t.Logf("serve pid %d, %s\n%-44s %6s %8s %8s %9s %9s %6s\n%s", pid, tc.name,
				"phase", "conns", "200", "429", "RSS MiB", "peak MiB", "fds", strings.Join(rows, "\n"))
		})
	}
}

func basic(userpass string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(userpass))
}

// openMany opens n connections to the proxy and sends each its request
// head; an answer that comes within a few seconds is a refusal (or, for a
// CONNECT, the 200 that opens the tunnel), otherwise the proxy is holding it.
func openMany(t *testing.T, addr string, n int, head func(i int) string, method string) (conns []net.Conn, accepted, refused int) {
	t.Helper()
	var ok, no atomic.Int64
	var wg sync.WaitGroup
	for i := range n {
		c, err := net.DialTimeout("tcp", addr, 10*time.Second)
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		conns = append(conns, c)
		if _, err := c.Write([]byte(head(i))); err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		wg.Go(func() {
			_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
			resp, err := http.ReadResponse(bufio.NewReader(c), &http.Request{Method: method})
			_ = c.SetReadDeadline(time.Time{})
			switch {
			case err != nil:
			case resp.StatusCode == http.StatusTooManyRequests:
				no.Add(1)
			case resp.StatusCode == http.StatusOK:
				ok.Add(1)
			}
		})
	}
	wg.Wait()
	return conns, int(ok.Load()), int(no.Load())
}

// trickle sends a byte a second on every connection until stopped.
func trickle(conns []net.Conn) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				for _, c := range conns {
					_ = c.SetWriteDeadline(time.Now().Add(10 * time.Millisecond))
					_, _ = c.Write([]byte("x"))
				}
			}
		}
	})
	return func() { close(done); wg.Wait() }
}

func closeAll(conns []net.Conn) {
	for _, c := range conns {
		_ = c.Close()
	}
}

func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %s: %s", d, what)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// procStats reads a process's resident memory and its peak (MiB) and its
// open descriptors from /proc.
func procStats(t *testing.T, pid int) (rss, hwm float64, fds int) {
	t.Helper()
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatalf("read /proc: %v", err)
	}
	for _, line := range bytes.Split(status, []byte("\n")) {
		f := strings.Fields(string(line))
		if len(f) < 2 {
			continue
		}
		kb, _ := strconv.ParseFloat(f[1], 64)
		switch f[0] {
		case "VmRSS:":
			rss = kb / 1024
		case "VmHWM:":
			hwm = kb / 1024
		}
	}
	return rss, hwm, openFDs(pid)
}

func openFDs(pid int) int {
	entries, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return -1
	}
	return len(entries)
}

// TestLoadOversizedHeaders measures what 100 intercepted tunnels cost the
// proxy when each sends one request whose header line never ends (8 MB,
// written as fast as the proxy takes it): the header bound inside a tunnel
// is the proxy listener's (a 431 past 64 KiB), so the peak is that of 100
// tunnels, not of 800 MB of headers.
func TestLoadOversizedHeaders(t *testing.T) {
	if os.Getenv("STOPGATE_LOAD") == "" {
		t.Skip("set STOPGATE_LOAD=1 (make load) to measure oversized headers")
	}
	const tunnels, lineBytes = 100, 8 << 20
	up, _ := upstreamCounter(t)
	s := startServe(t, "--data-dir", t.TempDir(), "--log-level", "warn")
	pid := s.Pid()
	rss0, hwm0, _ := procStats(t, pid)
	conns, accepted, _ := openMany(t, s.proxyAddr(), tunnels, func(i int) string {
		return fmt.Sprintf("CONNECT %s HTTP/1.1\r\nHost: x\r\nProxy-Authorization: %s\r\n\r\n", up.Listener.Addr(), basic(fmt.Sprintf("big-%d:1", i)))
	}, http.MethodConnect)
	if accepted != tunnels {
		t.Fatalf("%d of %d CONNECTs accepted", accepted, tunnels)
	}
	chunk := bytes.Repeat([]byte("a"), 64<<10)
	var sent atomic.Int64
	var wg sync.WaitGroup
	for _, c := range conns {
		wg.Go(func() {
			_ = c.SetWriteDeadline(time.Now().Add(60 * time.Second))
			if _, err := fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: %s\r\nX-Big: ", up.Listener.Addr()); err != nil {
				return
			}
			for n := 0; n < lineBytes; n += len(chunk) {
				if _, err := c.Write(chunk); err != nil {
					return
				}
				sent.Add(int64(len(chunk)))
			}
		})
	}
	wg.Wait()
	rss, hwm, fds := procStats(t, pid)
	closeAll(conns)
	t.Logf("serve pid %d: %d tunnels, each an %d MiB header line; %d MiB taken by the proxy in all\n"+
		"before: RSS %.1f MiB, peak %.1f MiB\nafter:  RSS %.1f MiB, peak %.1f MiB, %d descriptors",
		pid, tunnels, lineBytes>>20, sent.Load()>>20, rss0, hwm0, rss, hwm, fds)
	if hwm-hwm0 > 200 {
		t.Errorf("100 oversized headers raised the peak by %.0f MiB", hwm-hwm0)
	}
}
