package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/control/client"
	"github.com/stopgate/stopgate/redirect"
	"github.com/stopgate/stopgate/state"
)

// DefaultIsolateUID is the user exec --isolate runs CMD as: nobody.
const DefaultIsolateUID = 65534

// Bounds of exec --isolate's housekeeping.
const (
	bindingTTL = 30 * time.Second
	// leftoverWait bounds killing what CMD left running as its uid.
	leftoverWait = 5 * time.Second
	// cleanupTimeout bounds removing the redirect and the binding.
	cleanupTimeout = 15 * time.Second
)

// Proxy and CA variables exec sets or clears for CMD. Every common runtime
// reads one of these; both cases, because curl reads only lower-case
// http_proxy and Go and Python read either.
var (
	proxyVars = []string{"HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"}
	// noProxyVars are cleared: an inherited exception list is a way around the guard.
	noProxyVars = []string{"NO_PROXY", "no_proxy"}
	// caBundleVars replace the trusted roots, so they get the system roots plus the CA.
	caBundleVars = []string{"SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO", "AWS_CA_BUNDLE", "HTTPLIB2_CA_CERTS", "PIP_CERT", "NIX_SSL_CERT_FILE", "CARGO_HTTP_CAINFO", "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH", "DENO_CERT"}
	// caExtraVars add to the roots, so they get the CA alone.
	caExtraVars = []string{"NODE_EXTRA_CA_CERTS"}
)

// systemBundles are where distributions keep the system's roots (as Go looks for them).
var systemBundles = []string{
	"/etc/ssl/certs/ca-certificates.crt",
	"/etc/pki/tls/certs/ca-bundle.crt",
	"/etc/ssl/ca-bundle.pem",
	"/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
	"/etc/ssl/cert.pem",
}

// envNotice lists the clients that still go around the proxy variables.
const envNotice = `stopgate exec: run %s goes through the proxy at %s for every client that reads the proxy variables (set in both cases). These ignore them and go around the guard, unseen:
  - Node.js's built-in fetch and http before the Node version that reads NODE_USE_ENV_PROXY (set; Node 20 does not);
  - Go programs, for loopback destinations (127.0.0.1, localhost);
  - anything that opens its own sockets (raw TCP, gRPC without proxy support, many database drivers).
Use --isolate (as root) to put every TCP connection of the command behind the guard.
`

type execOpts struct {
	run     string
	version int64
	isolate bool
	uid     int64
	controlFlags
}

