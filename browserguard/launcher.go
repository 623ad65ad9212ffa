package browserguard

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/coder/websocket"

	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/runtoken"
	"github.com/stopgate/stopgate/runwatch"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/telemetry"
)

// DefaultChromium is where Debian's chromium package puts the browser.
const DefaultChromium = "/usr/bin/chromium"

// The methods of the intents that record a request for a run's browser:
// the first starts it, the next ones are handed the one running.
const (
	launchMethod = "launch"
	attachMethod = "attach"
)

// profilePrefix names the profile directories of launched browsers.
const profilePrefix = "stopgate-browser-"

// Defaults and bounds of a launched browser's life.
const (
	defaultStartTimeout = 20 * time.Second
	// DefaultLinger is how long the browser of a run that is over stays
	// up, refusing actions and serving reads, before it is stopped.
	DefaultLinger = 30 * time.Second
	// DefaultMaxBrowsers is how many browsers run at most at once.
	DefaultMaxBrowsers = 8
	// stopGrace is how long a browser may take to exit after SIGTERM
	// before its process group is killed.
	stopGrace = 3 * time.Second
	// waitDelay bounds waiting for the browser's output after it exits: a
	// child that kept the pipe open must not hold the launcher.
	waitDelay = 2 * time.Second
)

// ErrBrowserLimit is the error of a launch past LauncherConfig.MaxBrowsers.
var ErrBrowserLimit = errors.New("browser limit reached")

// LauncherConfig wires a Launcher.
type LauncherConfig struct {
	// Chromium is the browser's binary (DefaultChromium when empty).
	Chromium string
	Ledger   *intents.Ledger
	// Watcher carries the rows of runs with a browser to the launcher,
	// which stops the browser once the run is over (after the linger).
	Watcher *runwatch.Watcher
	// Egress returns the egress proxy bound to a run: (*proxy.Proxy).ForRun.
	Egress func(run string) (http.Handler, error)
	// GuardAddr is the address the Guard listens on (host:port), for the
	// websocket URLs handed out; an unspecified host becomes 127.0.0.1.
	GuardAddr string
	// AutoAdmit admits an unseen run at its first launch; Budget is the
	// budget the policy gives it (nil: none).
	AutoAdmit bool
	Budget    func(run string) state.Budget
	// TempDir holds each browser's profile directory ("" = os.TempDir()).
	TempDir string
	// StartTimeout bounds a browser's start until it answers on its pipe.
	StartTimeout time.Duration
	// Linger is how long the browser of a run that is over stays up
	// (actions refused, reads served) before it is stopped; 0 stops it at
	// once.
	Linger time.Duration
	// MaxBrowsers caps the browsers running at once, lingering ones
	// included; a launch past it is refused (ErrBrowserLimit). 0: no cap.
	MaxBrowsers int
	Logger      *slog.Logger
	// Telemetry counts the browsers running; nil counts privately.
	Telemetry *telemetry.Telemetry
	// Sandbox is how each browser is kept from the machine (namespaces of
	// its own, by default).
	Sandbox Sandbox
	// Tokens signs the run tokens in the websocket URLs handed out when
	// RequireToken is set: the guard then takes no URL without one.
	Tokens       *runtoken.Signer
	RequireToken bool
	// TokenTTL is how long a token the launcher signs is good for
	// (DefaultTokenTTL when zero).
	TokenTTL time.Duration
}

// DefaultTokenTTL is how long the run token in a handed-out URL is good
// for, when the launcher signs it; the URL of a worker who asked with its
// own token carries that token.
const DefaultTokenTTL = 24 * time.Hour

