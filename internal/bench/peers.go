package bench

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strings"
	"time"

	"github.com/stopgate/stopgate/internal/redisserver"
)

// The peers are the egress proxies a platform team already runs, measured
// beside stopgate in the main table's plain-HTTP rows: stripe/smokescreen
// and Squid. Neither intercepts HTTPS as stopgate and plain goproxy do
// (smokescreen, as run here, tunnels CONNECT unopened; Debian's Squid has
// no ssl-bump), so they are left out of the HTTPS rows. scripts/bench-deps builds or
// installs them; one it could not have leaves PATH.why next to where its
// binary would be, and is printed as not measured.

// peerBinary is a peer's binary as an absolute path, or why the peer
// cannot be measured.
func peerBinary(flagName, path string) (abs, why string) {
	if path == "" {
		return "", fmt.Sprintf("no binary given (-%s)", flagName)
	}
	st, err := os.Stat(path)
	if err != nil || st.IsDir() || st.Mode()&0o111 == 0 {
		if b, err := os.ReadFile(path + ".why"); err == nil {
			if line, _, _ := strings.Cut(strings.TrimSpace(string(b)), "\n"); line != "" {
				return "", line
			}
		}
		return "", fmt.Sprintf("no binary at %s (scripts/bench-deps makes it)", path)
	}
	if abs, err = filepath.Abs(path); err != nil {
		return "", err.Error()
	}
	return abs, ""
}

// peerVersion runs bin with args and returns the version its first line
// names: the last word of that line.
func peerVersion(ctx context.Context, bin string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, bin, args...).CombinedOutput()
	line, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
	if err != nil {
		return "", fmt.Errorf("%s %s: %w: %s", bin, strings.Join(args, " "), err, line)
	}
	f := strings.Fields(line)
	if len(f) == 0 {
		return "", fmt.Errorf("%s %s printed no version", bin, strings.Join(args, " "))
	}
	return f[len(f)-1], nil
}

// peer is one running peer proxy.
type peer struct {
	*child
	addr string
	// cleanup removes what the process leaves outside the work directory.
	cleanup func()
}

func (p *peer) stop() {
	p.child.stop()
	if p.cleanup != nil {
		p.cleanup()
	}
}

// peerLaunch is one attempt at starting a peer on a loopback port.
type peerLaunch struct {
	env  []string
	args []string
	// cleanup, if set, runs once the process has ended.
	cleanup func()
}

// startPeer starts a peer on a free loopback port and waits until it
// accepts connections. A port picked free may be taken before the peer
// binds it: then it tries another.
func startPeer(ctx context.Context, name, bin, dir string, launch func(port int) (peerLaunch, error)) (*peer, error) {
	var lastErr error
	for range 3 {
		port, err := redisserver.FreePort()
		if err != nil {
			return nil, err
		}
		l, err := launch(port)
		if err != nil {
			return nil, err
		}
		c, err := startChild(name, dir, l.env, bin, l.args...)
		if err != nil {
			return nil, err
		}
		p := &peer{child: c, addr: fmt.Sprintf("127.0.0.1:%d", port), cleanup: l.cleanup}
		if err = p.waitListening(ctx); err == nil {
			return p, nil
		}
		p.stop()
		log := c.tail()
		lastErr = fmt.Errorf("%s: %w\n%s", name, err, log)
		if !strings.Contains(strings.ToLower(log), "address already in use") {
			break
		}
	}
	return nil, lastErr
}

