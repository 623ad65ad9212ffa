package browserguard

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/runwatch"
	"github.com/stopgate/stopgate/state"
)

// DefaultChromium is where Debian's chromium package puts the browser.
const DefaultChromium = "/usr/bin/chromium"

// launchMethod is the method of the intent that records a launch.
const launchMethod = "launch"

// profilePrefix names the profile directories of launched browsers.
const profilePrefix = "stopgate-browser-"

// Bounds of a launched browser's life.
const (
	defaultStartTimeout = 20 * time.Second
	// stopGrace is how long a browser may take to exit after SIGTERM
	// before its process group is killed.
	stopGrace = 3 * time.Second
	// waitDelay bounds waiting for the browser's stderr after it exits: a
	// child that kept the pipe open must not hold the launcher.
	waitDelay = 2 * time.Second
)

// LauncherConfig wires a Launcher.
type LauncherConfig struct {
	// Chromium is the browser's binary (DefaultChromium when empty).
	Chromium string
	Ledger   *intents.Ledger
	// Watcher carries the rows of runs with a browser to the launcher,
	// which stops the browser once the run is over.
	Watcher *runwatch.Watcher
	// Egress returns the egress proxy bound to a run: (*proxy.Proxy).ForRun.
	Egress func(run string) (http.Handler, error)
	// GuardAddr is the address the Guard listens on (host:port), for the
	// websocket URLs handed out; an unspecified host becomes 127.0.0.1.
	GuardAddr string
	// AutoAdmit admits an unseen run at its first launch.
	AutoAdmit bool
	// TempDir holds each browser's profile directory ("" = os.TempDir()).
	TempDir string
	// StartTimeout bounds a browser's start until its DevTools endpoint is up.
	StartTimeout time.Duration
	Logger       *slog.Logger
}

// Launcher starts one guarded headless Chromium per run and stops it when
// the run is over or the launcher closes.
type Launcher struct {
	cfg       LauncherConfig
	log       *slog.Logger
	guardHost string

	// launching serializes launches: a second request for a run finds the
	// browser the first one started.
	launching sync.Mutex

	mu       sync.Mutex
	browsers map[string]*browser
	closed   bool
	stopping sync.WaitGroup
}

// browser is one launched Chromium.
type browser struct {
	run      string
	version  int64
	devtools string // 127.0.0.1:PORT
	path     string // /devtools/browser/ID
	cmd      *exec.Cmd
	dir      string
	egress   *http.Server
	exited   chan struct{}
	stopOnce sync.Once
}