func (c *cli) execFlags() (*flag.FlagSet, *execOpts) {
	fs := flag.NewFlagSet("exec", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	o := &execOpts{}
	fs.StringVar(&o.run, "run", "", "the run CMD's effects belong to (required)")
	fs.Int64Var(&o.version, "version", 0, "the cancel_version CMD observes (default: the run's now)")
	fs.BoolVar(&o.isolate, "isolate", false, "run CMD as --uid with the kernel redirect, so that every TCP connection it opens is guarded (root)")
	fs.Int64Var(&o.uid, "uid", DefaultIsolateUID, "with --isolate: the user CMD runs as; nothing else may run as it")
	o.controlFlags.define(fs, "")
	return fs, o
}

// execVerb runs CMD behind the guard: with the proxy and CA environment,
// or, with --isolate, as its own uid behind the kernel redirect. CMD's
// exit status is passed through; the signals exec receives are forwarded.
func (c *cli) execVerb(ctx context.Context, args []string) error {
	fs, o := c.execFlags()
	// Flags end at CMD: its own flags are its own.
	if err := fs.Parse(args); err != nil {
		return flagError("exec", err)
	}
	argv := fs.Args()
	switch {
	case o.run == "":
		return usagef("exec", "--run is required: the run CMD's effects belong to")
	case len(argv) == 0:
		return usagef("exec", "missing CMD: stopgate exec --run RUN [--isolate] -- CMD [ARGS...]")
	case o.version < 0:
		return usagef("exec", "--version %d: want a cancel_version of 1 or more", o.version)
	case o.uid < 0 || o.uid > 1<<32-2:
		return usagef("exec", "--uid %d: want 0 to %d", o.uid, int64(1<<32-2))
	case o.isolate && o.uid == 0:
		return usagef("exec", "--uid 0: root is never redirected away from its own rules; pick an unprivileged uid")
	}
	if err := state.ValidateRunID(o.run); err != nil {
		return usagef("exec", "--run: %s", strings.TrimPrefix(err.Error(), state.ErrInvalid.Error()+": "))
	}
	path, err := exec.LookPath(argv[0])
	if err != nil {
		return fmt.Errorf("CMD %s: %w", argv[0], err)
	}
	cl, err := c.controlClient("exec", o.controlFlags)
	if err != nil {
		return err
	}
	ep, err := cl.Endpoints(ctx)
	if err != nil {
		return fmt.Errorf("asking stopgate serve where its listeners are: %w", err)
	}
	version, err := c.observedVersion(ctx, cl, o)
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "stopgate-exec-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	env, err := c.guardEnv(ctx, cl, o, ep.Value, version, dir)
	if err != nil {
		return err
	}
	cmd := exec.Command(path, argv[1:]...)
	cmd.Args[0] = argv[0]
	cmd.Env = env
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, c.stdout, c.stderr
	if !o.isolate {
		fmt.Fprintf(c.stderr, envNotice, o.run, ep.Value.Proxy)
		return c.runForwarding(cmd)
	}
	return c.runIsolated(ctx, cl, o, ep.Value, version, cmd)
}

// observedVersion is the version CMD's effects are checked against: --version,
// else the run's now. A run that can admit nothing more is an error before
// CMD starts; a run never seen is left to serve (auto-admit or refusal).
func (c *cli) observedVersion(ctx context.Context, cl *client.Client, o *execOpts) (int64, error) {
	row, err := cl.Run(ctx, o.run)
	var ae *client.APIError
	switch {
	case errors.As(err, &ae) && ae.StatusCode == http.StatusNotFound:
		return o.version, nil
	case err != nil:
		return 0, err
	case row.Value.Status != state.StatusActive:
		return 0, fmt.Errorf("run %s is %s at cancel_version %d: it admits no new work, so CMD was not started", safe(o.run), row.Value.Status, row.Value.CancelVersion)
	case o.version != 0:
		return o.version, nil
	}
	return row.Value.CancelVersion, nil
}

// guardEnv is CMD's environment: the caller's without STOPGATE_* variables, with the CA trusted by every
// common runtime and, without --isolate, the proxy with the run's identity.
// Under --isolate the proxy variables are cleared instead: the kernel
// carries every connection, and a client sending to the proxy would be
// redirected on its way there.
func (c *cli) guardEnv(ctx context.Context, cl *client.Client, o *execOpts, ep control.Endpoints, version int64, dir string) ([]string, error) {
	set := map[string]string{}
	unset := append(append([]string{}, proxyVars...), noProxyVars...)
	unset = append(unset, "NODE_USE_ENV_PROXY")
	pem, err := cl.CA(ctx)
	var ae *client.APIError
	switch {
	case errors.As(err, &ae) && ae.StatusCode == http.StatusNotFound:
		fmt.Fprintln(c.stderr, "stopgate exec: this stopgate intercepts no HTTPS (no CA): HTTPS reaches only pass-through hosts")
	case err != nil:
		return nil, fmt.Errorf("reading the CA: %w", err)
	default:
		caFile, bundleFile, err := writeCA(dir, pem)
		if err != nil {
			return nil, err
		}
		for _, k := range caBundleVars {
			set[k] = bundleFile
		}
		for _, k := range caExtraVars {
			set[k] = caFile
		}
	}
	if !o.isolate {
		proxyURL, err := c.proxyURL(ctx, cl, o, ep, version)
		if err != nil {
			return nil, err
		}
		for _, k := range proxyVars {
			set[k] = proxyURL
		}
		set["NODE_USE_ENV_PROXY"] = "1"
	}
	env := make([]string, 0, len(set)+64)
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if _, ok := set[k]; ok || contains(unset, k) {
			continue
		}
		// The operator's token and stopgate's own settings are not the
		// agent's: with them it could drive the control API.
		if strings.HasPrefix(k, "STOPGATE_") {
			continue
		}
		env = append(env, kv)
	}
	for k, v := range set {
		env = append(env, k+"="+v)
	}
	return env, nil
}