func (p *peer) waitListening(ctx context.Context) error {
	deadline := time.Now().Add(startTimeout)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		if p.exited() {
			return errors.New("exited at start")
		}
		if c, err := net.DialTimeout("tcp", p.addr, time.Second); err == nil {
			_ = c.Close()
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("not listening on %s within %s", p.addr, startTimeout)
}

// smokescreenArgs run smokescreen as the bench compares it: on loopback,
// with loopback destinations allowed (it refuses private and loopback
// addresses by default) and no egress ACL file, so every request is
// allowed by the ACL's "not configured" decision after its address checks.
// Its canonical log line per request goes to stderr, the bench's log of it;
// its metrics go to statsd on 127.0.0.1:8200, its default, as UDP datagrams
// nothing reads.
func smokescreenArgs(port int) []string {
	return []string{"--listen-ip", "127.0.0.1", "--listen-port", fmt.Sprint(port), "--allow-range", "127.0.0.0/8"}
}

func startSmokescreen(ctx context.Context, bin, dir string) (*peer, error) {
	return startPeer(ctx, "smokescreen", bin, dir, func(port int) (peerLaunch, error) {
		return peerLaunch{args: smokescreenArgs(port)}, nil
	})
}

// squidConfig is the whole configuration of the bench's Squid: a forwarding
// proxy on loopback for 127.0.0.1 only, nothing cached (no cache_dir, so no
// disk cache; no memory cache), no access log, no helpers (pinger), its
// administrative log on standard error (-d 1) and its pid file in dir.
// Squid refuses to run as root: effectiveUser, if set, is the user it
// switches to after binding its port, as it does when a distribution
// starts it.
func squidConfig(port int, dir, effectiveUser string) string {
	lines := []string{
		"# Written by stopgate-bench: Squid as a forwarding proxy, nothing cached or logged per request.",
		fmt.Sprintf("http_port 127.0.0.1:%d", port),
		"acl bench src 127.0.0.1/32",
		"http_access allow bench",
		"http_access deny all",
		"cache deny all",
		"cache_mem 0 MB",
		"access_log none",
		"cache_store_log none",
		"cache_log /dev/null",
		"logfile_rotate 0",
		"pid_filename " + filepath.Join(dir, "squid.pid"),
		"netdb_filename none",
		"icp_port 0",
		"htcp_port 0",
		"pinger_enable off",
		"digest_generation off",
		"shutdown_lifetime 0 seconds",
		"visible_hostname stopgate-bench",
	}
	if effectiveUser != "" {
		lines = append(lines, "cache_effective_user "+effectiveUser)
	}
	return strings.Join(lines, "\n") + "\n"
}

// squidUser is the user Squid switches to when the bench runs as root:
// Debian's proxy (the package's own), else nobody; none otherwise, and
// Squid runs as the current user.
func squidUser() string {
	if os.Geteuid() != 0 {
		return ""
	}
	if _, err := user.Lookup("proxy"); err == nil {
		return "proxy"
	}
	return "nobody"
}

// startSquid runs Squid in the foreground (-N: one process, no workers,
// no daemon), with its configuration, log and pid file in dir. Its service
// name (-n) is its own, so that its shared memory segments (/dev/shm) meet
// no other Squid's.
func startSquid(ctx context.Context, bin, dir string) (*peer, error) {
	dir = filepath.Join(dir, "squid")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	conf := filepath.Join(dir, "squid.conf")
	idBytes := make([]byte, 6)
	_, _ = rand.Read(idBytes)
	service := "stopgatebench" + hex.EncodeToString(idBytes)
	return startPeer(ctx, "squid", bin, dir, func(port int) (peerLaunch, error) {
		if err := os.WriteFile(conf, []byte(squidConfig(port, dir, squidUser())), 0o644); err != nil {
			return peerLaunch{}, fmt.Errorf("squid config: %w", err)
		}
		return peerLaunch{
			args: []string{"-N", "-d", "1", "-n", service, "-f", conf},
			cleanup: func() {
				// A Squid that ended cleanly removed them itself.
				leftovers, _ := filepath.Glob("/dev/shm/" + service + "-*")
				for _, f := range leftovers {
					_ = os.Remove(f)
				}
			},
		}, nil
	})
}

// peerTarget is one peer of the main table: running, or why not.
type peerTarget struct {
	key, label string
	proc       *peer
	why        string
}

// startPeers starts each peer the configuration names. A peer without a
// binary, or that does not start, is kept with the reason, so that the
// table says it was not measured and why; the rest of the bench runs.
func (e *env) startPeers(ctx context.Context) []*peerTarget {
	type kind struct {
		key, name, flag, path string
		versionArgs           []string
		start                 func(context.Context, string, string) (*peer, error)
	}
	kinds := []kind{
		{"smokescreen", "smokescreen", "smokescreen", e.cfg.Smokescreen, []string{"--version"}, startSmokescreen},
		{"squid", "Squid", "squid", e.cfg.Squid, []string{"-v"}, startSquid},
	}
	var out []*peerTarget
	for _, k := range kinds {
		pt := &peerTarget{key: k.key, label: k.name}
		out = append(out, pt)
		bin, why := peerBinary(k.flag, k.path)
		if why != "" {
			pt.why = why
			e.note("%s not measured: %s.", k.name, why)
			continue
		}
		v, err := peerVersion(ctx, bin, k.versionArgs...)
		if err != nil {
			pt.why = err.Error()
			e.note("%s not measured: %s.", k.name, pt.why)
			continue
		}
		pt.label = k.name + " " + v
		if pt.proc, err = k.start(ctx, bin, e.dir); err != nil {
			line, _, _ := strings.Cut(err.Error(), "\n")
			pt.why = "did not start: " + line
			e.cfg.logf("%v", err)
			e.note("%s not measured: %s.", k.name, pt.why)
		}
	}
	return out
}
