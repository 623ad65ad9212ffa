// Package agentexec runs an unmodified agent's command behind stopgate's
// guard, under one run, and stops it when the run is cancelled: it is
// what `stopgate exec` does.
//
// By default the command runs in a sandbox (sandbox_linux.go): user,
// network, PID and mount namespaces of its own, made as the calling user
// with no root, whose every TCP connection is carried to the egress proxy
// as a CONNECT bound to the run and whose only other traffic is DNS to the
// resolvers named. Unisolated, it runs with the proxy and CA environment
// only (recorded in the run's audit as such). With the kernel redirect
// (root), it runs as a uid of its own behind serve's transparent listener.
//
// In every mode it watches the run: when the cancel commits it writes the
// cancel to STOPGATE_CANCEL_FILE and signals the command's processes
// (SIGTERM unless told otherwise), and at the drain deadline it kills what
// is left; both are events in the run's audit. It exits with the
// command's status.
//
// It never decides a run's state nor guards an effect itself: the control
// API and the proxy do. It never lets the command hold a credential: the
// token stays in exec, outside the sandbox.
package agentexec

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/control/client"
	"github.com/stopgate/stopgate/redirect"
	"github.com/stopgate/stopgate/runtoken"
	"github.com/stopgate/stopgate/state"
)

// Mode is how the command is put behind the guard.
type Mode int

const (
	// Isolated: the sandbox, for any user (the default).
	Isolated Mode = iota
	// Unisolated: the proxy and CA environment only.
	Unisolated
	// KernelRedirect: as its own uid behind serve's transparent listener
	// (root, and serve --transparent-addr).
	KernelRedirect
)

// DefaultProxy is where exec finds the egress proxy when it is not told
// and may not ask (a worker token cannot read /v1/endpoints).
const DefaultProxy = "127.0.0.1:8080"

// DefaultPoll is how often exec reads the run's row while the command runs.
const DefaultPoll = 500 * time.Millisecond

// CancelFileVar names the file exec writes the cancel into.
const CancelFileVar = "STOPGATE_CANCEL_FILE"

// Options say what to run, under which run, and how.
type Options struct {
	Client *client.Client
	// Token is the bearer token Client holds: a run token (a worker's) is
	// also the proxy password; an operator's lets exec ask where the proxy
	// is and mint a run token when the proxy requires one.
	Token string
	Run   string
	// Version is the cancel_version the command observes; 0 takes the run's.
	Version int64
	Argv    []string
	Mode    Mode
	// UID is the user of the kernel redirect (KernelRedirect).
	UID uint32
	// Admit is the admission of a run never seen (its budget and labels;
	// RunID is Run's); nil refuses such a run, so a typo does not become a
	// new run. A run already admitted keeps what it was admitted with.
	Admit *control.AdmitRequest
	// Proxy is the egress proxy's host:port; empty asks /v1/endpoints
	// when the token may, else DefaultProxy.
	Proxy string
	// DNS are the resolvers the command's DNS is carried to; nil reads
	// /etc/resolv.conf.
	DNS []netip.AddrPort
	// CancelSignal is sent to the command's processes when the cancel
	// commits; 0 sends none.
	CancelSignal syscall.Signal
	// Self is the stopgate binary, re-run as the sandbox's init.
	Self string
	// Poll is how often the run is read; 0 is DefaultPoll.
	Poll           time.Duration
	Stdin          io.Reader
	Stdout, Stderr io.Writer
}

// ExitError is the command's exit status (128+N for a death by signal N),
// when it is not 0.
type ExitError struct{ Code int }

func (e *ExitError) Error() string { return "exit status " + strconv.Itoa(e.Code) }

// NotStartedError: the run admits no new work, so the command was not started.
type NotStartedError struct{ msg string }

func (e *NotStartedError) Error() string { return e.msg }

// Run runs opts.Argv behind the guard until it ends, and returns its exit
// status as an *ExitError (nil for 0), or why it could not run it.
func Run(ctx context.Context, opts Options) error {
	if opts.Poll <= 0 {
		opts.Poll = DefaultPoll
	}
	e := &execution{opts: opts, stderr: opts.Stderr}
	return e.run(ctx)
}

