package bench

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/stopgate/stopgate/internal/redisserver"
)

// Bounds of starting and stopping the processes under test.
const (
	startTimeout = 30 * time.Second
	stopTimeout  = 15 * time.Second
)

// child is one process the instrument started; its output goes to a log
// file whose tail explains a failure.
type child struct {
	name    string
	cmd     *exec.Cmd
	logPath string
	done    chan struct{}
}

func startChild(name, dir string, env []string, bin string, args ...string) (*child, error) {
	logPath := filepath.Join(dir, name+".log")
	logf, err := os.Create(logPath)
	if err != nil {
		return nil, fmt.Errorf("%s log: %w", name, err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		_ = logf.Close()
		return nil, fmt.Errorf("start %s (%s): %w", name, bin, err)
	}
	c := &child{name: name, cmd: cmd, logPath: logPath, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); _ = logf.Close(); close(c.done) }()
	return c, nil
}

func (c *child) PID() int { return c.cmd.Process.Pid }

func (c *child) exited() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// stop asks the process to end (SIGTERM) and kills it if it has not
// within stopTimeout.
func (c *child) stop() {
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.done:
	case <-time.After(stopTimeout):
		_ = c.cmd.Process.Kill()
		<-c.done
	}
}

// tail is the end of the process's log, for error messages.
func (c *child) tail() string {
	b, err := os.ReadFile(c.logPath)
	if err != nil {
		return "(no log: " + err.Error() + ")"
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > 15 {
		lines = lines[len(lines)-15:]
	}
	return strings.Join(lines, "\n")
}

// baseline is the plain goproxy process.
type baseline struct {
	*child
	addr  string
	roots *x509.CertPool
}

func startBaseline(ctx context.Context, bin, dir, upstreamCert string) (*baseline, error) {
	caFile := filepath.Join(dir, "plain-goproxy-ca.pem")
	c, err := startChild("plain-goproxy", dir, []string{"SSL_CERT_FILE=" + upstreamCert}, bin, "-addr", "127.0.0.1:0", "-ca-out", caFile)
	if err != nil {
		return nil, err
	}
	deadline := time.Now().Add(startTimeout)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		if c.exited() {
			return nil, fmt.Errorf("plain-goproxy exited at start:\n%s", c.tail())
		}
		if addr := firstLineAddr(c.logPath); addr != "" {
			pem, err := os.ReadFile(caFile)
			if err != nil {
				c.stop()
				return nil, fmt.Errorf("plain-goproxy CA: %w", err)
			}
			roots := x509.NewCertPool()
			roots.AppendCertsFromPEM(pem)
			return &baseline{child: c, addr: addr, roots: roots}, nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	c.stop()
	return nil, fmt.Errorf("plain-goproxy did not start within %s:\n%s", startTimeout, c.tail())
}

func firstLineAddr(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	line, err := bufio.NewReader(f).ReadString('\n')
	if err != nil {
		return ""
	}
	addr, ok := strings.CutPrefix(strings.TrimSpace(line), "listening ")
	if !ok {
		return ""
	}
	return addr
}

// stopgateOpts say how to start one stopgate serve.
type stopgateOpts struct {
	Name string
	// Store is a redis:// URL; empty is the embedded store in DataDir.
	Store   string
	DataDir string
	// Config is the YAML policy file.
	Config string
	// UpstreamCert is trusted for upstream TLS (SSL_CERT_FILE).
	UpstreamCert string
	// AllowDest asks for --allow-dest 127.0.0.1 (loopback upstreams).
	AllowDest bool
}

// errNoAllowDest: the binary does not know --allow-dest.
var errNoAllowDest = errors.New("stopgate serve has no --allow-dest flag")

// stopgate is one running stopgate serve.
type stopgate struct {
	*child
	proxyAddr, controlAddr string
	token                  string
	roots                  *x509.CertPool
	ctl                    *http.Client
}

func startStopgate(ctx context.Context, bin, logDir string, o stopgateOpts) (*stopgate, error) {
	tokenBytes := make([]byte, 16)
	_, _ = rand.Read(tokenBytes)
	token := hex.EncodeToString(tokenBytes)
	var lastErr error
	// A port picked free may be taken before serve binds it: try again.
	for range 3 {
		// Three different ports: a port let go of may be handed out again
		// at once, and serve refuses two listeners on one address.
		var ports []int
		for range 30 {
			p, err := redisserver.FreePort()
			if err != nil {
				return nil, err
			}
			if !slices.Contains(ports, p) {
				ports = append(ports, p)
			}
			if len(ports) == 3 {
				break
			}
		}
		if len(ports) < 3 {
			return nil, fmt.Errorf("%s: no three different free ports in 30 tries", o.Name)
		}
		addr := func(p int) string { return fmt.Sprintf("127.0.0.1:%d", p) }
		args := []string{"serve",
			"--proxy-addr", addr(ports[0]), "--control-addr", addr(ports[1]), "--browser-addr", addr(ports[2]),
			"--data-dir", o.DataDir, "--control-token", token,
		}
		if o.Store != "" {
			args = append(args, "--store", o.Store)
		}
		if o.Config != "" {
			args = append(args, "--config", o.Config)
		}
		if o.AllowDest {
			args = append(args, "--allow-dest", "127.0.0.1")
		}
		c, err := startChild(o.Name, logDir, []string{"SSL_CERT_FILE=" + o.UpstreamCert}, bin, args...)
		if err != nil {
			return nil, err
		}
		s := &stopgate{child: c, proxyAddr: addr(ports[0]), controlAddr: addr(ports[1]), token: token,
			ctl: &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 32}}}
		err = s.waitReady(ctx)
		if err == nil {
			return s, nil
		}
		c.stop()
		log := c.tail()
		if o.AllowDest && strings.Contains(log, "allow-dest") {
			return nil, fmt.Errorf("%s: %w; it said:\n%s", o.Name, errNoAllowDest, log)
		}
		lastErr = fmt.Errorf("%s: %w (started as %s %s)\n%s", o.Name, err, bin, strings.Join(shownArgs(args), " "), log)
		if !strings.Contains(log, "address already in use") {
			break
		}
	}
	return nil, lastErr
}