// proxyURL names the run in the proxy's credentials: a signed token when the
// proxy requires one, else the observed version.
func (c *cli) proxyURL(ctx context.Context, cl *client.Client, o *execOpts, ep control.Endpoints, version int64) (string, error) {
	host, port, err := net.SplitHostPort(ep.Proxy)
	if err != nil {
		return "", fmt.Errorf("proxy address %q: %w", ep.Proxy, err)
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
		// Listening on every interface: reach it where the control API is.
		host = loopbackOf(ip)
	}
	user := url.User(o.run)
	switch {
	case ep.RunTokens == control.RunTokensRequired:
		tok, err := cl.Token(ctx, o.run, control.TokenRequest{})
		if err != nil {
			return "", fmt.Errorf("the proxy requires a run token: %w", err)
		}
		user = url.UserPassword(o.run, tok.Value.Token)
	case version > 0:
		user = url.UserPassword(o.run, strconv.FormatInt(version, 10))
	}
	return (&url.URL{Scheme: "http", User: user, Host: net.JoinHostPort(host, port)}).String(), nil
}

func loopbackOf(ip net.IP) string {
	if ip.To4() == nil {
		return "::1"
	}
	return "127.0.0.1"
}

// writeCA writes the CA alone (for variables that add to the roots) and
// the system roots plus the CA (for variables that replace them, so that
// pass-through hosts still verify), readable by CMD's uid.
func writeCA(dir string, pem []byte) (caFile, bundleFile string, err error) {
	if err := os.Chmod(dir, 0o755); err != nil {
		return "", "", err
	}
	caFile, bundleFile = filepath.Join(dir, "stopgate-ca.pem"), filepath.Join(dir, "ca-bundle.pem")
	bundle := []byte{}
	for _, p := range systemBundles {
		if b, err := os.ReadFile(p); err == nil {
			bundle = append(b, '\n')
			break
		}
	}
	bundle = append(bundle, pem...)
	for path, data := range map[string][]byte{caFile: pem, bundleFile: bundle} {
		if err := os.WriteFile(path, data, 0o644); err != nil {
			return "", "", fmt.Errorf("writing the CA for CMD: %w", err)
		}
	}
	return caFile, bundleFile, nil
}

// runIsolated runs cmd as o.uid behind the kernel redirect to a listener
// bound to the run, and takes both away afterwards, once nothing of the uid
// is left running: a process left behind would otherwise be let out.
func (c *cli) runIsolated(ctx context.Context, cl *client.Client, o *execOpts, ep control.Endpoints, version int64, cmd *exec.Cmd) error {
	if os.Geteuid() != 0 {
		return errors.New("--isolate needs root: CAP_NET_ADMIN for the redirect and CAP_SETUID to run CMD as --uid")
	}
	if ep.Transparent == "" {
		return errors.New("stopgate serve has no transparent mode, which --isolate needs: start it with --transparent-addr (e.g. 127.0.0.1:15001)")
	}
	uid := uint32(o.uid)
	if pids := processesOf(uid); len(pids) > 0 {
		return fmt.Errorf("uid %d already runs processes (%s): their connections would be redirected and recorded under run %s too; pick a uid nothing runs as (--uid)", uid, pidList(pids), safe(o.run))
	}
	ttl := control.TTL(bindingTTL)
	uid64 := int64(uid)
	b, err := cl.Bind(ctx, control.BindingRequest{UID: &uid64, RunID: o.run, CancelVersion: version, LeaseTTL: &ttl})
	if err != nil {
		return fmt.Errorf("binding a transparent listener to run %s for uid %d: %w", safe(o.run), uid, err)
	}
	cleanupCtx := func() (context.Context, context.CancelFunc) {
		return context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	}
	unbind := func() {
		cctx, cancel := cleanupCtx()
		defer cancel()
		if err := cl.Unbind(cctx, b.Value.ID); err != nil {
			fmt.Fprintf(c.stderr, "stopgate exec: removing the binding %s: %v (it expires by itself within %s)\n", b.Value.ID, err, bindingTTL)
		}
	}
	if err := redirect.Install(ctx, redirect.Rules{UID: uid, Port: uint16(b.Value.Port)}); err != nil {
		unbind()
		return err
	}
	gid := uid
	if u, err := user.LookupId(strconv.FormatUint(uint64(uid), 10)); err == nil {
		if g, err := strconv.ParseUint(u.Gid, 10, 32); err == nil {
			gid = uint32(g)
		}
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Credential: &syscall.Credential{Uid: uid, Gid: gid, Groups: []uint32{}},
		// CMD does not outlive a stopgate exec that is killed.
		Pdeathsig: syscall.SIGKILL,
	}
	renewCtx, stopRenew := context.WithCancel(context.WithoutCancel(ctx))
	renewed := make(chan struct{})
	go func() {
		defer close(renewed)
		c.renewBinding(renewCtx, cl, b.Value.ID)
	}()
	runErr := c.runForwarding(cmd)
	stopRenew()
	<-renewed

	// What CMD started and left behind still runs as uid: stop it before
	// the redirect goes, or it would be let out unguarded.
	if left := killUID(uid, leftoverWait); len(left) > 0 {
		fmt.Fprintf(c.stderr, "stopgate exec: processes of uid %d are still running (%s); the redirect stays in place (their connections are refused); remove it with 'stopgate redirect remove --uid %d' once they are gone\n", uid, pidList(left), uid)
		unbind()
		return runErr
	}
	cctx, cancel := cleanupCtx()
	err = redirect.Remove(cctx, uid)
	cancel()
	unbind()
	if err != nil {
		return errors.Join(runErr, fmt.Errorf("removing the redirect of uid %d: %w", uid, err))
	}
	return runErr
}

