package testkit

import (
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/readyfile"
)

// Process is a program a test runs as a real process (a stopgate serve,
// say): its output goes to a log file the test can read, Start waits until
// it answers, and it is killed when the test ends.
type Process struct {
	t    testing.TB
	bin  string
	args []string
	env  []string
	dir  string
	// ready answers 200 once the process serves.
	ready   string
	logPath string
	// readyFile, for a stopgate serve: the file it writes its bound
	// addresses to; ready is then read from it (Serve).
	readyFile string
	// Bound is what the ready file said at the last start.
	Bound readyfile.Addrs

	cmd  *exec.Cmd
	done chan struct{}
	err  error // of Wait, once done is closed
}

// StartProcess runs bin with args and env (the whole environment) in dir
// ("" for the test's), and waits until ready (a URL) answers 200.
func StartProcess(t testing.TB, bin string, args, env []string, dir, ready string) *Process {
	t.Helper()
	p := &Process{t: t, bin: bin, args: args, env: env, dir: dir, ready: ready, logPath: filepath.Join(t.TempDir(), "process.log")}
	p.Start()
	t.Cleanup(p.Kill9)
	return p
}

// CleanEnv is the test's environment without STOPGATE_* variables: a
// developer's own settings cannot change what a test of stopgate sees.
func CleanEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "STOPGATE_") {
			env = append(env, kv)
		}
	}
	return env
}

// StartServe runs `bin serve` with args, every listener not named in
// args on port 0, and --ready-file: it waits for the file, then for
// /healthz on the control address it names. A test never picks a port
// that another may take first. Started again, it keeps the ports it was
// given the first time, so that what a test built on them still reaches
// it.
func StartServe(t testing.TB, bin string, args, env []string, dir string) *Process {
	t.Helper()
	file := filepath.Join(t.TempDir(), "ready.json")
	argv := append([]string{"serve"}, args...)
	for _, flag := range []string{"--proxy-addr", "--control-addr", "--browser-addr"} {
		if !slices.Contains(args, flag) {
			argv = append(argv, flag, "127.0.0.1:0")
		}
	}
	argv = append(argv, "--ready-file", file)
	p := &Process{t: t, bin: bin, args: argv, env: env, dir: dir, readyFile: file, logPath: filepath.Join(t.TempDir(), "process.log")}
	p.Start()
	t.Cleanup(p.Kill9)
	return p
}

// Start starts the process (again, after Kill9 or Stop: the same command,
// the same log) and waits up to 20s until it answers.
func (p *Process) Start() {
	p.t.Helper()
	logf, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		p.t.Fatal(err)
	}
	if p.readyFile != "" {
		_ = os.Remove(p.readyFile)
	}
	cmd := exec.Command(p.bin, p.args...)
	cmd.Stdout, cmd.Stderr, cmd.Dir, cmd.Env = logf, logf, p.dir, p.env
	if err := cmd.Start(); err != nil {
		p.t.Fatalf("start %s: %v", filepath.Base(p.bin), err)
	}
	p.cmd, p.done = cmd, make(chan struct{})
	go func() { p.err = cmd.Wait(); _ = logf.Close(); close(p.done) }()

	hc := &http.Client{Timeout: 500 * time.Millisecond}
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		if p.readyFile != "" && !p.readFile() {
			select {
			case <-p.done:
				p.t.Fatalf("%s exited at start (%v):\n%s", p.argv(), p.err, p.Log())
			case <-time.After(25 * time.Millisecond):
			}
			continue
		}
		resp, err := hc.Get(p.ready)
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		select {
		case <-p.done:
			p.t.Fatalf("%s exited at start (%v):\n%s", p.argv(), p.err, p.Log())
		case <-time.After(25 * time.Millisecond):
		}
	}
	p.t.Fatalf("%s did not answer %s within 20s:\n%s", p.argv(), p.ready, p.Log())
}

// readFile reads the ready file once it is there: the addresses bound,
// the health URL from them, and the arguments a restart takes (the same
// ports). Start removes it first, so what it says is this start's.
func (p *Process) readFile() bool {
	a, err := readyfile.Read(p.readyFile)
	if err != nil {
		return false
	}
	p.Bound, p.ready = a, "http://"+a.Control+"/healthz"
	for i := 0; i+1 < len(p.args); i++ {
		switch p.args[i] {
		case "--proxy-addr":
			p.args[i+1] = a.Proxy
		case "--control-addr":
			p.args[i+1] = a.Control
		case "--browser-addr":
			p.args[i+1] = a.Browser
		case "--metrics-addr":
			p.args[i+1] = a.Metrics
		case "--transparent-addr":
			if len(a.Transparent) > 0 {
				p.args[i+1] = a.Transparent[0]
			}
		}
	}
	return true
}

// Args are the process's arguments (a serve's with the ports it bound).
func (p *Process) Args() []string { return slices.Clone(p.args) }

func (p *Process) argv() string { return fmt.Sprint(filepath.Base(p.bin), " ", p.args[0]) }

// Log is what the process has written so far, across restarts.
func (p *Process) Log() string {
	b, _ := os.ReadFile(p.logPath)
	return string(b)
}

// Pid is the running process's id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Kill9 ends the process as a crash would: no shutdown, no flush.
func (p *Process) Kill9() {
	if p.cmd == nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
	p.cmd = nil
}

// Stop sends SIGTERM and waits up to 15s for the process to exit; its
// error is Wait's (nil for a clean exit).
func (p *Process) Stop() error {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		p.cmd = nil
		return p.err
	case <-time.After(15 * time.Second):
		p.Kill9()
		return fmt.Errorf("did not exit within 15s of SIGTERM")
	}
}