type execution struct {
	opts    Options
	stderr  io.Writer
	version int64
	proxy   string
	pass    string
	// intent is exec's own record in the run: that it started the command,
	// and the key its notes (signal, kill, unisolated) are about.
	intent string
	mu     sync.Mutex
}

func (e *execution) warnf(format string, args ...any) {
	e.mu.Lock()
	defer e.mu.Unlock()
	fmt.Fprintf(e.stderr, "stopgate exec: "+format+"\n", args...)
}

func (e *execution) run(ctx context.Context) error {
	o := e.opts
	path, err := exec.LookPath(o.Argv[0])
	if err != nil {
		return fmt.Errorf("CMD %s: %w", o.Argv[0], err)
	}
	if err := e.observe(ctx); err != nil {
		return err
	}
	if err := e.findProxy(ctx); err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "stopgate-exec-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	env, cancelFile, err := e.environment(ctx, dir)
	if err != nil {
		return err
	}
	if err := e.record(ctx); err != nil {
		return err
	}
	var p process
	switch o.Mode {
	case Isolated:
		p, err = e.startSandbox(env)
	case Unisolated:
		p, err = e.startPlain(path, env)
	case KernelRedirect:
		p, err = e.startRedirected(ctx, path, env)
	}
	if err != nil {
		e.note(ctx, "exec.not_started", err.Error())
		return err
	}
	return e.supervise(ctx, p, cancelFile)
}

// observe reads the run: it must exist (or be admitted with Admit) and be
// ACTIVE; the version the command observes is the row's unless given.
func (e *execution) observe(ctx context.Context) error {
	o := e.opts
	row, err := o.Client.Run(ctx, o.Run)
	var ae *client.APIError
	if errors.As(err, &ae) && ae.StatusCode == http.StatusNotFound {
		if o.Admit == nil {
			return &NotStartedError{fmt.Sprintf("run %s was never admitted, so CMD was not started (a mistyped run id must not become a new run): admit it first (stopgate admit %s) or pass --admit", safe(o.Run), safe(o.Run))}
		}
		req := *o.Admit
		req.RunID = o.Run
		if _, err := o.Client.AdmitWith(ctx, req); err != nil {
			return fmt.Errorf("admitting run %s (--admit): %w", safe(o.Run), err)
		}
		row, err = o.Client.Run(ctx, o.Run)
	} else if err == nil && o.Admit != nil && (o.Admit.Budget != nil || len(o.Admit.Labels) > 0) {
		e.warnf("run %s was admitted before: it keeps the budget it was admitted with, not the one given with --admit", safe(o.Run))
	}
	switch {
	case err != nil:
		return fmt.Errorf("reading run %s: %w", safe(o.Run), err)
	case row.Value.Status != state.StatusActive:
		return &NotStartedError{fmt.Sprintf("run %s is %s at cancel_version %d: it admits no new work, so CMD was not started", safe(o.Run), row.Value.Status, row.Value.CancelVersion)}
	}
	e.version = row.Value.CancelVersion
	if o.Version != 0 {
		e.version = o.Version
	}
	return nil
}

// findProxy settles where the proxy is and the password that names the
// run there: the worker's own run token, else (an operator) a token minted
// when the proxy requires one, else the version observed.
func (e *execution) findProxy(ctx context.Context) error {
	o := e.opts
	e.proxy = o.Proxy
	e.pass = strconv.FormatInt(e.version, 10)
	if runtoken.IsToken(o.Token) {
		e.pass = o.Token
		e.proxy = cmpOr(e.proxy, DefaultProxy)
		return nil
	}
	ep, err := o.Client.Endpoints(ctx)
	var ae *client.APIError
	switch {
	case errors.As(err, &ae) && ae.StatusCode == http.StatusForbidden:
		e.proxy = cmpOr(e.proxy, DefaultProxy)
		return nil
	case err != nil:
		if e.proxy != "" {
			return nil
		}
		return fmt.Errorf("asking stopgate serve where its proxy is (or give --proxy): %w", err)
	}
	if e.proxy == "" {
		e.proxy = reachable(ep.Value.Proxy)
	}
	if ep.Value.RunTokens == control.RunTokensRequired {
		tok, err := o.Client.Token(ctx, o.Run, control.TokenRequest{})
		if err != nil {
			return fmt.Errorf("the proxy requires a run token: %w", err)
		}
		e.pass = tok.Value.Token
	}
	return nil
}