// NewLauncher checks cfg, removes the profiles that browsers of a stopgate
// killed with -9 left behind, and returns a launcher registered with the
// watcher, which has it stop the browsers of runs that are over.
func NewLauncher(cfg LauncherConfig) (*Launcher, error) {
	if cfg.Ledger == nil || cfg.Watcher == nil || cfg.Egress == nil {
		return nil, errors.New("browser launcher: a ledger, a run watcher and the egress proxy are required")
	}
	if cfg.Chromium == "" {
		cfg.Chromium = DefaultChromium
	}
	if cfg.StartTimeout <= 0 {
		cfg.StartTimeout = defaultStartTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	host, port, err := net.SplitHostPort(cfg.GuardAddr)
	if err != nil {
		return nil, fmt.Errorf("browser launcher: guard address %q: %w", cfg.GuardAddr, err)
	}
	if ip := net.ParseIP(host); host == "" || ip != nil && ip.IsUnspecified() {
		host = "127.0.0.1"
	}
	l := &Launcher{cfg: cfg, log: cfg.Logger, guardHost: net.JoinHostPort(host, port), browsers: map[string]*browser{}}
	l.removeStaleProfiles()
	cfg.Watcher.Add(l)
	return l, nil
}

// Launched is the answer to a launch.
type Launched struct {
	// Guard is the guard's decision on the launch; when it was refused,
	// nothing was started and the rest is empty.
	Guard state.GuardResult
	// WSURL is the guarded browser websocket URL to connect to.
	WSURL string
	// Version is the cancel_version in WSURL, which every action is
	// checked against.
	Version int64
	// Created is false when the run already had a browser.
	Created bool
}

// Launch starts the run's browser, or finds the one it has. The launch is
// an effect like any other: it passes the guard (so a cancelled run gets
// no browser, and an unseen one is admitted when auto-admit is on) and is
// recorded as a browser intent with method "launch". observed is the
// cancel_version the caller saw (0: check ACTIVE alone).
func (l *Launcher) Launch(ctx context.Context, run string, observed int64, actor string) (Launched, error) {
	if err := state.ValidateRunID(run); err != nil {
		return Launched{}, fmt.Errorf("launch a browser: %w", err)
	}
	l.launching.Lock()
	defer l.launching.Unlock()

	target := "chromium:" + l.cfg.Chromium
	res, err := l.cfg.Ledger.Begin(ctx, state.GuardRequest{
		RunID: run, ObservedVersion: observed, Key: intents.DerivedKey(run, launchMethod, target, ""),
		Boundary: state.BoundaryBrowser, Method: launchMethod, Target: target, AutoAdmit: l.cfg.AutoAdmit, Actor: actor,
	})
	if err != nil {
		return Launched{}, fmt.Errorf("launch a browser for run %s: %w", run, err)
	}
	if !res.Admitted {
		return Launched{Guard: res}, nil
	}
	version := observed
	if version == 0 {
		version = res.Run.CancelVersion
	}
	if b := l.running(run); b != nil {
		l.finish(ctx, res.Intent, state.IntentResponded, "the run's browser was already running, DevTools on "+b.devtools)
		return Launched{Guard: res, WSURL: l.wsURL(run, version, b.path), Version: version}, nil
	}
	b, err := l.start(ctx, run, version)
	if err != nil {
		l.finish(ctx, res.Intent, state.IntentNotSent, err.Error())
		return Launched{Guard: res}, fmt.Errorf("launch a browser for run %s: %w", run, err)
	}
	l.finish(ctx, res.Intent, state.IntentResponded, "DevTools on "+b.devtools)

	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		l.stop(b, "the launcher closed while the browser started")
		return Launched{Guard: res}, errors.New("launch a browser: stopgate is shutting down")
	}
	l.browsers[run] = b
	l.stopping.Add(1)
	l.mu.Unlock()
	go l.reap(b)
	l.log.Info("browser launched", "run", run, "cancel_version", version, "devtools", b.devtools, "pid", b.cmd.Process.Pid, "profile", b.dir)
	return Launched{Guard: res, WSURL: l.wsURL(run, version, b.path), Version: version, Created: true}, nil
}

func (l *Launcher) finish(ctx context.Context, in state.Intent, outcome state.IntentState, reason string) {
	if _, err := l.cfg.Ledger.Finish(ctx, state.FinishRequest{RunID: in.RunID, Key: in.Key, Attempt: in.Attempts, Outcome: outcome, Reason: state.Clip(reason, state.MaxTextLen)}); err != nil {
		l.log.Warn("launch outcome not recorded; its lease expires into UNKNOWN", "run", in.RunID, "intent", in.Key, "outcome", outcome, "err", err)
	}
}

func (l *Launcher) wsURL(run string, version int64, path string) string {
	return "ws://" + l.guardHost + guardedPrefix(run, version) + path
}

func (l *Launcher) running(run string) *browser {
	l.mu.Lock()
	defer l.mu.Unlock()
	b := l.browsers[run]
	if b == nil {
		return nil
	}
	select {
	case <-b.exited:
		return nil
	default:
		return b
	}
}

// DevTools is the DevTools address of the run's browser: the Guard's
// Config.Browsers.
func (l *Launcher) DevTools(run string) (string, bool) {
	if b := l.running(run); b != nil {
		return b.devtools, true
	}
	return "", false
}