// renewBinding keeps the binding alive while CMD runs; a renewal that
// fails is said once, and tried again (an expired binding fails closed).
func (c *cli) renewBinding(ctx context.Context, cl *client.Client, id string) {
	t := time.NewTicker(bindingTTL / 3)
	defer t.Stop()
	warned := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		rctx, cancel := context.WithTimeout(ctx, bindingTTL/3)
		_, err := cl.RenewBinding(rctx, id)
		cancel()
		if err != nil && !warned && ctx.Err() == nil {
			warned = true
			fmt.Fprintf(c.stderr, "stopgate exec: renewing the transparent binding: %v (if it expires, CMD's connections are refused)\n", err)
		}
	}
}

// runForwarding runs cmd, forwarding the signals stopgate receives, and
// passes its exit status through (128+N for a death by signal N, as shells do).
func (c *cli) runForwarding(cmd *exec.Cmd) error {
	sigs := []os.Signal{syscall.SIGTERM, syscall.SIGHUP, syscall.SIGUSR1, syscall.SIGUSR2, syscall.SIGWINCH}
	if !stdinIsTerminal() {
		// From a terminal, these reach the whole foreground process group,
		// CMD included: forwarding them would deliver them twice.
		sigs = append(sigs, syscall.SIGINT, syscall.SIGQUIT)
	}
	ch := make(chan os.Signal, 8)
	signal.Notify(ch, sigs...)
	defer signal.Stop(ch)
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", cmd.Args[0], err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	for {
		select {
		case s := <-ch:
			_ = cmd.Process.Signal(s)
		case err := <-done:
			return exitStatus(err)
		}
	}
}

func exitStatus(err error) error {
	if err == nil {
		return nil
	}
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		return err
	}
	if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return &exitCodeError{code: 128 + int(ws.Signal())}
	}
	return &exitCodeError{code: ee.ExitCode()}
}

func stdinIsTerminal() bool {
	st, err := os.Stdin.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// processesOf lists the processes (zombies aside) whose real or effective
// uid is uid.
func processesOf(uid uint32) []int {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	want := strconv.FormatUint(uint64(uid), 10)
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		f, err := os.Open(filepath.Join("/proc", e.Name(), "status"))
		if err != nil {
			continue
		}
		zombie, match := false, false
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			line := sc.Text()
			if v, ok := strings.CutPrefix(line, "State:"); ok {
				zombie = strings.HasPrefix(strings.TrimSpace(v), "Z")
			}
			if v, ok := strings.CutPrefix(line, "Uid:"); ok {
				f := strings.Fields(v)
				match = len(f) >= 2 && (f[0] == want || f[1] == want)
				break
			}
		}
		_ = f.Close()
		if match && !zombie {
			pids = append(pids, pid)
		}
	}
	return pids
}

// killUID kills every process of uid until none is left or wait passes,
// and returns those still there.
func killUID(uid uint32, wait time.Duration) []int {
	deadline := time.Now().Add(wait)
	for {
		pids := processesOf(uid)
		if len(pids) == 0 || time.Now().After(deadline) {
			return pids
		}
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func pidList(pids []int) string {
	s := make([]string, 0, min(len(pids), 5))
	for i, p := range pids {
		if i == 5 {
			s = append(s, "…")
			break
		}
		s = append(s, "pid "+strconv.Itoa(p))
	}
	return strings.Join(s, ", ")
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}