// Launcher starts one guarded headless Chromium per run and stops it when
// the run is over (after the linger) or the launcher closes.
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
	run     string
	version int64
	dt      *DevTools
	cmd     *exec.Cmd
	dir     string
	egress  *http.Server
	started time.Time
	exited  chan struct{}
	// lingering is set (under Launcher.mu) once the run is over and the
	// browser's stop is scheduled.
	lingering bool
	stopOnce  sync.Once
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
	if cfg.Linger < 0 || cfg.MaxBrowsers < 0 {
		return nil, fmt.Errorf("browser launcher: linger %s and browser cap %d may not be negative", cfg.Linger, cfg.MaxBrowsers)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Sandbox.Isolation == "" {
		cfg.Sandbox.Isolation = IsolateNamespaces
	}
	if _, err := ParseIsolation(string(cfg.Sandbox.Isolation)); err != nil {
		return nil, fmt.Errorf("browser launcher: %w", err)
	}
	if cfg.Sandbox.Isolation == IsolateNamespaces && cfg.Sandbox.Helper == "" {
		return nil, errors.New("browser launcher: isolation with namespaces needs a helper (the stopgate binary, whose main calls SandboxMain)")
	}
	if cfg.Sandbox.UID == 0 {
		cfg.Sandbox.UID = DefaultBrowserUID
	}
	if cfg.Sandbox.GID == 0 {
		cfg.Sandbox.GID = cfg.Sandbox.UID
	}
	if cfg.RequireToken && cfg.Tokens == nil {
		return nil, errors.New("browser launcher: run tokens are required but there is no run-token secret to sign them")
	}
	if cfg.RequireToken && cfg.Sandbox.Isolation == IsolateNone {
		return nil, errors.New("browser launcher: with run tokens required, browsers must run with isolation " + string(IsolateNamespaces) +
			": without it a browser's egress listener is open to every local process, which could send as its run without a token")
	}
	if cfg.TokenTTL <= 0 {
		cfg.TokenTTL = DefaultTokenTTL
	}
	host, port, err := net.SplitHostPort(cfg.GuardAddr)
	if err != nil {
		return nil, fmt.Errorf("browser launcher: guard address %q: %w", cfg.GuardAddr, err)
	}
	if ip := net.ParseIP(host); host == "" || ip != nil && ip.IsUnspecified() {
		host = "127.0.0.1"
	}
	if cfg.Telemetry == nil {
		cfg.Telemetry = telemetry.New(telemetry.Options{})
	}
	l := &Launcher{cfg: cfg, log: cfg.Logger, guardHost: net.JoinHostPort(host, port), browsers: map[string]*browser{}}
	l.removeStaleProfiles()
	cfg.Watcher.Add(l)
	return l, nil
}

// LaunchRequest asks for a run's browser.
type LaunchRequest struct {
	Run string
	// Observed is the cancel_version the caller saw (0: check ACTIVE
	// alone; with Token, the token's).
	Observed int64
	// Actor is recorded on the launch's intent.
	Actor string
	// Token is the caller's own run token, when it has one: with tokens
	// required, the URL handed out carries it rather than a new one, so
	// that asking for a browser never lengthens a worker's credential.
	Token string
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
	// Created is false when the run already had a browser (an attach).
	Created bool
}