// reachable is addr with an unspecified host (a listener on every
// interface) replaced by loopback.
func reachable(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
		host = "127.0.0.1"
		if ip.To4() == nil {
			host = "::1"
		}
	}
	return net.JoinHostPort(host, port)
}

// record guards exec's own effect, starting the command, through the
// control API: a run that stopped admitting work since it was read gets
// no command (the guard's check is atomic), and the record says who
// started what under the run.
func (e *execution) record(ctx context.Context) error {
	o := e.opts
	var id [6]byte
	_, _ = rand.Read(id[:])
	host, _ := os.Hostname()
	key := "exec:" + hex.EncodeToString(id[:])
	g, err := o.Client.Begin(ctx, o.Run, control.IntentRequest{
		Key: key, Method: "EXEC", Target: state.Clip("exec://"+host+"/"+strings.Join(o.Argv, " "), state.MaxTextLen),
		CancelVersion: e.version, Carrier: "exec",
	})
	var ae *client.APIError
	if errors.As(err, &ae) && ae.StatusCode == http.StatusConflict {
		return &NotStartedError{fmt.Sprintf("run %s admits no new work (%s), so CMD was not started", safe(o.Run), ae.Message)}
	}
	if err != nil {
		return fmt.Errorf("recording the start of CMD under run %s: %w", safe(o.Run), err)
	}
	e.intent = g.Value.Intent.Key
	mode := map[Mode]string{Isolated: "isolated (sandbox)", Unisolated: "unisolated (proxy environment only)", KernelRedirect: "kernel redirect of uid " + strconv.FormatUint(uint64(o.UID), 10)}[o.Mode]
	if _, err := o.Client.Finish(ctx, o.Run, key, control.OutcomeRequest{Outcome: control.OutcomeResponded, Reason: "started, " + mode}); err != nil {
		return fmt.Errorf("recording the start of CMD under run %s: %w", safe(o.Run), err)
	}
	return nil
}

// note adds one event to the run's audit, about exec's own intent; a note
// that cannot be written is said on stderr (the command goes on).
func (e *execution) note(ctx context.Context, kind, reason string) {
	if e.intent == "" {
		return
	}
	nctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	err := e.opts.Client.Note(nctx, e.opts.Run, e.intent, control.NoteRequest{Kind: kind, Reason: state.Clip(reason, state.MaxTextLen)})
	if err != nil {
		e.warnf("recording %s in the audit of run %s: %v", kind, safe(e.opts.Run), err)
	}
}

// process is the command as the supervisor sees it, in any mode.
type process interface {
	// forward passes a signal exec received on to the command.
	forward(sig os.Signal)
	// signalTree sends sig to every process of the command.
	signalTree(sig syscall.Signal) error
	// kill kills every process of the command.
	kill()
	// done is closed when the command has ended; wait then returns its status.
	done() <-chan struct{}
	wait() error
	// what names the processes signalTree reaches, for the record.
	what() string
	cleanup(ctx context.Context) error
}

