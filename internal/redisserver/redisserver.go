// Package redisserver starts real Redis deployments: for tests (Start: one
// redis-server on a free loopback port, in a temporary directory, with kill
// -9, stop and restart on the same data; StartCluster: a Redis Cluster of
// several masters; StartReplica and StartSentinel: a replica and a Sentinel
// that fails its master over) and for programs such as the benchmark
// instrument (Launch). It never mocks Redis and never skips: a missing
// redis-server or redis-cli fails the test with how to install it.
package redisserver

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Options choose how the server persists.
type Options struct {
	// AppendFsyncAlways turns on the AOF with fsync on every write, so an
	// acknowledged write survives kill -9.
	AppendFsyncAlways bool
	// AppendFsyncEverySec turns on the AOF with fsync once a second, the
	// policy Redis uses when the AOF is on: a crash may lose the last second.
	AppendFsyncEverySec bool
	// StartTimeout bounds the wait for the first PONG (10s when zero): a
	// server that loads a large data set at start needs longer.
	StartTimeout time.Duration
	// Args are more redis-server arguments, after the harness's own (a
	// later argument wins): --replicaof, --cluster-enabled, ...
	Args []string
	// Conf is written to redis.conf in the server's directory (once: a
	// Sentinel rewrites it with what it learned, and a restart reads that
	// back) and given first.
	Conf string
	// Sentinel starts the process in Sentinel mode (redis-server --sentinel).
	Sentinel bool
	// Password, when set, is the server's requirepass: URL carries it, and
	// the harness authenticates its own PING with it.
	Password string
	// TLS, when set, makes the server speak TLS alone on its port, with
	// these files (MakeTLS); URL is then a rediss:// URL.
	TLS *TLSFiles
	// ConfDecides leaves persistence to Conf: the harness adds none of its
	// own arguments but where the server listens and keeps its files, so
	// that a test runs a configuration as shipped (a manifest's redis.conf).
	ConfDecides bool
}

func (o Options) persistenceArgs() ([]string, error) {
	switch {
	case o.AppendFsyncAlways && o.AppendFsyncEverySec:
		return nil, errors.New("redisserver: AppendFsyncAlways and AppendFsyncEverySec are exclusive")
	case o.AppendFsyncAlways:
		return []string{"--appendonly", "yes", "--appendfsync", "always"}, nil
	case o.AppendFsyncEverySec:
		return []string{"--appendonly", "yes", "--appendfsync", "everysec"}, nil
	}
	return []string{"--appendonly", "no"}, nil
}

// args is the command line of a server on port with its data in dir.
func (o Options) args(dir string, port int) ([]string, error) {
	var args []string
	if o.Conf != "" {
		conf := filepath.Join(dir, "redis.conf")
		if _, err := os.Stat(conf); err != nil {
			if err := os.WriteFile(conf, []byte(o.Conf), 0o600); err != nil {
				return nil, fmt.Errorf("redis.conf: %w", err)
			}
		}
		args = append(args, conf)
	}
	args = append(args, "--port", fmt.Sprint(port), "--bind", "127.0.0.1", "--dir", dir,
		"--daemonize", "no", "--loglevel", "warning")
	if o.TLS != nil {
		args = append(args, o.TLS.args(port)...)
	}
	if o.Sentinel {
		return append(append(args, "--sentinel"), o.Args...), nil
	}
	if o.ConfDecides {
		if o.Password != "" {
			args = append(args, "--requirepass", o.Password)
		}
		return append(args, o.Args...), nil
	}
	persist, err := o.persistenceArgs()
	if err != nil {
		return nil, err
	}
	args = append(args, "--save", "", "--protected-mode", "yes")
	args = append(args, persist...)
	if o.Password != "" {
		args = append(args, "--requirepass", o.Password)
	}
	return append(args, o.Args...), nil
}

// Server is one redis-server process under a test's control.
type Server struct {
	t    testing.TB
	dir  string
	port int
	opts Options
	proc *Process
}

// Start starts a server and stops it when the test ends.
func Start(t testing.TB, opts Options) *Server {
	t.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		t.Fatalf("redis-server not found on PATH: install it with `apt-get install -y redis-server` (make test does this)")
	}
	s := &Server{t: t, dir: t.TempDir(), opts: opts}
	// redis-server cannot be asked for a port of the kernel's choosing,
	// so a free one is picked, and picked again when another process took
	// it first (the server then exits at start, or another answers there).
	var err error
	for range launchAttempts {
		if s.port, err = FreePort(); err != nil {
			t.Fatal(err)
		}
		if s.proc, err = Launch(s.dir, s.port, s.opts); err == nil {
			break
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Kill)
	return s
}

// launchAttempts bounds how often Start picks another port.
const launchAttempts = 5

// Addr is host:port of the server.
func (s *Server) Addr() string { return fmt.Sprintf("127.0.0.1:%d", s.port) }

// URL is the redis:// URL of the server, database 0, with its password
// when it has one.
func (s *Server) URL() string { return redisURL(s.Addr(), s.opts.Password, s.opts.TLS != nil) }