// shownArgs are serve's arguments as an error shows them: the control
// token is the run's secret, not something to print.
func shownArgs(args []string) []string {
	out := slices.Clone(args)
	for i := range out {
		if i > 0 && out[i-1] == "--control-token" {
			out[i] = "…"
		}
	}
	return out
}

// waitReady waits for /readyz, then reads the CA the proxy intercepts with.
func (s *stopgate) waitReady(ctx context.Context) error {
	client := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(startTimeout)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		if s.exited() {
			return errors.New("exited at start")
		}
		resp, err := client.Get("http://" + s.controlAddr + "/readyz")
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return s.readCA(client)
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("not ready within %s", startTimeout)
}

func (s *stopgate) readCA(client *http.Client) error {
	resp, err := client.Get("http://" + s.controlAddr + "/v1/ca")
	if err != nil {
		return fmt.Errorf("GET /v1/ca: %w", err)
	}
	defer resp.Body.Close()
	pem, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil || resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET /v1/ca: %s %v", resp.Status, err)
	}
	s.roots = x509.NewCertPool()
	if !s.roots.AppendCertsFromPEM(pem) {
		return errors.New("GET /v1/ca: no certificate in the answer")
	}
	return nil
}

// proxyURL is the proxy address with run's credentials: the run is
// admitted on its first request.
func (s *stopgate) proxyURL(run string) *url.URL {
	return &url.URL{Scheme: "http", User: url.UserPassword(run, "1"), Host: s.proxyAddr}
}

// control calls the control API with the operator token.
func (s *stopgate) control(ctx context.Context, method, path, body string) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, method, "http://"+s.controlAddr+path, strings.NewReader(body))
	if err != nil {
		return 0, "", err
	}
	req.Header.Set("Authorization", "Bearer "+s.token)
	req.Header.Set("Content-Type", "application/json")
	resp, err := s.ctl.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return resp.StatusCode, string(b), err
}