// supervise forwards signals, watches the run, and at its cancel tells
// the command, then kills it at the drain deadline.
func (e *execution) supervise(ctx context.Context, p process, cancelFile string) error {
	sigs := make(chan os.Signal, 8)
	notifySignals(sigs)
	defer stopSignals(sigs)
	poll := time.NewTicker(e.opts.Poll)
	defer poll.Stop()
	var (
		cancelled  bool
		signalled  time.Time
		deadline   <-chan time.Time
		killed     bool
		pollErrors int
	)
	for {
		select {
		case s := <-sigs:
			p.forward(s)
		case <-p.done():
			err := p.wait()
			if cancelled {
				after := ""
				if !signalled.IsZero() {
					after = fmt.Sprintf(", %.2fs after %s", time.Since(signalled).Seconds(), sigName(e.opts.CancelSignal))
				}
				what := "exited"
				if killed {
					what = "killed at the drain deadline"
				}
				e.note(ctx, "exec.exited", fmt.Sprintf("CMD %s with status %d at %s%s", what, statusOf(err), now(), after))
			}
			cerr := p.cleanup(ctx)
			return errors.Join(exitStatus(err), cerr)
		case <-deadline:
			deadline = nil
			killed = true
			p.kill()
			e.warnf("run %s reached its drain deadline: killed CMD's processes (%s)", safe(e.opts.Run), p.what())
			e.note(ctx, "exec.killed", fmt.Sprintf("SIGKILL to %s at %s: the drain deadline passed", p.what(), now()))
		case <-poll.C:
			if cancelled {
				continue
			}
			rctx, cancel := context.WithTimeout(ctx, e.opts.Poll*4)
			row, err := e.opts.Client.Run(rctx, e.opts.Run)
			cancel()
			if err != nil {
				pollErrors++
				if pollErrors == 3 {
					e.warnf("cannot read run %s (%v); the proxy still refuses CMD's effects after a cancel, but CMD will not be told of it until the run can be read", safe(e.opts.Run), err)
				}
				continue
			}
			pollErrors = 0
			r := row.Value
			if r.CancelledAt.IsZero() && r.Status != state.StatusCancelling && r.Status != state.StatusCancelled {
				continue
			}
			cancelled = true
			writeCancelFile(cancelFile, r)
			if sig := e.opts.CancelSignal; sig != 0 {
				signalled = time.Now()
				if err := p.signalTree(sig); err != nil {
					e.warnf("signalling CMD at the cancel: %v", err)
				}
				e.note(ctx, "exec.signal", fmt.Sprintf("%s to %s at %s: run cancelled at cancel_version %d (%s)", sigName(sig), p.what(), now(), r.CancelVersion, r.Reason))
			}
			wait := time.Until(r.DrainDeadline)
			if r.DrainDeadline.IsZero() || wait < 0 {
				wait = 0
			}
			deadline = time.After(wait)
		}
	}
}

func now() string { return time.Now().UTC().Format(time.RFC3339Nano) }

// writeCancelFile writes the run's row, as the API answers it, for a
// command that checks the file (or watches it) instead of a signal.
func writeCancelFile(path string, r state.Run) {
	b, err := json.Marshal(r)
	if err != nil {
		return
	}
	tmp := path + ".tmp"
	if os.WriteFile(tmp, append(b, '\n'), 0o644) == nil {
		_ = os.Rename(tmp, path)
	}
}

func sigName(s syscall.Signal) string {
	if s == 0 {
		return "no signal"
	}
	return "SIG" + strings.ToUpper(strings.TrimPrefix(unix.SignalName(s), "SIG"))
}

// ParseSignal reads --cancel-signal: a name (TERM, SIGTERM, INT, ...), a
// number, or none.
func ParseSignal(s string) (syscall.Signal, error) {
	if strings.EqualFold(s, "none") {
		return 0, nil
	}
	if n, err := strconv.Atoi(s); err == nil && n > 0 && n < 65 {
		return syscall.Signal(n), nil
	}
	name := strings.ToUpper(s)
	if !strings.HasPrefix(name, "SIG") {
		name = "SIG" + name
	}
	if sig := unix.SignalNum(name); sig != 0 {
		return sig, nil
	}
	return 0, fmt.Errorf("%q: want a signal name (TERM, INT, HUP, ...), a number, or none", s)
}

func statusOf(err error) int {
	var ee *ExitError
	if errors.As(exitStatus(err), &ee) {
		return ee.Code
	}
	if err != nil {
		return -1
	}
	return 0
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
		return &ExitError{Code: 128 + int(ws.Signal())}
	}
	if ee.ExitCode() == 0 {
		return nil
	}
	return &ExitError{Code: ee.ExitCode()}
}

// safe quotes a run id for a message when it holds anything unusual.
func safe(s string) string {
	for _, c := range s {
		if c < 0x20 || c == 0x7f {
			return strconv.Quote(s)
		}
	}
	return s
}

func cmpOr(vals ...string) string {
	for _, v := range vals {
		if v != "" {
			return v
		}
	}
	return ""
}

// resolvers are the resolvers DNS is carried to: opts.DNS, else the
// system's.
func (e *execution) resolvers() ([]netip.AddrPort, []netip.AddrPort, error) {
	system, err := redirect.Resolvers(redirect.ResolvConf)
	if len(e.opts.DNS) > 0 {
		// The command asks the nameservers of its resolv.conf (the same
		// file); what it asks is carried to the ones named.
		return e.opts.DNS, system, nil
	}
	if err != nil {
		return nil, nil, err
	}
	return system, system, nil
}