// start runs Chromium for the run with its network through the egress
// proxy bound to the run, and waits for its DevTools endpoint.
func (l *Launcher) start(ctx context.Context, run string, version int64) (*browser, error) {
	exe, err := exec.LookPath(l.cfg.Chromium)
	if err != nil {
		return nil, fmt.Errorf("chromium %s: %w (install it: apt-get install chromium; or set --chromium / STOPGATE_CHROMIUM)", l.cfg.Chromium, err)
	}
	egress, err := l.cfg.Egress(run)
	if err != nil {
		return nil, fmt.Errorf("egress proxy for the browser: %w", err)
	}
	dir, err := os.MkdirTemp(l.cfg.TempDir, profilePrefix+strings.ReplaceAll(run, ":", "_")+"-")
	if err != nil {
		return nil, fmt.Errorf("browser profile directory: %w", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("egress listener for the browser: %w", err)
	}
	srv := &http.Server{
		Handler:           egress,
		ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:          slog.NewLogLogger(l.log.Handler(), slog.LevelDebug),
	}
	go func() { _ = srv.Serve(ln) }()

	stderr := &tailBuffer{max: 4 << 10}
	cmd := exec.Command(exe, chromiumArgs(dir, ln.Addr().String())...)
	cmd.Stdout, cmd.Stderr = nil, stderr
	cmd.SysProcAttr = procAttr()
	cmd.WaitDelay = waitDelay
	if err := cmd.Start(); err != nil {
		_ = srv.Close()
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("start %s: %w", exe, err)
	}
	b := &browser{run: run, version: version, cmd: cmd, dir: dir, egress: srv, exited: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(b.exited) }()

	b.devtools, b.path, err = waitDevTools(ctx, dir, b.exited, l.cfg.StartTimeout)
	if err != nil {
		l.stop(b, "start failed")
		if tail := strings.TrimSpace(stderr.String()); tail != "" {
			err = fmt.Errorf("%w; chromium's last output: %s", err, tail)
		}
		return nil, err
	}
	return b, nil
}

// chromiumArgs are the flags of a guarded browser. The browser reaches
// the network only through the egress proxy bound to its run: loopback
// too (<-loopback removes Chromium's implicit bypass), no QUIC, no
// WebRTC UDP that a proxy would not see. It trusts any certificate
// because it only ever sees stopgate's MITM certificates; the egress
// proxy verifies the upstream's. Background traffic is off, so that what
// the run's record shows is what the agent's pages did.
func chromiumArgs(profile, proxyAddr string) []string {
	return []string{
		"--headless",
		"--no-sandbox", // containers rarely allow its namespaces; the network boundary is the egress proxy
		"--disable-gpu",
		"--disable-dev-shm-usage",
		"--disable-quic",
		"--no-first-run",
		"--no-default-browser-check",
		"--disable-background-networking",
		"--disable-component-update",
		"--disable-sync",
		"--disable-default-apps",
		"--disable-extensions",
		"--disable-domain-reliability",
		"--disable-client-side-phishing-detection",
		"--disable-breakpad",
		"--no-pings",
		"--metrics-recording-only",
		"--mute-audio",
		"--password-store=basic",
		"--force-webrtc-ip-handling-policy=disable_non_proxied_udp",
		"--disable-features=Translate,OptimizationHints,MediaRouter,DialMediaRouteProvider,AutofillServerCommunication,CertificateTransparencyComponentUpdater,InterestFeedContentSuggestions,HttpsUpgrades,NetworkTimeServiceQuerying",
		"--remote-debugging-address=127.0.0.1",
		"--remote-debugging-port=0",
		"--user-data-dir=" + profile,
		"--proxy-server=http://" + proxyAddr,
		"--proxy-bypass-list=<-loopback>",
		"--ignore-certificate-errors",
		"about:blank",
	}
}

// waitDevTools reads the port and browser path Chromium writes to
// DevToolsActivePort in its profile once its endpoint listens.
func waitDevTools(ctx context.Context, dir string, exited <-chan struct{}, timeout time.Duration) (addr, path string, err error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	file := filepath.Join(dir, "DevToolsActivePort")
	t := time.NewTicker(25 * time.Millisecond)
	defer t.Stop()
	for {
		if b, err := os.ReadFile(file); err == nil {
			lines := strings.Split(strings.TrimSpace(string(b)), "\n")
			if len(lines) == 2 {
				port, err := strconv.Atoi(strings.TrimSpace(lines[0]))
				path := strings.TrimSpace(lines[1])
				if err == nil && port > 0 && port < 65536 && strings.HasPrefix(path, "/devtools/browser/") {
					return net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), path, nil
				}
			}
		}
		select {
		case <-exited:
			return "", "", errors.New("chromium exited before its DevTools endpoint was up")
		case <-ctx.Done():
			return "", "", fmt.Errorf("chromium's DevTools endpoint was not up within %s: %w", timeout, ctx.Err())
		case <-t.C:
		}
	}
}

