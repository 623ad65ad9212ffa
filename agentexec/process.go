package agentexec

import (
	"bufio"
	"context"
	"errors"
	"fmt"
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
	"github.com/stopgate/stopgate/redirect"
)

// Bounds of the kernel redirect's housekeeping.
const (
	bindingTTL = 30 * time.Second
	// leftoverWait bounds killing what CMD left running as its uid.
	leftoverWait = 5 * time.Second
	// cleanupTimeout bounds removing the redirect and the binding.
	cleanupTimeout = 15 * time.Second
)

// forwardedSignals are the signals exec passes on to the command. From a
// terminal, SIGINT and SIGQUIT reach the whole foreground process group,
// the command included: forwarding them would deliver them twice.
func forwardedSignals() []os.Signal {
	sigs := []os.Signal{syscall.SIGTERM, syscall.SIGHUP, syscall.SIGUSR1, syscall.SIGUSR2, syscall.SIGWINCH}
	if !stdinIsTerminal() {
		sigs = append(sigs, syscall.SIGINT, syscall.SIGQUIT)
	}
	return sigs
}

func notifySignals(ch chan os.Signal) { signal.Notify(ch, forwardedSignals()...) }
func stopSignals(ch chan os.Signal)   { signal.Stop(ch) }

// waited is a started command and the end of its Wait.
type waited struct {
	cmd  *exec.Cmd
	ch   chan struct{}
	werr error
}

func startWaited(cmd *exec.Cmd) (*waited, error) {
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", cmd.Args[0], err)
	}
	w := &waited{cmd: cmd, ch: make(chan struct{})}
	go func() {
		w.werr = cmd.Wait()
		close(w.ch)
	}()
	return w, nil
}

func (w *waited) done() <-chan struct{} { return w.ch }
func (w *waited) wait() error           { <-w.ch; return w.werr }
func (w *waited) forward(s os.Signal)   { _ = w.cmd.Process.Signal(s) }

// sandboxProcess is the command in its sandbox.
type sandboxProcess struct {
	*waited
	s *sandbox
	c *carrier
}

func (e *execution) startSandbox(env []string) (process, error) {
	resolvers, nameservers, err := e.resolvers()
	if err != nil {
		return nil, err
	}
	self := e.opts.Self
	if self == "" {
		if self, err = os.Executable(); err != nil {
			return nil, fmt.Errorf("finding stopgate's own binary for the sandbox: %w", err)
		}
	}
	s, err := startSandbox(self, e.opts.Argv, env, nameservers, e.opts.Stdin, e.opts.Stdout, e.opts.Stderr)
	if err != nil {
		return nil, err
	}
	c := &carrier{
		proxyAddr: e.proxy, auth: basicAuth(e.opts.Run, e.pass), resolver: resolvers,
		note: func(kind, reason string) { e.note(context.Background(), kind, reason) },
		warn: e.warnf,
	}
	go c.serveTCP(s.ln)
	go c.serveDNS(s.dns)
	w := &waited{cmd: s.cmd, ch: make(chan struct{})}
	go func() {
		<-s.done
		w.werr = s.err
		close(w.ch)
	}()
	return &sandboxProcess{waited: w, s: s, c: c}, nil
}

func (p *sandboxProcess) signalTree(sig syscall.Signal) error { return p.s.signalAll(sig) }
func (p *sandboxProcess) kill()                               { p.s.kill() }
func (p *sandboxProcess) what() string                        { return "every process in CMD's sandbox" }
func (p *sandboxProcess) cleanup(context.Context) error {
	// The sandbox is gone: no connection of it is accepted any more, and
	// those carried end with their sockets.
	p.s.close()
	return nil
}

// plainProcess is the command with the proxy environment only, in a
// process group of its own (unless it reads a terminal, whose job control
// needs it in the foreground group).
type plainProcess struct {
	*waited
	group bool
}

func (e *execution) startPlain(path string, env []string) (process, error) {
	e.warnf("run %s goes through the proxy at %s for every client that reads the proxy variables (set in both cases); these ignore them and go around the guard, unseen: %s. Without --no-isolate every TCP connection of CMD is guarded.", safe(e.opts.Run), e.proxy, UnisolatedClients)
	e.note(context.Background(), "exec.unisolated", "CMD runs with the proxy environment only (--no-isolate): clients that ignore it go around the guard unseen: "+UnisolatedClients)
	cmd := e.command(path, env)
	group := !stdinIsTerminal()
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: group, Pdeathsig: syscall.SIGKILL}
	w, err := startWaited(cmd)
	if err != nil {
		return nil, err
	}
	return &plainProcess{waited: w, group: group}, nil
}