// Launch starts the run's browser, or hands out the one it has. Either is
// an effect like any other: it passes the guard (so a cancelled run gets no
// browser, and an unseen one is admitted when auto-admit is on) and is
// recorded as a browser intent, with method "launch" when it starts one and
// "attach" when the run's browser was already running. observed is the
// cancel_version the caller saw (0: check ACTIVE alone).
func (l *Launcher) Launch(ctx context.Context, req LaunchRequest) (Launched, error) {
	run, observed, actor := req.Run, req.Observed, req.Actor
	if err := state.ValidateRunID(run); err != nil {
		return Launched{}, fmt.Errorf("launch a browser: %w", err)
	}
	if l.cfg.RequireToken && req.Token != "" {
		c, err := l.cfg.Tokens.Verify(req.Token, time.Now())
		switch {
		case err != nil:
			return Launched{}, fmt.Errorf("launch a browser: %w: %w", state.ErrInvalid, err)
		case c.RunID != run:
			return Launched{}, fmt.Errorf("launch a browser: %w: the run token is for run %s, not %s", state.ErrInvalid, c.RunID, run)
		case observed != 0 && observed != c.Version:
			return Launched{}, fmt.Errorf("launch a browser: %w: cancel_version %d, but the run token carries %d", state.ErrInvalid, observed, c.Version)
		}
		observed = c.Version
	}
	l.launching.Lock()
	defer l.launching.Unlock()

	running := l.running(run)
	method := launchMethod
	if running != nil {
		method = attachMethod
	}
	target := "chromium:" + l.cfg.Chromium
	greq := state.GuardRequest{
		RunID: run, ObservedVersion: observed, Key: intents.DerivedKey(run, method, target, ""),
		Boundary: state.BoundaryBrowser, Method: method, Target: target, AutoAdmit: l.cfg.AutoAdmit, Actor: actor,
	}
	if greq.AutoAdmit && l.cfg.Budget != nil {
		greq.Budget = l.cfg.Budget(run)
	}
	res, err := l.cfg.Ledger.Begin(ctx, greq)
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
	if running != nil {
		l.finish(ctx, res.Intent, state.IntentResponded, fmt.Sprintf("handed the run's browser, running since %s", running.started.UTC().Format(time.RFC3339)))
		return Launched{Guard: res, WSURL: l.wsURL(run, version, req.Token, running.dt.BrowserID()), Version: version}, nil
	}
	if n := l.count(); l.cfg.MaxBrowsers > 0 && n >= l.cfg.MaxBrowsers {
		why := fmt.Sprintf("%d browsers are running, the most this stopgate runs (--browser-max %d); a run's browser stops when the run is over (after --browser-linger)", n, l.cfg.MaxBrowsers)
		l.finish(ctx, res.Intent, state.IntentNotSent, "not started: "+why)
		return Launched{Guard: res}, fmt.Errorf("%w: %s", ErrBrowserLimit, why)
	}
	b, err := l.start(ctx, run, version)
	if err != nil {
		l.finish(ctx, res.Intent, state.IntentNotSent, err.Error())
		return Launched{Guard: res}, fmt.Errorf("launch a browser for run %s: %w", run, err)
	}
	l.finish(ctx, res.Intent, state.IntentResponded, "started, pid "+strconv.Itoa(b.cmd.Process.Pid))

	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		l.stop(b, websocket.StatusGoingAway, "stopgate is shutting down", "the launcher closed while the browser started")
		return Launched{Guard: res}, errors.New("launch a browser: stopgate is shutting down")
	}
	l.browsers[run] = b
	l.cfg.Telemetry.Metrics().Open.WithLabelValues("browsers").Inc()
	l.stopping.Add(1)
	l.mu.Unlock()
	go l.reap(b)
	l.log.Info("browser launched", "run", run, "cancel_version", version, "pid", b.cmd.Process.Pid, "profile", b.dir)
	return Launched{Guard: res, WSURL: l.wsURL(run, version, req.Token, b.dt.BrowserID()), Version: version, Created: true}, nil
}

func (l *Launcher) finish(ctx context.Context, in state.Intent, outcome state.IntentState, reason string) {
	if _, err := l.cfg.Ledger.Finish(ctx, state.FinishRequest{RunID: in.RunID, Key: in.Key, Attempt: in.Attempts, Outcome: outcome, Reason: state.Clip(reason, state.MaxTextLen)}); err != nil {
		l.log.Warn("launch outcome not recorded; its lease expires into UNKNOWN", "run", in.RunID, "intent", in.Key, "outcome", outcome, "err", err)
	}
}

// wsURL is the guarded websocket URL of a run's browser: its credential
// is the version, or with tokens required a run token (the caller's own,
// else one signed now).
func (l *Launcher) wsURL(run string, version int64, token, id string) string {
	cred := strconv.FormatInt(version, 10)
	if l.cfg.RequireToken {
		cred = token
		if cred == "" {
			cred = l.cfg.Tokens.Sign(run, version, time.Now().Add(l.cfg.TokenTTL))
		}
	}
	return "ws://" + l.guardHost + guardedPrefix(run, cred) + "/devtools/browser/" + id
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

func (l *Launcher) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.browsers)
}

// DevTools is the DevTools connection of the run's browser: the Guard's
// Config.Browsers.
func (l *Launcher) DevTools(run string) (*DevTools, bool) {
	if b := l.running(run); b != nil {
		return b.dt, true
	}
	return nil, false
}

