// Package redisserver starts a real redis-server for tests: on a free
// loopback port, in a temporary directory, with kill -9, stop and restart on
// the same data. It never mocks Redis and never skips: a missing
// redis-server fails the test with how to install it.
package redisserver

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Options choose how the server persists.
type Options struct {
	// AppendFsyncAlways turns on the AOF with fsync on every write, so an
	// acknowledged write survives kill -9.
	AppendFsyncAlways bool
}

// Server is one redis-server process under a test's control.
type Server struct {
	t    testing.TB
	dir  string
	port int
	opts Options
	cmd  *exec.Cmd
	done chan struct{}
}

// Start starts a server and stops it when the test ends.
func Start(t testing.TB, opts Options) *Server {
	t.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		t.Fatalf("redis-server not found on PATH: install it with `apt-get install -y redis-server` (make test does this)")
	}
	s := &Server{t: t, dir: t.TempDir(), port: freePort(t), opts: opts}
	s.start()
	t.Cleanup(s.Kill)
	return s
}

// Addr is host:port of the server.
func (s *Server) Addr() string { return fmt.Sprintf("127.0.0.1:%d", s.port) }

// URL is the redis:// URL of the server, database 0.
func (s *Server) URL() string { return "redis://" + s.Addr() + "/0" }

func (s *Server) start() {
	s.t.Helper()
	args := []string{
		"--port", fmt.Sprint(s.port), "--bind", "127.0.0.1", "--dir", s.dir,
		"--save", "", "--protected-mode", "yes", "--daemonize", "no", "--loglevel", "warning",
	}
	if s.opts.AppendFsyncAlways {
		args = append(args, "--appendonly", "yes", "--appendfsync", "always")
	} else {
		args = append(args, "--appendonly", "no")
	}
	cmd := exec.Command("redis-server", args...)
	cmd.Dir = s.dir
	logf, err := os.Create(filepath.Join(s.dir, fmt.Sprintf("redis-%d.log", time.Now().UnixNano())))
	if err != nil {
		s.t.Fatalf("redis log: %v", err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		s.t.Fatalf("start redis-server: %v", err)
	}
	s.cmd = cmd
	s.done = make(chan struct{})
	go func() { _ = cmd.Wait(); _ = logf.Close(); close(s.done) }()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if pingOK(s.Addr()) {
			return
		}
		select {
		case <-s.done:
			s.t.Fatalf("redis-server exited at start; log in %s", s.dir)
		case <-time.After(20 * time.Millisecond):
		}
	}
	s.t.Fatalf("redis-server on %s did not answer PING within 10s", s.Addr())
}

// Kill sends SIGKILL and waits for the process to go.
func (s *Server) Kill() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Signal(syscall.SIGKILL)
	<-s.done
	s.cmd = nil
}

// Pause stops the process (SIGSTOP): connections stay open, nothing answers.
func (s *Server) Pause() { _ = s.cmd.Process.Signal(syscall.SIGSTOP) }

// Resume continues a paused process.
func (s *Server) Resume() { _ = s.cmd.Process.Signal(syscall.SIGCONT) }

// Restart starts the server again on the same port and data directory.
func (s *Server) Restart() {
	s.t.Helper()
	s.Kill()
	s.start()
}

func pingOK(addr string) bool {
	c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
	if err != nil {
		return false
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(500 * time.Millisecond))
	if _, err := c.Write([]byte("PING\r\n")); err != nil {
		return false
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	return err == nil && strings.HasPrefix(line, "+PONG")
}

func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("free port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}
