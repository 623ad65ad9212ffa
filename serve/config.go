package serve

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/stopgate/stopgate/browserguard"
	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/proxy"
	"github.com/stopgate/stopgate/runtoken"
	"github.com/stopgate/stopgate/runwatch"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/redisstore"
	"github.com/stopgate/stopgate/state/stores"
)

// Config is everything stopgate serve is told, from flags and
// STOPGATE_* variables, checked before anything starts.
type Config struct {
	ProxyAddr   string // egress proxy listener
	ControlAddr string // control API listener
	BrowserAddr string // browser guard (CDP) listener
	// TransparentAddr is the listener for connections the kernel redirects
	// (transparent mode); empty: off.
	TransparentAddr string
	// Chromium is the browser the launcher starts for a run.
	Chromium string
	// BrowserLinger is how long the browser of a run that is over stays up,
	// refusing actions and serving reads, before it is stopped.
	BrowserLinger time.Duration
	// BrowserMax caps the browsers running at once.
	BrowserMax int
	// BrowserIsolation is how each browser is kept from the machine;
	// BrowserUID what it runs as where serve is root; BrowserUploadDir the
	// directory whose RUN subdirectory run RUN's pages may be given files
	// from (empty: none).
	BrowserIsolation string
	BrowserUID       int
	BrowserUploadDir string
	// Store is a redis:// URL, or empty for the embedded store in DataDir.
	Store string
	// StorePassword authenticates to Redis in place of a password in the
	// URL: from StorePasswordFile, or STOPGATE_STORE_PASSWORD (there is no
	// flag: a command line shows it to every user of the machine).
	StorePassword     string
	StorePasswordFile string
	DataDir           string
	// Config is the YAML policy file; empty means none.
	Config string
	// Run is the static run every proxied request belongs to when it names
	// none; empty means requests must name theirs.
	Run            string
	RequireDurable bool
	// ControlAuth is authToken (every control request but the probes, the
	// scraper and the CA needs a token) or authNone (an open control plane).
	ControlAuth string
	// ControlToken is the operator token, from --control-token or read
	// from ControlTokenFile; empty: DataDir/operator.token, created on the
	// first start.
	ControlToken     string
	ControlTokenFile string
	// ReadTokenFile holds the read-only token; empty:
	// DataDir/read-only.token, created on the first start.
	ReadTokenFile string
	// DrainTimeout is the drain of a cancel that names none.
	DrainTimeout time.Duration
	AutoAdmit    bool
	LogLevel     slog.Level
	// LogFormat is text (logfmt-like, for a terminal) or json (for a log
	// pipeline): every decision is one line either way.
	LogFormat string
	// AccessLog writes one line per proxied request at info.
	AccessLog bool
	// MetricsAddr is a listener serving /metrics alone (the scraper's,
	// apart from the control API); empty: none.
	MetricsAddr string
	// ReadyFile receives the listeners' bound addresses once all are up
	// (package readyfile); empty: none written.
	ReadyFile string
	// LeaseTTL is how long an in-flight effect stays leased to this
	// instance without renewal; a killed instance's effects turn UNKNOWN then.
	LeaseTTL time.Duration
	// StoreTimeout bounds each store call on the request path; past it the
	// proxy answers 503 (fail closed).
	StoreTimeout time.Duration
	// RecheckInterval: how often open connections re-read their run's row.
	RecheckInterval time.Duration
	// SweepInterval: how often live runs are ticked (lease expiry, drain).
	SweepInterval time.Duration
	// CancelReplicas makes a Redis cancel wait for that many replicas.
	CancelReplicas int
	// Retention is how long the intents and events of a finished run are
	// kept; zero keeps them forever. Rows (tombstones) are never removed.
	Retention time.Duration
	// MaxBody caps a proxied request body, in bytes.
	MaxBody int64
	// SpoolDir holds large request bodies while they are digested.
	SpoolDir string
	// RunTokenSecret signs and verifies run tokens (the workers'
	// credentials), from --run-token-secret or read from
	// RunTokenSecretFile; empty: DataDir/run-token.secret, created on the
	// first start.
	RunTokenSecret     string
	RunTokenSecretFile string
	// SecretsOnCommandLine names the secret flags given on the command
	// line, where every user of the machine can read them (ps); serve
	// warns about each.
	SecretsOnCommandLine string
	// RequireRunToken makes a signed token the only way a client names its run.
	RequireRunToken bool

	// AllowDest opens destinations the proxy refuses by default (loopback,
	// private ranges): hosts and CIDRs, added to the policy's allow list.
	AllowDest []string
	// MaxConns and MaxConnsPerRun cap the proxy's open exchanges.
	MaxConns, MaxConnsPerRun int
	// MaxWatches and MaxWatchesPerRun cap the control API's watches of runs.
	MaxWatches, MaxWatchesPerRun int
	// TunnelHandshakeTimeout bounds a tunnel's start, ClientIdleTimeout a
	// proxy client's silence.
	TunnelHandshakeTimeout, ClientIdleTimeout time.Duration
	// CACert and CAKey name an operator-provided CA (one for a fleet);
	// empty: the CA in DataDir, created on first start.
	CACert, CAKey string
}