func redisURL(addr, password string, tls bool) string {
	scheme := "redis://"
	if tls {
		scheme = "rediss://"
	}
	if password != "" {
		return scheme + ":" + url.PathEscape(password) + "@" + addr + "/0"
	}
	return scheme + addr + "/0"
}

// PID is the server's process id.
func (s *Server) PID() int { return s.proc.PID() }

// Port is the server's port.
func (s *Server) Port() int { return s.port }

// Dir is the server's working directory (its AOF, its logs, nodes.conf).
func (s *Server) Dir() string { return s.dir }

func (s *Server) start() {
	s.t.Helper()
	p, err := Launch(s.dir, s.port, s.opts)
	if err != nil {
		s.t.Fatal(err)
	}
	s.proc = p
}

// Kill sends SIGKILL and waits for the process to go.
func (s *Server) Kill() {
	if s.proc == nil {
		return
	}
	s.proc.Kill()
	s.proc = nil
}

// Pause stops the process (SIGSTOP): connections stay open, nothing answers.
func (s *Server) Pause() { _ = s.proc.cmd.Process.Signal(syscall.SIGSTOP) }

// Resume continues a paused process.
func (s *Server) Resume() { _ = s.proc.cmd.Process.Signal(syscall.SIGCONT) }

// Restart starts the server again on the same port and data directory.
func (s *Server) Restart() {
	s.t.Helper()
	s.Kill()
	s.start()
}

// Process is one running redis-server, started by Launch.
type Process struct {
	addr string
	// password is the server's requirepass, if any.
	password string
	tls      *TLSFiles
	dir      string
	cmd      *exec.Cmd
	done     chan struct{}
}

// Launch starts redis-server on 127.0.0.1:port with its data (and log) in
// dir, and returns once it answers PING, or fails after opts.StartTimeout.
// The caller must Kill it.
func Launch(dir string, port int, opts Options) (*Process, error) {
	args, err := opts.args(dir, port)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command("redis-server", args...)
	cmd.Dir = dir
	logf, err := os.Create(filepath.Join(dir, fmt.Sprintf("redis-%d.log", time.Now().UnixNano())))
	if err != nil {
		return nil, fmt.Errorf("redis log: %w", err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		_ = logf.Close()
		return nil, fmt.Errorf("start redis-server: %w", err)
	}
	p := &Process{addr: fmt.Sprintf("127.0.0.1:%d", port), password: opts.Password, tls: opts.TLS, dir: dir, cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); _ = logf.Close(); close(p.done) }()
	wait := opts.StartTimeout
	if wait <= 0 {
		wait = 10 * time.Second
	}
	deadline := time.Now().Add(wait)
	for time.Now().Before(deadline) {
		if pingOK(p.addr, p.password, p.tls) {
			if !ownsPort(p) {
				p.Kill()
				return nil, fmt.Errorf("another redis-server answers on %s", p.addr)
			}
			return p, nil
		}
		select {
		case <-p.done:
			return nil, fmt.Errorf("redis-server exited at start; log in %s", dir)
		case <-time.After(20 * time.Millisecond):
		}
	}
	p.Kill()
	return nil, fmt.Errorf("redis-server on %s did not answer PING within %s; log in %s", p.addr, wait, dir)
}

// ownsPort reports whether the server answering on p's port is p: the
// port was free when picked, and another process may have taken it since.
func ownsPort(p *Process) bool {
	opt := &redis.Options{Addr: p.addr, Password: p.password, MaxRetries: -1}
	if p.tls != nil {
		opt.TLSConfig = p.tls.clientConfig()
	}
	c := redis.NewClient(opt)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	info, err := c.Info(ctx, "server").Result()
	if err != nil {
		return false
	}
	return strings.Contains(info, fmt.Sprintf("process_id:%d\r\n", p.PID()))
}

// Addr is host:port of the server.
func (p *Process) Addr() string { return p.addr }

// URL is the redis:// URL of the server, database 0, with its password
// when it has one.
func (p *Process) URL() string { return redisURL(p.addr, p.password, p.tls != nil) }

// PID is the server's process id.
func (p *Process) PID() int { return p.cmd.Process.Pid }

// Kill sends SIGKILL and waits for the process to go.
func (p *Process) Kill() {
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

func pingOK(addr, password string, tlsFiles *TLSFiles) bool {
	var c net.Conn
	var err error
	d := &net.Dialer{Timeout: 200 * time.Millisecond}
	if tlsFiles != nil {
		c, err = tls.DialWithDialer(d, "tcp", addr, tlsFiles.clientConfig())
	} else {
		c, err = d.Dial("tcp", addr)
	}
	if err != nil {
		return false
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(500 * time.Millisecond))
	r := bufio.NewReader(c)
	if password != "" {
		if _, err := fmt.Fprintf(c, "*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n", len(password), password); err != nil {
			return false
		}
		if line, err := r.ReadString('\n'); err != nil || !strings.HasPrefix(line, "+OK") {
			return false
		}
	}
	if _, err := c.Write([]byte("PING\r\n")); err != nil {
		return false
	}
	line, err := r.ReadString('\n')
	return err == nil && strings.HasPrefix(line, "+PONG")
}

// FreePort is a loopback TCP port that was free a moment ago.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
