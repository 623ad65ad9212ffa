package redisstore_test

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// localServer is a redis-server for what internal/redisserver cannot start:
// a benchmark (Start takes a *testing.T), a cluster-mode node, a Sentinel.
type localServer struct {
	addr string
	dir  string
	pid  int
}

func startLocal(tb testing.TB, extra ...string) *localServer {
	tb.Helper()
	return startLocalConf(tb, "", extra...)
}

// startLocalConf starts redis-server with a config file (written to the
// server's directory) ahead of the arguments; Sentinel needs one it can
// rewrite.
func startLocalConf(tb testing.TB, conf string, extra ...string) *localServer {
	tb.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		tb.Fatalf("redis-server not found on PATH: install it with `apt-get install -y redis-server`")
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	addr := l.Addr().String()
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	dir := tb.TempDir()
	var args []string
	if conf != "" {
		path := filepath.Join(dir, "redis.conf")
		if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
			tb.Fatal(err)
		}
		args = append(args, path)
	}
	args = append(args, []string{
		"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--dir", dir,
		"--daemonize", "no", "--loglevel", "warning",
	}...)
	if conf == "" {
		// No RDB snapshots: the tests never need them, and they cost disk.
		args = append(args, "--save", "")
	}
	args = append(args, extra...)
	logf, err := os.Create(filepath.Join(dir, "redis.log"))
	if err != nil {
		tb.Fatal(err)
	}
	cmd := exec.Command("redis-server", args...)
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		tb.Fatalf("start redis-server: %v", err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); _ = logf.Close(); close(done) }()
	tb.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGKILL)
		<-done
	})
	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return &localServer{addr: addr, dir: dir, pid: cmd.Process.Pid}
		}
		select {
		case <-done:
			tb.Fatalf("redis-server exited at start; log in %s", dir)
		default:
		}
		if time.Now().After(deadline) {
			tb.Fatalf("redis-server on %s did not answer within 10s: %v", addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