func (e *execution) command(path string, env []string) *exec.Cmd {
	cmd := exec.Command(path, e.opts.Argv[1:]...)
	cmd.Args[0] = e.opts.Argv[0]
	cmd.Env = env
	cmd.Stdin, cmd.Stdout, cmd.Stderr = e.opts.Stdin, e.opts.Stdout, e.opts.Stderr
	return cmd
}

func (p *plainProcess) signalTree(sig syscall.Signal) error {
	if p.group {
		return syscall.Kill(-p.cmd.Process.Pid, sig)
	}
	return p.cmd.Process.Signal(sig)
}

func (p *plainProcess) kill() { _ = p.signalTree(syscall.SIGKILL) }
func (p *plainProcess) what() string {
	if p.group {
		return "CMD's process group"
	}
	return "CMD"
}
func (p *plainProcess) cleanup(context.Context) error { return nil }

// redirectedProcess is the command as a uid of its own behind the kernel
// redirect to a listener serve bound to the run.
type redirectedProcess struct {
	*waited
	e         *execution
	uid       uint32
	bindingID string
	stopRenew context.CancelFunc
	renewed   chan struct{}
}

func (e *execution) startRedirected(ctx context.Context, path string, env []string) (process, error) {
	o := e.opts
	if os.Geteuid() != 0 {
		return nil, errors.New("--isolate --uid needs root: CAP_NET_ADMIN for the redirect and CAP_SETUID to run CMD as --uid (without root, the default sandbox guards every TCP connection)")
	}
	ep, err := o.Client.Endpoints(ctx)
	if err != nil {
		return nil, fmt.Errorf("asking stopgate serve for its transparent listener: %w", err)
	}
	if ep.Value.Transparent == "" {
		return nil, errors.New("stopgate serve has no transparent mode, which --isolate --uid needs: start it with --transparent-addr (e.g. 127.0.0.1:15001), or leave out --isolate for the sandbox")
	}
	uid := o.UID
	if pids := processesOf(uid); len(pids) > 0 {
		return nil, fmt.Errorf("uid %d already runs processes (%s): their connections would be redirected and recorded under run %s too; pick a uid nothing runs as (--uid)", uid, pidList(pids), safe(o.Run))
	}
	gid, home := uid, "/"
	if u, err := user.LookupId(strconv.FormatUint(uint64(uid), 10)); err == nil {
		if g, err := strconv.ParseUint(u.Gid, 10, 32); err == nil {
			gid = uint32(g)
		}
		if u.HomeDir != "" {
			home = u.HomeDir
		}
	}
	if err := executableBy(path, uid, gid); err != nil {
		return nil, err
	}
	resolvers, _, err := e.resolvers()
	if err != nil {
		return nil, err
	}
	ttl := control.TTL(bindingTTL)
	uid64 := int64(uid)
	b, err := o.Client.Bind(ctx, control.BindingRequest{UID: &uid64, RunID: o.Run, CancelVersion: e.version, LeaseTTL: &ttl})
	if err != nil {
		return nil, fmt.Errorf("binding a transparent listener to run %s for uid %d: %w", safe(o.Run), uid, err)
	}
	p := &redirectedProcess{e: e, uid: uid, bindingID: b.Value.ID, renewed: make(chan struct{})}
	if err := redirect.Install(ctx, redirect.Rules{UID: uid, Port: uint16(b.Value.Port), DNS: resolvers}); err != nil {
		p.unbind(ctx)
		return nil, err
	}
	// HOME is the uid's: the caller's is not its to write (git, npm, pip
	// keep their config and caches there).
	env = append(withoutVar(env, "HOME"), "HOME="+home)
	cmd := e.command(path, env)
	cmd.Dir = "/"
	if wd, err := os.Getwd(); err == nil && accessibleBy(wd, uid, gid) {
		cmd.Dir = wd
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Credential: &syscall.Credential{Uid: uid, Gid: gid, Groups: []uint32{}},
		Setpgid:    !stdinIsTerminal(),
		// CMD does not outlive a stopgate exec that is killed.
		Pdeathsig: syscall.SIGKILL,
	}
	renewCtx, stop := context.WithCancel(context.WithoutCancel(ctx))
	p.stopRenew = stop
	go func() {
		defer close(p.renewed)
		p.renew(renewCtx)
	}()
	w, err := startWaited(cmd)
	if err != nil {
		_ = p.cleanup(ctx)
		return nil, err
	}
	p.waited = w
	return p, nil
}

