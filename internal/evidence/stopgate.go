package evidence

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/control/client"
	"github.com/stopgate/stopgate/internal/testkit"
)

// Config is how a stopgate instance is started.
type Config struct {
	// Store is the --store URL; empty: the embedded store in DataDir.
	Store string
	// DataDir is --data-dir; empty: a fresh temporary directory.
	DataDir string
	// Flags are more `stopgate serve` flags.
	Flags []string
}

// Stopgate is one `stopgate serve` process, driven as an operator and an
// agent would: its proxy and its control API on loopback.
type Stopgate struct {
	*testkit.Process
	t     testing.TB
	bin   string
	env   []string
	token string

	// Proxy, Control and Browser are the listeners' host:port.
	Proxy, Control, Browser string
	DataDir                 string
}

// Start starts an instance on ports of its own choosing (its ready file
// says which) and waits until its control API answers; it is killed when
// the test ends.
func Start(t testing.TB, bin string, cfg Config) *Stopgate {
	t.Helper()
	if cfg.DataDir == "" {
		cfg.DataDir = t.TempDir()
	}
	s := &Stopgate{t: t, bin: bin, token: randomHex(16), DataDir: cfg.DataDir}
	args := []string{"--data-dir", cfg.DataDir}
	if cfg.Store != "" {
		args = append(args, "--store", cfg.Store)
	}
	args = append(args, cfg.Flags...)
	// The token is given through the environment, where both the current
	// and the coming serve read it; loopback upstreams are allowed the same
	// way (STOPGATE_ALLOW_DEST), which a serve without that flag ignores.
	s.env = append(testkit.CleanEnv(), "STOPGATE_CONTROL_TOKEN="+s.token, "STOPGATE_ALLOW_DEST=127.0.0.1")
	s.Process = testkit.StartServe(t, bin, args, s.env, "")
	s.Proxy, s.Control, s.Browser = s.Bound.Proxy, s.Bound.Control, s.Bound.Browser
	return s
}

// Restart starts the process again with the same flags, ports and data.
func (s *Stopgate) Restart() {
	s.t.Helper()
	s.Kill9()
	s.Start()
}

// API is a control API client with the instance's operator token.
func (s *Stopgate) API() *client.Client {
	c, err := client.New("http://"+s.Control, client.Options{Token: s.token, Actor: "operator:evidence", HTTPClient: &http.Client{Timeout: 15 * time.Second}})
	if err != nil {
		s.t.Fatal(err)
	}
	return c
}

// CLI runs a client verb of the stopgate binary (`stopgate ARGS...`) on
// this instance, with its control URL and operator token, and returns what
// it printed (standard output and error together).
func (s *Stopgate) CLI(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, s.bin, args...)
	cmd.Env = append(append([]string(nil), s.env...), "STOPGATE_CONTROL=http://"+s.Control)
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("stopgate %s: %w: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return string(out), nil
}

// Audit reads a run's record through the control API.
func (s *Stopgate) Audit(ctx context.Context, run string) (control.Audit, error) {
	r, err := s.API().Audit(ctx, run)
	return r.Value, err
}

// Agent is an HTTP client that uses the instance as its proxy under a run,
// at the version the worker observed. Keep-alives are off: every request
// is its own connection, as a crash test needs.
func (s *Stopgate) Agent(run string, version int) *http.Client {
	proxy := &url.URL{Scheme: "http", User: url.UserPassword(run, fmt.Sprint(version)), Host: s.Proxy}
	return &http.Client{
		Transport: &http.Transport{Proxy: http.ProxyURL(proxy), DisableKeepAlives: true},
		Timeout:   20 * time.Second,
	}
}

// Post sends one effect of run through the instance: a POST to
// up/kind/RUN/KEY with Idempotency-Key KEY, and says what the client saw.
func (s *Stopgate) Post(ctx context.Context, up *Upstream, kind, run, key string) Attempt {
	a := Attempt{Run: run, Key: key, Started: time.Now()}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, fmt.Sprintf("%s/%s/%s/%s", up.URL(), kind, run, key), strings.NewReader("amount=1"))
	if err != nil {
		a.Err = err
		return a
	}
	req.Header.Set("Idempotency-Key", key)
	resp, err := s.Agent(run, 1).Do(req)
	if err != nil {
		a.Err, a.Ended = err, time.Now()
		return a
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	a.Ended = time.Now()
	a.SetAnswer(resp, bytes.TrimSpace(body))
	return a
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