// start runs Chromium for the run with its network through the egress
// proxy bound to the run, and waits for its first answer on the pipe.
func (l *Launcher) start(ctx context.Context, run string, version int64) (*browser, error) {
	exe, err := exec.LookPath(l.cfg.Chromium)
	if err != nil {
		return nil, fmt.Errorf("chromium %s: %w (install it: apt-get install chromium; or set --chromium / STOPGATE_CHROMIUM)", l.cfg.Chromium, err)
	}
	if exe, err = filepath.Abs(exe); err != nil {
		return nil, fmt.Errorf("chromium %s: %w", l.cfg.Chromium, err)
	}
	egress, err := l.cfg.Egress(run)
	if err != nil {
		return nil, fmt.Errorf("egress proxy for the browser: %w", err)
	}
	dir, err := os.MkdirTemp(l.cfg.TempDir, profilePrefix+strings.ReplaceAll(run, ":", "_")+"-")
	if err != nil {
		return nil, fmt.Errorf("browser profile directory: %w", err)
	}
	// Whose it is, for the cleanup after a stopgate killed with -9: a
	// sandboxed browser's profile is not on the host at all.
	if err := os.WriteFile(filepath.Join(dir, ownerFile), []byte(ownerOf(os.Getpid())), 0o600); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("browser profile directory: %w", err)
	}
	fail := func(err error) (*browser, error) {
		_ = os.RemoveAll(dir)
		return nil, err
	}

	// The DevTools pipe: the browser reads commands from its fd 3 and
	// writes answers and events to its fd 4 (ExtraFiles count from 3).
	childR, parentW, err := os.Pipe()
	if err != nil {
		return fail(fmt.Errorf("DevTools pipe: %w", err))
	}
	parentR, childW, err := os.Pipe()
	if err != nil {
		_ = childR.Close()
		_ = parentW.Close()
		return fail(fmt.Errorf("DevTools pipe: %w", err))
	}
	out := &outputLog{log: l.log, run: run, tail: &tailBuffer{max: 4 << 10}}
	var (
		cmd *exec.Cmd
		ln  net.Listener
	)
	if l.cfg.Sandbox.Isolation == IsolateNamespaces {
		cmd, ln, err = l.startInSandbox(ctx, run, exe, dir, []*os.File{childR, childW}, out)
	} else {
		cmd, ln, err = l.startPlain(exe, dir, []*os.File{childR, childW}, out)
	}
	// The browser has its own copies now (or never will).
	_ = childR.Close()
	_ = childW.Close()
	if err != nil {
		_ = parentR.Close()
		_ = parentW.Close()
		if tail := strings.TrimSpace(out.tail.String()); tail != "" {
			err = fmt.Errorf("%w; its last output: %s", err, tail)
		}
		return fail(err)
	}
	srv := &http.Server{
		Handler:           egress,
		ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:          slog.NewLogLogger(l.log.Handler(), slog.LevelDebug),
	}
	go func() { _ = srv.Serve(ln) }()
	out.pid = cmd.Process.Pid
	b := &browser{
		run: run, version: version, cmd: cmd, dir: dir, egress: srv, started: time.Now(), exited: make(chan struct{}),
		dt: newDevTools(parentR, parentW, l.log.With("run", run)),
	}
	go func() { _ = cmd.Wait(); out.flush(); close(b.exited) }()

	sctx, cancel := context.WithTimeout(ctx, l.cfg.StartTimeout)
	defer cancel()
	ready := make(chan error, 1)
	go func() { ready <- b.dt.ready(sctx) }()
	select {
	case err = <-ready:
	case <-b.exited:
		err = errors.New("chromium exited before it answered on its DevTools pipe")
	}
	if err == nil {
		// Downloads off, for the browser's default context; new contexts
		// and what a client asks for are the guard's (and, sandboxed, the
		// browser's policy's).
		err = b.dt.denyDownloads(sctx)
	}
	if err != nil {
		l.stop(b, websocket.StatusInternalError, "stopgate: the browser did not start", "start failed")
		if tail := strings.TrimSpace(out.tail.String()); tail != "" {
			err = fmt.Errorf("%w; chromium's last output: %s", err, tail)
		}
		return nil, err
	}
	return b, nil
}

