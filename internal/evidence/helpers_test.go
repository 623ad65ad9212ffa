package evidence_test

import (
	"bufio"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/evidence"
	"github.com/stopgate/stopgate/internal/faultnet"
	"github.com/stopgate/stopgate/internal/redisserver"
)

// startRedis starts a redis-server; with fsyncAlways its AOF is fsynced on
// every write, which the cases that kill Redis need (the others do without:
// the fsyncs would only load the disk that other packages' tests share).
func startRedis(t *testing.T, fsyncAlways bool) *redisserver.Server {
	return redisserver.Start(t, redisserver.Options{AppendFsyncAlways: fsyncAlways})
}

func startRelay(t *testing.T, target string) *faultnet.Relay {
	r, err := faultnet.Listen(target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	return r
}

// conn is an open connection of a run (a tunnel or a stream) whose end the
// test waits for.
type conn struct {
	ended chan struct{}
	err   atomic.Value // error that ended it
}

// cutWithin waits up to d for the connection to end and says how long it
// took from the call, or -1 if it did not end.
func (c *conn) cutWithin(d time.Duration) time.Duration {
	start := time.Now()
	select {
	case <-c.ended:
		return time.Since(start)
	case <-time.After(d):
		return -1
	}
}

// cut is how long a connection of a cancelled run took to be cut after
// the cancel, as cutWithin measures it (negative: never).
type cut struct {
	what  string
	after time.Duration
}

// judgeCuts judges the connections a cancel must cut: each is expected
// cut, one that never was is a leak (of the connections leak names), and
// the round recovered once the last was cut.
func judgeCuts(r *evidence.Round, leak string, cuts ...cut) {
	leaked := false
	r.Recover = cuts[0].after
	for _, c := range cuts {
		expect(r, c.after >= 0, "%s is cut", c.what)
		leaked = leaked || c.after < 0
		r.Recover = max(r.Recover, c.after)
	}
	if leaked {
		r.Fail(&r.Leaked, "%s still carried bytes 10s after its cancel", leak)
	}
}

// openTunnel opens a CONNECT tunnel through the proxy to dest (a
// pass-through host) as run, at version 1, and keeps bytes flowing through
// it until it is cut. An answer other than 200 is an error naming it.
func openTunnel(proxy, run, dest string) (*conn, error) {
	c, err := net.DialTimeout("tcp", proxy, 5*time.Second)
	if err != nil {
		return nil, err
	}
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	auth := base64.StdEncoding.EncodeToString([]byte(run + ":1"))
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\nProxy-Authorization: Basic %s\r\n\r\n", dest, dest, auth)
	rd := bufio.NewReader(c)
	resp, err := http.ReadResponse(rd, &http.Request{Method: http.MethodConnect})
	if err != nil {
		_ = c.Close()
		return nil, err
	}
	if resp.StatusCode != 200 {
		_ = c.Close()
		return nil, fmt.Errorf("CONNECT answered %d %s", resp.StatusCode, resp.Header.Get("X-Stopgate-Refusal"))
	}
	_ = c.SetDeadline(time.Time{})
	if _, err := io.WriteString(c, "ping\n"); err != nil {
		return nil, err
	}
	if line, err := rd.ReadString('\n'); err != nil || line != "ping\n" {
		return nil, fmt.Errorf("through the tunnel: %q, %v", line, err)
	}
	t := &conn{ended: make(chan struct{})}
	go func() {
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for range tick.C {
			if _, err := io.WriteString(c, "ping\n"); err != nil {
				return
			}
		}
	}()
	go func() {
		defer close(t.ended)
		defer c.Close()
		_, err := io.Copy(io.Discard, rd)
		if err == nil {
			err = io.EOF
		}
		t.err.Store(err)
	}()
	return t, nil
}

// openStream opens a streamed GET through the instance as run and reads it
// until it ends.
func openStream(ctx context.Context, sg *evidence.Stopgate, up *evidence.Upstream, run, key string) (*conn, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, up.URL()+"/stream/"+run+"/"+key, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Idempotency-Key", key)
	hc := sg.Agent(run, 1)
	hc.Timeout = 0
	resp, err := hc.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != 200 {
		resp.Body.Close()
		return nil, fmt.Errorf("stream answered %d %s", resp.StatusCode, resp.Header.Get("X-Stopgate-Refusal"))
	}
	rd := bufio.NewReader(resp.Body)
	if _, err := rd.ReadString('\n'); err != nil {
		resp.Body.Close()
		return nil, err
	}
	s := &conn{ended: make(chan struct{})}
	go func() {
		defer close(s.ended)
		defer resp.Body.Close()
		_, err := io.Copy(io.Discard, rd)
		if err == nil {
			err = io.EOF
		}
		s.err.Store(err)
	}()
	return s, nil
}

// mustStream opens run's stream (key RUN-stream) through sg, and logs it
// as the 200 it answered; a stream that does not open ends the test.
func mustStream(t *testing.T, ctx context.Context, sg *evidence.Stopgate, up *evidence.Upstream, log *attempts, run string) *conn {
	t.Helper()
	s, err := openStream(ctx, sg, up, run, run+"-stream")
	if err != nil {
		t.Fatalf("stream: %v", err)
	}
	log.add(evidence.Attempt{Run: run, Key: run + "-stream", Started: time.Now(), Status: 200})
	return s
}

// mountTmpfs mounts a tmpfs of the given size for the test (root only);
// without one the case cannot run, and says why.
func mountTmpfs(t *testing.T, size string) string {
	dir := filepath.Join(t.TempDir(), "mnt")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size="+size+",mode=0700", "tmpfs", dir).CombinedOutput()
	if err != nil {
		panic(skipCase(fmt.Sprintf("cannot mount a %s tmpfs to fill (needs root): %v: %s", size, err, strings.TrimSpace(string(out)))))
	}
	t.Cleanup(func() {
		if out, err := exec.Command("umount", "-l", dir).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v: %s", dir, err, out)
		}
	})
	return dir
}

// fill writes a file into dir until the file system is full, and returns
// its path; removing it frees the space.
func fill(t *testing.T, dir string) string {
	path := filepath.Join(dir, "filler")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 64<<10)
	for {
		if _, err := f.Write(buf); err != nil {
			if !errors.Is(err, os.ErrNotExist) && strings.Contains(err.Error(), "no space") {
				return path
			}
			t.Fatalf("filling %s: %v", dir, err)
		}
	}
}