// reap forgets a browser that exits, whoever ends it.
func (l *Launcher) reap(b *browser) {
	defer l.stopping.Done()
	<-b.exited
	l.mu.Lock()
	if l.browsers[b.run] == b {
		delete(l.browsers, b.run)
	}
	l.mu.Unlock()
	l.stop(b, "exited")
}

// stop ends a browser and its egress listener and removes its profile.
func (l *Launcher) stop(b *browser, why string) {
	b.stopOnce.Do(func() {
		select {
		case <-b.exited:
			// Exited by itself: its process group may be gone and its id
			// reused, so it is not signalled.
		default:
			signalGroup(b.cmd, sigTerm)
			select {
			case <-b.exited:
			case <-time.After(stopGrace):
				signalGroup(b.cmd, sigKill)
				<-b.exited
			}
		}
		_ = b.egress.Close()
		if err := removeAll(b.dir); err != nil {
			l.log.Warn("browser profile not removed", "run", b.run, "dir", b.dir, "err", err)
		}
		l.log.Info("browser stopped", "run", b.run, "why", why)
	})
}

// removeAll retries: the browser's last children may still be writing.
func removeAll(dir string) error {
	var err error
	for range 10 {
		if err = os.RemoveAll(dir); err == nil {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return err
}

// Holds reports whether run has a browser: the launcher is a
// runwatch.Holder.
func (l *Launcher) Holds(run string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.browsers[run] != nil
}

// Runs lists the runs with a browser.
func (l *Launcher) Runs() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	ids := make([]string, 0, len(l.browsers))
	for id := range l.browsers {
		ids = append(ids, id)
	}
	return ids
}

// Enforce stops the browser of a run that is over.
func (l *Launcher) Enforce(row state.Run) {
	if !row.Over() {
		return
	}
	l.mu.Lock()
	b := l.browsers[row.ID]
	l.mu.Unlock()
	if b != nil {
		// Not in the watcher's goroutine: a browser may take stopGrace to go.
		go l.stop(b, fmt.Sprintf("run is %s", row.Status))
	}
}

// Close stops every browser and launches no more; it returns when they
// are gone or ctx ends.
func (l *Launcher) Close(ctx context.Context) error {
	l.mu.Lock()
	l.closed = true
	all := make([]*browser, 0, len(l.browsers))
	for _, b := range l.browsers {
		all = append(all, b)
	}
	l.mu.Unlock()
	for _, b := range all {
		go l.stop(b, "stopgate is shutting down")
	}
	done := make(chan struct{})
	go func() { l.stopping.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("browser launcher: browsers still stopping: %w", ctx.Err())
	}
}

// tailBuffer keeps the last bytes written to it: a browser's stderr, for
// the error of a start that failed.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	buf []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, p...)
	if len(t.buf) > t.max {
		t.buf = append(t.buf[:0], t.buf[len(t.buf)-t.max:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.buf)
}

// removeStaleProfiles removes the profile directories whose browser is
// gone without its launcher having removed them (stopgate killed with -9:
// the kernel kills the browser, nobody removes its profile). Chromium's own
// SingletonLock ("HOST-PID") says whose a profile is; one of another host,
// of a live process, or without a lock is left alone.
func (l *Launcher) removeStaleProfiles() {
	dir := l.cfg.TempDir
	if dir == "" {
		dir = os.TempDir()
	}
	host, err := os.Hostname()
	if err != nil {
		return
	}
	profiles, _ := filepath.Glob(filepath.Join(dir, profilePrefix+"*"))
	for _, p := range profiles {
		owner, err := os.Readlink(filepath.Join(p, "SingletonLock"))
		if err != nil {
			continue
		}
		i := strings.LastIndex(owner, "-")
		if i < 0 || owner[:i] != host {
			continue
		}
		pid, err := strconv.Atoi(owner[i+1:])
		if err != nil || pid <= 0 || !processGone(pid) {
			continue
		}
		if err := removeAll(p); err != nil {
			l.log.Warn("stale browser profile not removed", "dir", p, "err", err)
			continue
		}
		l.log.Info("removed the profile of a browser whose stopgate died", "dir", p)
	}
}