// startPlain starts Chromium as a child process of stopgate's own user,
// with its egress listener on the host's loopback (IsolateNone).
func (l *Launcher) startPlain(exe, dir string, pipe []*os.File, out *outputLog) (*exec.Cmd, net.Listener, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, nil, fmt.Errorf("egress listener for the browser: %w", err)
	}
	cmd := exec.Command(exe, chromiumArgs(dir, ln.Addr().String())...)
	cmd.Env = browserEnv(dir)
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = out, out
	cmd.ExtraFiles = pipe
	cmd.SysProcAttr = procAttr()
	cmd.WaitDelay = waitDelay
	if err := cmd.Start(); err != nil {
		_ = ln.Close()
		return nil, nil, fmt.Errorf("start %s: %w", exe, err)
	}
	return cmd, ln, nil
}

// startInSandbox starts Chromium in namespaces of its own
// (IsolateNamespaces), its root built on dir, which is also its profile's
// path there.
func (l *Launcher) startInSandbox(ctx context.Context, run, exe, dir string, pipe []*os.File, out *outputLog) (*exec.Cmd, net.Listener, error) {
	sb := l.cfg.Sandbox
	policy, err := json.Marshal(browserPolicy)
	if err != nil {
		return nil, nil, err
	}
	spec := sandboxSpec{
		Root: dir, Exe: exe, Args: append([]string{exe}, chromiumArgs(dir, fmt.Sprintf("127.0.0.1:%d", sandboxProxyPort))...),
		Env: browserEnv(dir), Policy: policy, ProxyPort: sandboxProxyPort,
		AsRoot: os.Geteuid() == 0, UID: sb.UID, GID: sb.GID,
	}
	spec.Binds = append(spec.Binds, systemDirs...)
	// A Chromium installed outside the system's directories brings its
	// own directory.
	if real, err := filepath.EvalSymlinks(exe); err == nil && !underAny(real, systemDirs) {
		spec.Binds = append(spec.Binds, filepath.Dir(real))
	}
	if up := sb.UploadDir(run); up != "" {
		if fi, err := os.Stat(up); err == nil && fi.IsDir() {
			spec.Uploads = up
		}
	}
	for _, h := range sb.Hide {
		if abs, err := filepath.Abs(h); err == nil {
			spec.Hide = append(spec.Hide, abs)
			if real, err := filepath.EvalSymlinks(abs); err == nil && real != abs {
				spec.Hide = append(spec.Hide, real)
			}
		}
	}
	deadline := time.Now().Add(l.cfg.StartTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	s, err := startSandboxed(spec, sb.Helper, pipe, out, deadline)
	if err != nil {
		return nil, nil, err
	}
	return s.cmd, s.listener, nil
}

// underAny reports whether path is one of dirs or under one.
func underAny(path string, dirs []string) bool {
	for _, d := range dirs {
		if path == d || strings.HasPrefix(path, d+"/") {
			return true
		}
	}
	return false
}

// unreachableURL is a URL that Chromium refuses to connect to by itself:
// port 1 is on its list of restricted ports, so a request there fails
// inside the browser (ERR_UNSAFE_PORT) and never reaches the proxy.
const unreachableURL = "https://127.0.0.1:1/"

// disabledFeatures are Chromium features that call Google services of
// their own accord, or change what a page's requests look like.
var disabledFeatures = []string{
	// chromedp's (and Puppeteer's) defaults.
	"Translate", "BlinkGenPropertyTrees",
	// Background calls to Google: optimization hints, network time, media
	// router discovery, autofill server, the certificate transparency and
	// feed components, the AI mode and search preconnects.
	"OptimizationHints", "NetworkTimeServiceQuerying", "MediaRouter", "DialMediaRouteProvider",
	"AutofillServerCommunication", "CertificateTransparencyComponentUpdater", "InterestFeedContentSuggestions",
	"AimEnabled", "PreconnectToSearch",
	// Keep http:// navigations on http://, as the agent asked.
	"HttpsUpgrades", "HttpsFirstBalancedModeAutoEnable",
}

// chromiumArgs are the flags of a guarded browser.
//
// The base is chromedp's default set (DefaultExecAllocatorOptions, after
// Puppeteer's); TestFlagsKeepChromedpDefaults holds this list to it. On top:
//   - the only way in is the DevTools pipe, which the launcher holds
//     (--remote-debugging-pipe): no DevTools port that another local
//     process could drive the browser through;
//   - the network only through the egress proxy bound to the run: loopback
//     too (<-loopback removes Chromium's implicit bypass), no QUIC, no
//     WebRTC UDP that a proxy would not see. It trusts any certificate
//     because it only ever sees stopgate's MITM certificates; the egress
//     proxy verifies the upstream's;
//   - none of the browser's own background traffic, so that what the run's
//     record shows is what its pages did (TestCleanAudit): component
//     updates, sync, safe browsing, sign-in, metrics, field trials, domain
//     reliability, pings, and the features in disabledFeatures. Two calls
//     no switch turns off in Chromium 156 are pointed at unreachableURL:
//     Gaia's ListAccounts (--gaia-url; Chrome sign-in is off anyway) and
//     the component updater's on-demand checks, such as the on-device
//     model manifest (--component-updater=url-source).
func chromiumArgs(profile, proxyAddr string) []string {
	return []string{
		// chromedp's defaults.
		"--headless",
		"--hide-scrollbars",
		"--mute-audio",
		"--no-first-run",
		"--no-default-browser-check",
		"--disable-background-networking",
		"--enable-features=NetworkService,NetworkServiceInProcess",
		"--disable-background-timer-throttling",
		"--disable-backgrounding-occluded-windows",
		"--disable-breakpad",
		"--disable-client-side-phishing-detection",
		"--disable-default-apps",
		"--disable-dev-shm-usage",
		"--disable-extensions",
		"--disable-features=" + strings.Join(disabledFeatures, ","),
		"--disable-hang-monitor",
		"--disable-ipc-flooding-protection",
		"--disable-popup-blocking",
		"--disable-prompt-on-repost",
		"--disable-renderer-backgrounding",
		"--disable-sync",
		"--force-color-profile=srgb",
		"--metrics-recording-only",
		"--safebrowsing-disable-auto-update",
		"--enable-automation",
		"--password-store=basic",
		"--use-mock-keychain",
		// Containers rarely allow its namespaces; the boundary that matters
		// is the network one.
		"--no-sandbox",
		"--disable-gpu",
		// No background traffic of its own.
		"--disable-component-update",
		"--component-updater=url-source=" + unreachableURL,
		"--gaia-url=" + unreachableURL,
		"--disable-field-trial-config",
		"--disable-domain-reliability",
		"--disable-component-extensions-with-background-pages",
		"--no-pings",
		"--no-service-autorun",
		"--disable-search-engine-choice-screen",
		// The network only through the run's egress proxy.
		"--disable-quic",
		"--force-webrtc-ip-handling-policy=disable_non_proxied_udp",
		"--proxy-server=http://" + proxyAddr,
		"--proxy-bypass-list=<-loopback>",
		"--ignore-certificate-errors",
		// The only way in.
		"--remote-debugging-pipe",
		"--user-data-dir=" + profile,
		"about:blank",
	}
}

// reap forgets a browser that exits, whoever ends it.
func (l *Launcher) reap(b *browser) {
	defer l.stopping.Done()
	<-b.exited
	l.mu.Lock()
	if l.browsers[b.run] == b {
		delete(l.browsers, b.run)
		l.cfg.Telemetry.Metrics().Open.WithLabelValues("browsers").Dec()
	}
	l.mu.Unlock()
	l.stop(b, websocket.StatusInternalError, "stopgate: the browser exited", "exited")
}

// stop ends a browser: its connections are closed with code and reason,
// then the browser, its egress listener and its profile go.
func (l *Launcher) stop(b *browser, code websocket.StatusCode, reason, why string) {
	b.stopOnce.Do(func() {
		// Closing the pipe tells the browser to exit.
		b.dt.close(code, reason)
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
	return slices.Collect(maps.Keys(l.browsers))
}

// Enforce takes a run's new row to its browser: once the run is over, the
// browser lingers for cfg.Linger (its actions are refused by the guard,
// reads still work), then it is stopped and its connections are closed
// with the refusal as their reason.
func (l *Launcher) Enforce(row state.Run) {
	if !row.Over() {
		return
	}
	l.mu.Lock()
	b := l.browsers[row.ID]
	first := b != nil && !b.lingering
	if first {
		b.lingering = true
	}
	l.mu.Unlock()
	if !first {
		return
	}
	reason := refusal.Over(row, "browser closed").CloseReason()
	why := fmt.Sprintf("run is %s", row.Status)
	if l.cfg.Linger <= 0 {
		// Not in the watcher's loop: a browser may take stopGrace to go.
		go l.stop(b, websocket.StatusPolicyViolation, reason, why)
		return
	}
	l.log.Info("run is over: its browser lingers, refusing actions and serving reads, then stops",
		"run", row.ID, "status", row.Status, "linger", l.cfg.Linger)
	go func() {
		t := time.NewTimer(l.cfg.Linger)
		defer t.Stop()
		select {
		case <-t.C:
			l.stop(b, websocket.StatusPolicyViolation, reason, why+", after its linger")
		case <-b.exited:
		}
	}()
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
		go l.stop(b, websocket.StatusGoingAway, "stopgate is shutting down", "stopgate is shutting down")
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

// outputLog writes the browser's output to the log, a line to a record
// ("chromium", with the run and the pid), and keeps its last bytes for the
// error of a start that failed.
type outputLog struct {
	log  *slog.Logger
	run  string
	pid  int
	tail *tailBuffer

	mu      sync.Mutex
	partial []byte
}

// maxOutputLine bounds one logged line of the browser's output.
const maxOutputLine = 4 << 10

func (o *outputLog) Write(p []byte) (int, error) {
	_, _ = o.tail.Write(p)
	o.mu.Lock()
	defer o.mu.Unlock()
	o.partial = append(o.partial, p...)
	for {
		i := bytes.IndexByte(o.partial, '\n')
		if i < 0 {
			break
		}
		o.line(o.partial[:i])
		o.partial = o.partial[i+1:]
	}
	if len(o.partial) > maxOutputLine {
		o.line(o.partial)
		o.partial = nil
	}
	return len(p), nil
}

// flush logs what is left once the browser has exited.
func (o *outputLog) flush() {
	o.mu.Lock()
	defer o.mu.Unlock()
	if len(o.partial) > 0 {
		o.line(o.partial)
		o.partial = nil
	}
}

func (o *outputLog) line(b []byte) {
	if s := strings.TrimSpace(string(b)); s != "" {
		o.log.Info("chromium", "run", o.run, "pid", o.pid, "out", state.Clip(s, maxOutputLine))
	}
}

// tailBuffer keeps the last bytes written to it.
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

// ownerFile, in a profile directory on the host, names the stopgate that
// made it, as "HOST-PID" (the form of Chromium's own SingletonLock).
const ownerFile = "stopgate.owner"

func ownerOf(pid int) string {
	host, err := os.Hostname()
	if err != nil {
		host = "unknown-host"
	}
	return host + "-" + strconv.Itoa(pid)
}

// removeStaleProfiles removes the profile directories whose browser is
// gone without its launcher having removed them (stopgate killed with -9:
// the kernel kills the browser, nobody removes its profile). Chromium's own
// SingletonLock ("HOST-PID"), else the launcher's owner file, says whose a
// profile is; one of another host, of a live process, or with neither is
// left alone.
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
			b, ferr := os.ReadFile(filepath.Join(p, ownerFile))
			if ferr != nil {
				continue
			}
			owner = strings.TrimSpace(string(b))
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