func withoutVar(env []string, k string) []string {
	out := env[:0:0]
	for _, kv := range env {
		if !strings.HasPrefix(kv, k+"=") {
			out = append(out, kv)
		}
	}
	return out
}

// executableBy says clearly when uid cannot run path: a file under the
// caller's home (pyenv shims, say) is often closed to other users.
func executableBy(path string, uid, gid uint32) error {
	for p := path; ; p = filepath.Dir(p) {
		st, err := os.Stat(p)
		if err != nil {
			return err
		}
		// Execute the file, search each directory above it.
		if !permits(st, uid, gid, 0o1) {
			return fmt.Errorf("CMD %s is not executable by uid %d (--uid): %s is %s, owned by uid %d; install CMD where that uid can run it, or leave out --isolate --uid to run it as yourself in the sandbox", path, uid, p, st.Mode().Perm(), ownerOf(st))
		}
		if p == "/" || p == "." {
			return nil
		}
	}
}

func accessibleBy(dir string, uid, gid uint32) bool {
	for p := dir; ; p = filepath.Dir(p) {
		st, err := os.Stat(p)
		if err != nil || !permits(st, uid, gid, 0o1) {
			return false
		}
		if p == "/" {
			return true
		}
	}
}

// permits checks the mode bits of st for uid (rwx as bits 4,2,1 in need).
func permits(st os.FileInfo, uid, gid uint32, need os.FileMode) bool {
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok {
		return true
	}
	mode := st.Mode().Perm()
	switch {
	case sys.Uid == uid:
		return mode>>6&need == need
	case sys.Gid == gid:
		return mode>>3&need == need
	}
	return mode&need == need
}

func ownerOf(st os.FileInfo) uint32 {
	if sys, ok := st.Sys().(*syscall.Stat_t); ok {
		return sys.Uid
	}
	return 0
}

func (p *redirectedProcess) signalTree(sig syscall.Signal) error {
	// Everything of the uid is the command's (exec refused a uid in use).
	var errs []error
	for _, pid := range processesOf(p.uid) {
		if err := syscall.Kill(pid, sig); err != nil && !errors.Is(err, syscall.ESRCH) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func (p *redirectedProcess) kill() { _ = p.signalTree(syscall.SIGKILL) }
func (p *redirectedProcess) what() string {
	return "every process of uid " + strconv.FormatUint(uint64(p.uid), 10)
}

// renew keeps the binding alive while CMD runs; a renewal that fails is
// said once, and tried again (an expired binding fails closed).
func (p *redirectedProcess) renew(ctx context.Context) {
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
		_, err := p.e.opts.Client.RenewBinding(rctx, p.bindingID)
		cancel()
		if err != nil && !warned && ctx.Err() == nil {
			warned = true
			p.e.warnf("renewing the transparent binding: %v (if it expires, CMD's connections are refused)", err)
		}
	}
}

func (p *redirectedProcess) unbind(ctx context.Context) {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	defer cancel()
	if err := p.e.opts.Client.Unbind(cctx, p.bindingID); err != nil {
		p.e.warnf("removing the binding %s: %v (it expires by itself within %s)", p.bindingID, err, bindingTTL)
	}
}

// cleanup stops what the command left running as its uid before the
// redirect goes (it would be let out unguarded), then removes the redirect
// and the binding.
func (p *redirectedProcess) cleanup(ctx context.Context) error {
	if p.stopRenew != nil {
		p.stopRenew()
		<-p.renewed
	}
	if left := killUID(p.uid, leftoverWait); len(left) > 0 {
		p.e.warnf("processes of uid %d are still running (%s); the redirect stays in place (their connections are refused); remove it with 'stopgate redirect remove --uid %d' once they are gone", p.uid, pidList(left), p.uid)
		p.unbind(ctx)
		return nil
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	err := redirect.Remove(cctx, p.uid)
	cancel()
	p.unbind(ctx)
	if err != nil {
		return fmt.Errorf("removing the redirect of uid %d: %w", p.uid, err)
	}
	return nil
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