// ConfigError is a mistake in what serve was told (a flag, a variable, a
// file either names), said naming where the value came from: the
// operator's to fix before serve can start, where any other error is the
// server's. The CLI exits 2 on it.
type ConfigError struct{ msg string }

func (e *ConfigError) Error() string { return e.msg }

func configErrorf(format string, args ...any) error {
	return &ConfigError{msg: fmt.Sprintf(format, args...)}
}

// logger writes serve's log to w in the configured format and level.
func (c Config) logger(w io.Writer) *slog.Logger {
	opts := &slog.HandlerOptions{Level: c.LogLevel}
	if c.LogFormat == "json" {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// storeConfig is the store serve opens.
func (c Config) storeConfig() stores.Config {
	return stores.Config{URL: c.Store, Password: c.StorePassword, DataDir: c.DataDir, RequireDurable: c.RequireDurable, OpTimeout: c.StoreTimeout, CancelReplicas: c.CancelReplicas}
}

// Flags are serve's flags with their defaults and help, as `stopgate help
// serve` prints them.
func Flags() *flag.FlagSet {
	fs, _ := newFlags()
	return fs
}

// newFlags defines serve's flags, with their defaults, on a fresh set.
func newFlags() (*flag.FlagSet, *Config) {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	cfg := &Config{LogLevel: slog.LevelInfo}
	fs.StringVar(&cfg.ProxyAddr, "proxy-addr", "127.0.0.1:8080", "egress proxy listen address (host:port)")
	fs.StringVar(&cfg.ControlAddr, "control-addr", "127.0.0.1:8081", "control API listen address (host:port)")
	fs.StringVar(&cfg.BrowserAddr, "browser-addr", "127.0.0.1:8082", "browser guard (CDP websocket) listen address (host:port)")
	fs.StringVar(&cfg.TransparentAddr, "transparent-addr", "", "listen address (host:port) for connections the kernel redirects to stopgate (stopgate redirect, exec --isolate); empty: transparent mode off")
	fs.StringVar(&cfg.Chromium, "chromium", browserguard.DefaultChromium, "the Chromium binary launched for a run's browser")
	cfg.BrowserLinger = browserguard.DefaultLinger
	fs.Var(durationValue{&cfg.BrowserLinger}, "browser-linger", "`duration` the browser of a run that is over stays up (actions refused, reads served) before it is stopped")
	fs.IntVar(&cfg.BrowserMax, "browser-max", browserguard.DefaultMaxBrowsers, "most browsers running at once; a launch past it is refused (503 browser_limit)")
	fs.StringVar(&cfg.BrowserIsolation, "browser-isolation", string(browserguard.IsolateNamespaces), "`mode`: namespaces (each browser in namespaces of its own: no view of the machine's files, a network that reaches only its egress proxy) or none (a plain child process; refused with --require-run-token)")
	fs.IntVar(&cfg.BrowserUID, "browser-uid", browserguard.DefaultBrowserUID, "`uid` (and gid) the browsers run as where serve runs as root; nothing else may run as it")
	fs.StringVar(&cfg.BrowserUploadDir, "browser-upload-dir", "", "`directory` whose RUN subdirectory run RUN's pages may be given files from (DOM.setFileInputFiles, dropped files); empty: files are never given to pages")
	fs.StringVar(&cfg.Store, "store", "", "store URL: redis://[[USER]:PASSWORD@]HOST:PORT/DB, rediss://..., redis-sentinel://H:P[,H:P]/DB?master=NAME, redis-cluster://H:P[,H:P]; empty: the embedded store in --data-dir")
	fs.StringVar(&cfg.StorePasswordFile, "store-password-file", "", "`file` holding the Redis password, for any --store URL form (or STOPGATE_STORE_PASSWORD; never in --store on a command line, where ps shows it)")
	fs.StringVar(&cfg.DataDir, "data-dir", control.DefaultDataDir, "directory of the embedded store ("+stores.EmbeddedFile+"), the CA and the operator token")
	fs.StringVar(&cfg.Config, "config", "", "YAML policy file (optional)")
	fs.StringVar(&cfg.Run, "run", "", "static run id for requests that name none")
	fs.Var(boolValue{&cfg.RequireDurable}, "require-durable", "refuse to start unless the store persists every write before acknowledging it")
	cfg.ControlAuth = authToken
	fs.StringVar(&cfg.ControlAuth, "control-auth", authToken, "`mode`: token (the control API needs a bearer token) or none (open to whoever reaches it; loudly logged)")
	fs.StringVar(&cfg.ControlToken, "control-token", "", "the operator's bearer `token` (16 bytes or more; visible in ps: prefer --control-token-file or the environment); default: "+control.OperatorTokenFile+" in --data-dir, created on the first start")
	fs.StringVar(&cfg.ControlTokenFile, "control-token-file", "", "`file` holding the operator's bearer token")
	fs.StringVar(&cfg.ReadTokenFile, "read-token-file", "", "`file` holding the read-only bearer token; default: "+control.ReadTokenFile+" in --data-dir, created on the first start")
	cfg.DrainTimeout = 30 * time.Second
	fs.Var(durationValue{&cfg.DrainTimeout}, "drain-timeout", "`duration` a cancel that names none may drain")
	cfg.AutoAdmit = true
	fs.Var(boolValue{&cfg.AutoAdmit}, "auto-admit", "admit an unseen run on its first request")
	fs.Var(levelValue{&cfg.LogLevel}, "log-level", "`level`: debug, info, warn or error")
	fs.StringVar(&cfg.LogFormat, "log-format", "text", "`format` of the log: text or json (one object per line)")
	fs.Var(boolValue{&cfg.AccessLog}, "access-log", "log one line per proxied request at info (msg=access): run, method, host, intent, recorded state, status, bytes each way, upstream latency, duration")
	fs.StringVar(&cfg.ReadyFile, "ready-file", "", "file to write, once every listener is up, their bound addresses as JSON (proxy, control, browser, metrics, transparent): with port 0 for a listener, how a caller learns the port; empty: none")
	fs.StringVar(&cfg.MetricsAddr, "metrics-addr", "", "listen address (host:port) of a listener that serves /metrics and nothing else, for a scraper that must not reach the control API; empty: /metrics is on the control API only")
	cfg.LeaseTTL = intents.DefaultLeaseTTL
	fs.Var(durationValue{&cfg.LeaseTTL}, "lease-ttl", "`duration` an in-flight effect stays leased to this instance without renewal")
	cfg.StoreTimeout = state.DefaultTimeout
	fs.Var(durationValue{&cfg.StoreTimeout}, "store-timeout", "`duration` a store call may take before the proxy fails closed with 503")
	cfg.RecheckInterval = runwatch.DefaultInterval
	fs.Var(durationValue{&cfg.RecheckInterval}, "recheck-interval", "`duration` between re-reads of the rows of runs with open connections")
	cfg.SweepInterval = intents.DefaultSweepInterval
	fs.Var(durationValue{&cfg.SweepInterval}, "sweep-interval", "`duration` between ticks of live runs (lease expiry, drain deadlines)")
	fs.IntVar(&cfg.CancelReplicas, "cancel-replicas", 0, "with a Redis store: a cancel is acknowledged only once this many replicas have it (Redis WAIT), so a failover cannot lose it; 0: the primary's word (docs/durability.md)")
	cfg.Retention = 7 * 24 * time.Hour
	fs.Var(durationValue{&cfg.Retention}, "retention", "`duration` the intents and events of a finished (CANCELLED, COMPLETED) run are kept; 0 keeps them forever; the run rows always stay")
	fs.Int64Var(&cfg.MaxBody, "max-body", proxy.DefaultMaxBody, "largest proxied request body, in bytes; larger ones get 413")
	fs.StringVar(&cfg.SpoolDir, "spool-dir", "", "directory for large request bodies while they are digested (default: the system temp dir)")
	fs.StringVar(&cfg.RunTokenSecret, "run-token-secret", "", "`secret` (32 bytes or more) that signs run tokens, the workers' credentials for the proxy and the control API (visible in ps: prefer --run-token-secret-file); default: "+control.RunTokenSecretFile+" in --data-dir, created on the first start. A fleet shares one")
	fs.StringVar(&cfg.RunTokenSecretFile, "run-token-secret-file", "", "`file` holding the secret that signs run tokens")
	fs.Var(boolValue{&cfg.RequireRunToken}, "require-run-token", "accept no run identity from clients but a signed run token")
	fs.StringVar(&cfg.CACert, "ca-cert", "", "the MITM CA's certificate file, for one CA across a fleet (with --ca-key); empty: the CA in --data-dir, created on first start")
	fs.StringVar(&cfg.CAKey, "ca-key", "", "the MITM CA's key file (mode 0600 or 0400; with --ca-cert)")
	fs.Var(listValue{&cfg.AllowDest}, "allow-dest", "`HOST|CIDR` the proxy may reach although it is loopback or private (repeatable; comma-separated in STOPGATE_ALLOW_DEST)")
	fs.IntVar(&cfg.MaxConns, "max-conns", proxy.DefaultMaxConns, "most requests and tunnels the proxy holds open at once; past it: 429 too_many_connections")
	fs.IntVar(&cfg.MaxConnsPerRun, "max-conns-per-run", proxy.DefaultMaxConnsPerRun, "most requests and tunnels one run holds open at once through the proxy")
	fs.IntVar(&cfg.MaxWatches, "max-watches", control.DefaultMaxWatches, "most watches of runs (streams and long polls) the control API serves at once; past it: 429 too_many_connections")
	fs.IntVar(&cfg.MaxWatchesPerRun, "max-watches-per-run", control.DefaultMaxWatchesPerRun, "most watches of one run the control API serves at once")
	cfg.TunnelHandshakeTimeout = proxy.DefaultHandshakeTimeout
	fs.Var(durationValue{&cfg.TunnelHandshakeTimeout}, "tunnel-handshake-timeout", "`duration` from a CONNECT's 200 to its TLS handshake (or first byte)")
	cfg.ClientIdleTimeout = proxy.DefaultIdleTimeout
	fs.Var(durationValue{&cfg.ClientIdleTimeout}, "client-idle-timeout", "`duration` a proxy client may be silent: mid-body, between requests in a tunnel, both ways in a pass-through tunnel")
	return fs, cfg
}

// storePasswordEnv holds the Redis password; there is no --store-password.
const storePasswordEnv = "STOPGATE_STORE_PASSWORD"

// envName is the variable that sets a serve flag: --control-addr is
// STOPGATE_CONTROL_ADDR.
func envName(flagName string) string {
	return "STOPGATE_" + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// ParseConfig reads serve's command line over the environment (a flag
// on the command line wins) and checks every value, naming the flag or the
// variable that was wrong.
func ParseConfig(args []string, getenv func(string) string) (Config, error) {
	fs, cfg := newFlags()
	if err := fs.Parse(args); errors.Is(err, flag.ErrHelp) {
		return Config{}, err
	} else if err != nil {
		return Config{}, configErrorf("%v", err)
	}
	if pos := fs.Args(); len(pos) > 0 {
		return Config{}, configErrorf("takes no arguments, got %q", pos)
	}
	// source names where each value came from, for the error messages.
	source := map[string]string{}
	fs.Visit(func(f *flag.Flag) { source[f.Name] = "--" + f.Name })
	var onCommandLine []string
	for _, name := range []string{"control-token", "run-token-secret"} {
		if source[name] != "" {
			onCommandLine = append(onCommandLine, "--"+name)
		}
	}
	if source["store"] != "" && redisstore.HasSecret(cfg.Store) {
		onCommandLine = append(onCommandLine, "--store")
	}
	cfg.SecretsOnCommandLine = strings.Join(onCommandLine, ",")
	var envErr error
	fs.VisitAll(func(f *flag.Flag) {
		if envErr != nil || source[f.Name] != "" {
			return
		}
		name := envName(f.Name)
		v := getenv(name)
		if v == "" {
			source[f.Name] = "--" + f.Name
			return
		}
		if err := fs.Set(f.Name, v); err != nil {
			envErr = configErrorf("%s=%q: %v", name, v, err)
		}
		source[f.Name] = name
	})
	if envErr != nil {
		return Config{}, envErr
	}
	// The password's variable has no flag: it is read here, apart.
	if cfg.StorePassword = getenv(storePasswordEnv); cfg.StorePassword != "" {
		source["store-password"] = storePasswordEnv
	}
	if err := cfg.validate(source); err != nil {
		return Config{}, err
	}
	return *cfg, nil
}

func (c *Config) validate(source map[string]string) error {
	bad := func(name, format string, args ...any) error {
		return configErrorf("%s: %s", source[name], fmt.Sprintf(format, args...))
	}
	if err := c.readStorePassword(source); err != nil {
		return err
	}
	for _, check := range []func(badFlag) error{c.checkListeners, c.checkStore, c.checkFiles, c.checkDurations, c.checkLimits} {
		if err := check(bad); err != nil {
			return err
		}
	}
	return c.readSecrets(source)
}

// badFlag makes the usage error of the flag name (as the user set it).
type badFlag func(name, format string, args ...any) error

// checkListeners: every address parses, and no two listeners share one.
func (c *Config) checkListeners(bad badFlag) error {
	for name, addr := range map[string]string{"proxy-addr": c.ProxyAddr, "control-addr": c.ControlAddr, "browser-addr": c.BrowserAddr} {
		if err := checkAddr(addr); err != nil {
			return bad(name, "%q: %v", addr, err)
		}
	}
	if sameListener(c.ProxyAddr, c.ControlAddr) {
		return bad("control-addr", "%q is also the proxy address; the two listeners need different ports", c.ControlAddr)
	}
	for name, other := range map[string]string{"proxy": c.ProxyAddr, "control": c.ControlAddr} {
		if sameListener(c.BrowserAddr, other) {
			return bad("browser-addr", "%q is also the %s address; the listeners need different ports", c.BrowserAddr, name)
		}
	}
	if c.MetricsAddr != "" {
		if err := checkAddr(c.MetricsAddr); err != nil {
			return bad("metrics-addr", "%q: %v", c.MetricsAddr, err)
		}
		for name, other := range map[string]string{"proxy": c.ProxyAddr, "control": c.ControlAddr, "browser": c.BrowserAddr, "transparent": c.TransparentAddr} {
			if sameListener(c.MetricsAddr, other) {
				return bad("metrics-addr", "%q is also the %s address; the listeners need different ports", c.MetricsAddr, name)
			}
		}
	}
	if c.TransparentAddr == "" {
		return nil
	}
	if err := checkAddr(c.TransparentAddr); err != nil {
		return bad("transparent-addr", "%q: %v", c.TransparentAddr, err)
	}
	for name, other := range map[string]string{"proxy": c.ProxyAddr, "control": c.ControlAddr, "browser": c.BrowserAddr} {
		if sameListener(c.TransparentAddr, other) {
			return bad("transparent-addr", "%q is also the %s address; the listeners need different ports", c.TransparentAddr, name)
		}
	}
	return nil
}

// readStorePassword reads the Redis password from its file, and checks it
// is given once: before checkStore, which checks it against the URL.
func (c *Config) readStorePassword(source map[string]string) error {
	if c.StorePasswordFile == "" {
		return nil
	}
	if c.StorePassword != "" {
		return configErrorf("%s and %s are both set; give one", source["store-password-file"], storePasswordEnv)
	}
	secret, _, err := control.ReadSecretFile(c.StorePasswordFile)
	if err != nil {
		return configErrorf("%s: %v", source["store-password-file"], err)
	}
	c.StorePassword, source["store-password"] = secret, source["store-password-file"]
	return nil
}

// checkStore: the store's URL or directory, and what is asked of it.
func (c *Config) checkStore(bad badFlag) error {
	if c.CancelReplicas < 0 {
		return bad("cancel-replicas", "%d is negative; want the number of replicas a cancel waits for (0: none)", c.CancelReplicas)
	}
	if c.CancelReplicas > 0 && c.Store == "" {
		return bad("cancel-replicas", "%d needs a Redis --store: the embedded store has no replicas", c.CancelReplicas)
	}
	if err := stores.Check(c.storeConfig()); err != nil {
		name := "store"
		switch {
		case c.Store == "" && c.StorePassword != "":
			name = "store-password"
		case c.Store == "":
			name = "data-dir"
		}
		return bad(name, "%s", state.Why(err))
	}
	if c.Retention < 0 {
		return bad("retention", "%s is negative; 0 keeps everything", c.Retention)
	}
	return nil
}

// checkFiles: the paths and names given, as far as serve can tell before it
// starts.
func (c *Config) checkFiles(bad badFlag) error {
	// A missing binary is not checked here: serve runs without a browser
	// until one is asked for, and the launch then says what is missing.
	if c.Chromium == "" {
		return bad("chromium", "is empty; want the path of the Chromium binary (default %s)", browserguard.DefaultChromium)
	}
	if _, err := browserguard.ParseIsolation(c.BrowserIsolation); err != nil {
		return bad("browser-isolation", "%v", err)
	}
	if c.BrowserIsolation == string(browserguard.IsolateNone) && c.RequireRunToken {
		return bad("browser-isolation", "none leaves each browser's egress listener open to every local process, which could send as its run without a token: --require-run-token needs namespaces")
	}
	if c.BrowserUID <= 0 || c.BrowserUID >= 1<<32-1 {
		return bad("browser-uid", "%d: want a uid other than root's", c.BrowserUID)
	}
	if c.BrowserUploadDir != "" {
		if st, err := os.Stat(c.BrowserUploadDir); err != nil || !st.IsDir() {
			return bad("browser-upload-dir", "%s is not a directory", c.BrowserUploadDir)
		}
	}
	if c.Config != "" {
		if st, err := os.Stat(c.Config); err != nil {
			return bad("config", "%v", err)
		} else if st.IsDir() {
			return bad("config", "%s is a directory; want the YAML policy file", c.Config)
		}
	}
	if c.Run != "" {
		if err := state.ValidateRunID(c.Run); err != nil {
			return bad("run", "%s", state.Why(err))
		}
	}
	if c.LogFormat != "text" && c.LogFormat != "json" {
		return bad("log-format", "%q: want text or json", c.LogFormat)
	}
	if (c.CACert == "") != (c.CAKey == "") {
		name := "ca-cert"
		if c.CAKey == "" {
			name = "ca-key"
		}
		return bad(name, "is empty: an operator-provided CA needs both --ca-cert and --ca-key (or neither, for the CA in --data-dir)")
	}
	if c.SpoolDir != "" {
		if st, err := os.Stat(c.SpoolDir); err != nil || !st.IsDir() {
			return bad("spool-dir", "%s is not a directory", c.SpoolDir)
		}
	}
	return nil
}

// checkDurations: every duration is positive where it must be, and the
// lease outlives the store calls that renew it.
func (c *Config) checkDurations(bad badFlag) error {
	if c.BrowserLinger < 0 {
		return bad("browser-linger", "%s is negative", c.BrowserLinger)
	}
	if err := state.CheckDrainTimeout(c.DrainTimeout); err != nil {
		return bad("drain-timeout", "%s", state.Why(err))
	}
	for name, d := range map[string]time.Duration{"lease-ttl": c.LeaseTTL, "store-timeout": c.StoreTimeout, "recheck-interval": c.RecheckInterval,
		"sweep-interval": c.SweepInterval, "tunnel-handshake-timeout": c.TunnelHandshakeTimeout, "client-idle-timeout": c.ClientIdleTimeout} {
		if d <= 0 {
			return bad(name, "%s: want a positive duration", d)
		}
	}
	if c.LeaseTTL < 3*c.StoreTimeout {
		return bad("lease-ttl", "%s is shorter than three store timeouts (%s): leases would expire while their renewal is still allowed to wait", c.LeaseTTL, 3*c.StoreTimeout)
	}
	return nil
}

// checkLimits: the caps on what the proxy and the browser guard hold, and
// the destinations opened up.
func (c *Config) checkLimits(bad badFlag) error {
	if c.BrowserMax <= 0 {
		return bad("browser-max", "%d: want a positive number of browsers", c.BrowserMax)
	}
	if c.MaxBody <= 0 {
		return bad("max-body", "%d: want a positive number of bytes", c.MaxBody)
	}
	for name, n := range map[string]int{"max-conns": c.MaxConns, "max-conns-per-run": c.MaxConnsPerRun,
		"max-watches": c.MaxWatches, "max-watches-per-run": c.MaxWatchesPerRun} {
		if n <= 0 {
			return bad(name, "%d: want a positive number", n)
		}
	}
	if err := proxy.CheckDestinationRules(c.AllowDest, nil); err != nil {
		return bad("allow-dest", "%v", err)
	}
	return nil
}

// Modes of --control-auth.
const (
	authToken = "token"
	authNone  = "none"
)

// minControlTokenLen is the shortest operator token serve takes: long
// enough that nobody guesses it over the network.
const minControlTokenLen = 16

// readSecrets checks the control plane's secrets and reads those given as
// files, so that a missing or empty file stops the start with its flag
// named. Secrets not given are created in the data directory at start.
func (c *Config) readSecrets(source map[string]string) error {
	bad := func(name, format string, args ...any) error {
		return configErrorf("%s: %s", source[name], fmt.Sprintf(format, args...))
	}
	switch c.ControlAuth {
	case authToken:
	case authNone:
		for name, v := range map[string]string{"control-token": c.ControlToken, "control-token-file": c.ControlTokenFile, "read-token-file": c.ReadTokenFile} {
			if v != "" {
				return bad(name, "is set, and --control-auth is none: give a token, or open the control plane, not both")
			}
		}
	default:
		return bad("control-auth", "%q: want token or none", c.ControlAuth)
	}
	for _, pair := range []struct{ value, file, valueName, fileName string }{
		{c.ControlToken, c.ControlTokenFile, "control-token", "control-token-file"},
		{c.RunTokenSecret, c.RunTokenSecretFile, "run-token-secret", "run-token-secret-file"},
	} {
		if pair.value != "" && pair.file != "" {
			return bad(pair.valueName, "and %s are both set; give one", source[pair.fileName])
		}
	}
	for _, f := range []struct {
		name, path string
		into       *string
		intoName   string
	}{
		{"control-token-file", c.ControlTokenFile, &c.ControlToken, "control-token"},
		{"read-token-file", c.ReadTokenFile, nil, ""},
		{"run-token-secret-file", c.RunTokenSecretFile, &c.RunTokenSecret, "run-token-secret"},
	} {
		if f.path == "" {
			continue
		}
		secret, _, err := control.ReadSecretFile(f.path)
		if err != nil {
			return bad(f.name, "%v", err)
		}
		if f.into != nil {
			// The checks below name the file the value came from.
			*f.into, source[f.intoName] = secret, source[f.name]
		}
	}
	if c.ControlToken != "" {
		if err := control.CheckSecret(c.ControlToken); err != nil {
			return bad("control-token", "%v", err)
		}
		if len(c.ControlToken) < minControlTokenLen {
			return bad("control-token", "is %d bytes; want at least %d (e.g. openssl rand -hex 32)", len(c.ControlToken), minControlTokenLen)
		}
		if runtoken.IsToken(c.ControlToken) {
			return bad("control-token", "looks like a run token (sg1.…); the operator token must not")
		}
	}
	if c.RunTokenSecret != "" && len(c.RunTokenSecret) < runtoken.MinSecretLen {
		return bad("run-token-secret", "is %d bytes; want at least %d", len(c.RunTokenSecret), runtoken.MinSecretLen)
	}
	return nil
}

// checkAddr accepts host:port with a numeric port; an empty host listens
// on every interface, which an operator must ask for explicitly (":8081").
// sameListener reports whether two listen addresses would be one socket:
// port 0 asks the kernel for a free port, a different one each time.
func sameListener(a, b string) bool {
	_, port, _ := net.SplitHostPort(a)
	return a == b && port != "0"
}

func checkAddr(addr string) error {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("want host:port: %w", unwrapAddrErr(err))
	}
	n, err := strconv.Atoi(port)
	if err != nil || n < 0 || n > 65535 {
		return fmt.Errorf("port %q is not a number from 0 to 65535", port)
	}
	return nil
}

func unwrapAddrErr(err error) error {
	var ae *net.AddrError
	if errors.As(err, &ae) {
		return errors.New(ae.Err)
	}
	return err
}

// The flag values below exist for their error messages, which the flag
// package (or this file, for an environment variable) puts after the name:
// "want a duration such as 30s" says more than "parse error".

type durationValue struct{ d *time.Duration }

func (v durationValue) String() string {
	if v.d == nil {
		return ""
	}
	return v.d.String()
}

func (v durationValue) Set(s string) error {
	d, err := time.ParseDuration(s)
	if err != nil {
		return errors.New("want a duration such as 30s or 2m")
	}
	*v.d = d
	return nil
}

// listValue is a repeatable flag; each value may also be a comma-separated
// list, which is how an environment variable gives several.
type listValue struct{ l *[]string }

func (v listValue) String() string {
	if v.l == nil {
		return ""
	}
	return strings.Join(*v.l, ",")
}

func (v listValue) Set(s string) error {
	for item := range strings.SplitSeq(s, ",") {
		if item = strings.TrimSpace(item); item != "" {
			*v.l = append(*v.l, item)
		}
	}
	return nil
}

type boolValue struct{ b *bool }

func (v boolValue) String() string   { return strconv.FormatBool(v.b != nil && *v.b) }
func (v boolValue) IsBoolFlag() bool { return true }

func (v boolValue) Set(s string) error {
	b, err := strconv.ParseBool(s)
	if err != nil {
		return errors.New("want true or false")
	}
	*v.b = b
	return nil
}

type levelValue struct{ l *slog.Level }

func (v levelValue) String() string {
	if v.l == nil {
		return ""
	}
	return strings.ToLower(v.l.String())
}

func (v levelValue) Set(s string) error {
	var l slog.Level
	if err := l.UnmarshalText([]byte(s)); err != nil {
		return errors.New("want debug, info, warn or error")
	}
	*v.l = l
	return nil
}
