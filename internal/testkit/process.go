package testkit

import (
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"
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

// Start starts the process (again, after Kill9 or Stop: the same command,
// the same log) and waits up to 20s until it answers.
func (p *Process) Start() {
	p.t.Helper()
	logf, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		p.t.Fatal(err)
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
