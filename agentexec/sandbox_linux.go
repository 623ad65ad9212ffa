package agentexec

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/stopgate/stopgate/redirect"
)

// The sandbox: CMD in user, network, PID and mount namespaces of its own,
// made by stopgate exec as the calling user, with no root.
//
// exec re-runs its own binary (InitVerb) as the first process of those
// namespaces. That init brings up lo, routes every IPv4 address to it,
// switches IPv6 off, installs the rules of redirect.Sandbox (every TCP
// connection to one listener, DNS to one UDP socket, nothing else), and
// hands both sockets to exec over a Unix socket pair, inherited as fd 3.
// exec accepts on them from outside (a socket works from any namespace),
// reads each connection's original destination there and carries it to
// the proxy as a CONNECT under the run. The init then mounts the PID
// namespace's own /proc, drops every capability for good, starts CMD, and
// stays PID 1: it reaps, passes signals on, signals the whole sandbox when
// exec says so, and exits with CMD's status. When it exits, or exec kills
// it at the drain deadline, the kernel kills everything left in the
// sandbox: nothing CMD started outlives it.

// InitVerb is the hidden subcommand stopgate runs as the sandbox's init.
const InitVerb = "__exec-sandbox-init"

// Messages on the control socket. From the init: ready (with the two
// sockets), or a failure before CMD started. From exec: signal the sandbox.
const (
	msgReady  = 'R'
	msgFailed = 'E'
	msgSignal = 'K'
)

// initFD is the control socket's number in the init.
const initFD = 3

// readyTimeout bounds the init's setup.
const readyTimeout = 30 * time.Second

// NamespaceError says the sandbox could not be made here, and why.
type NamespaceError struct{ Cause string }

func (e *NamespaceError) Error() string {
	return "cannot isolate CMD here: " + e.Cause + ". Two ways out: --no-isolate (the proxy environment only: clients that ignore the proxy variables go around the guard, and exec records that in the run's audit), or, as root, --isolate --uid UID (the kernel redirect of one uid to serve's --transparent-addr)"
}

// sandbox is a running sandbox, seen from exec.
type sandbox struct {
	cmd  *exec.Cmd
	ctl  *os.File
	ln   net.Listener
	dns  net.PacketConn
	done chan struct{}
	err  error // CMD's exit, once done is closed
}

// startSandbox starts the init with CMD and waits until it is ready.
func startSandbox(self string, argv, env []string, nameservers []netip.AddrPort, stdin io.Reader, stdout, stderr io.Writer) (*sandbox, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("sandbox control socket: %w", err)
	}
	ours, theirs := os.NewFile(uintptr(fds[0]), "sandbox-control"), os.NewFile(uintptr(fds[1]), "sandbox-control")
	args := []string{InitVerb}
	for _, ns := range nameservers {
		args = append(args, "--nameserver", ns.String())
	}
	args = append(args, "--")
	cmd := exec.Command(self, append(args, argv...)...)
	cmd.Env = env
	cmd.Stdin, cmd.Stdout, cmd.Stderr = stdin, stdout, stderr
	cmd.ExtraFiles = []*os.File{theirs}
	uid, gid := os.Getuid(), os.Getgid()
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: syscall.CLONE_NEWUSER | syscall.CLONE_NEWNET | syscall.CLONE_NEWPID | syscall.CLONE_NEWNS,
		// The caller is the same user inside: its files, HOME and PATH
		// work as it expects. The init keeps, across its exec, what it
		// needs to build the sandbox; CMD gets none of it.
		UidMappings:                []syscall.SysProcIDMap{{ContainerID: uid, HostID: uid, Size: 1}},
		GidMappings:                []syscall.SysProcIDMap{{ContainerID: gid, HostID: gid, Size: 1}},
		GidMappingsEnableSetgroups: false,
		AmbientCaps:                []uintptr{unix.CAP_NET_ADMIN, unix.CAP_SYS_ADMIN, unix.CAP_SETPCAP},
		Pdeathsig:                  syscall.SIGKILL,
	}
	if uid == 0 {
		// Root is root of the namespace too, with every capability; the
		// init takes them all from CMD.
		cmd.SysProcAttr.AmbientCaps = nil
	}
	err = cmd.Start()
	_ = theirs.Close()
	if err != nil {
		_ = ours.Close()
		return nil, namespaceCause(err)
	}
	// From now on nothing of the same user, the sandbox included, may read
	// this process's memory, where the token is (ptrace, /proc/PID/mem,
	// environ). Not before: the user namespace's uid_map, which Start
	// writes, is a /proc file of the child, closed to its user when the
	// parent is not dumpable.
	_ = unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0)
	s := &sandbox{cmd: cmd, ctl: ours, done: make(chan struct{})}
	go func() {
		s.err = cmd.Wait()
		close(s.done)
	}()
	if err := s.awaitReady(); err != nil {
		_ = cmd.Process.Kill()
		<-s.done
		_ = ours.Close()
		return nil, err
	}
	return s, nil
}

// namespaceCause turns a failure to clone into what to do about it.
func namespaceCause(err error) error {
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return fmt.Errorf("starting the sandbox: %w", err)
	}
	switch errno {
	case syscall.EPERM:
		return &NamespaceError{"the kernel refused to make a user namespace (" + err.Error() + "): unprivileged user namespaces are off (sysctl kernel.unprivileged_userns_clone, or an AppArmor restriction), or a seccomp profile (a container's) forbids them"}
	case syscall.ENOSPC:
		return &NamespaceError{"no user namespace can be made (" + err.Error() + "): user.max_user_namespaces is 0 or reached"}
	case syscall.EINVAL, syscall.ENOSYS:
		return &NamespaceError{"this kernel does not offer the namespaces (" + err.Error() + ")"}
	}
	return fmt.Errorf("starting the sandbox: %w", err)
}

// awaitReady reads the init's first message: the two sockets, or why not.
func (s *sandbox) awaitReady() error {
	type result struct {
		ln  net.Listener
		dns net.PacketConn
		err error
	}
	ch := make(chan result, 1)
	go func() {
		buf := make([]byte, 4096)
		oob := make([]byte, unix.CmsgSpace(2*4))
		n, oobn, _, _, err := unix.Recvmsg(int(s.ctl.Fd()), buf, oob, 0)
		switch {
		case err != nil:
			ch <- result{err: fmt.Errorf("reading the sandbox's answer: %w", err)}
			return
		case n == 0:
			ch <- result{err: errors.New("the sandbox's init ended before it was ready")}
			return
		case buf[0] == msgFailed:
			ch <- result{err: initFailure(string(buf[1:n]))}
			return
		case buf[0] != msgReady:
			ch <- result{err: fmt.Errorf("the sandbox's init said %q", buf[:n])}
			return
		}
		msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil || len(msgs) != 1 {
			ch <- result{err: fmt.Errorf("the sandbox's sockets: %v", err)}
			return
		}
		fds, err := unix.ParseUnixRights(&msgs[0])
		if err != nil || len(fds) != 2 {
			ch <- result{err: fmt.Errorf("the sandbox's sockets: %d of 2 (%v)", len(fds), err)}
			return
		}
		lf, uf := os.NewFile(uintptr(fds[0]), "sandbox-tcp"), os.NewFile(uintptr(fds[1]), "sandbox-dns")
		defer lf.Close()
		defer uf.Close()
		ln, err := net.FileListener(lf)
		if err != nil {
			ch <- result{err: fmt.Errorf("the sandbox's TCP listener: %w", err)}
			return
		}
		pc, err := net.FilePacketConn(uf)
		if err != nil {
			_ = ln.Close()
			ch <- result{err: fmt.Errorf("the sandbox's DNS socket: %w", err)}
			return
		}
		ch <- result{ln: ln, dns: pc}
	}()
	select {
	case r := <-ch:
		s.ln, s.dns = r.ln, r.dns
		return r.err
	case <-s.done:
		select {
		case r := <-ch:
			if r.err == nil {
				_ = r.ln.Close()
				_ = r.dns.Close()
				return fmt.Errorf("the sandbox's init ended: %v", s.err)
			}
			return r.err
		case <-time.After(time.Second):
		}
		return fmt.Errorf("the sandbox's init ended before it was ready: %v", s.err)
	case <-time.After(readyTimeout):
		return fmt.Errorf("the sandbox was not ready within %s", readyTimeout)
	}
}

// initFailure is what the init reported, as an error: a refusal of the
// kernel (a user namespace without the rights it should give, as under
// an AppArmor restriction) is a NamespaceError, with the ways out.
func initFailure(msg string) error {
	stage, cause, _ := strings.Cut(msg, "\x00")
	switch stage {
	case "start":
		return errors.New(cause)
	case "network", "rules", "mount":
		if strings.Contains(cause, "not permitted") || strings.Contains(cause, "permission denied") || strings.Contains(cause, "Permission denied") {
			return &NamespaceError{"the sandbox's namespaces were made, but setting up its " + stage + " was refused (" + cause + "): an AppArmor or seccomp restriction on user namespaces"}
		}
		if errors.Is(errors.New(cause), redirect.ErrNoIptables) || strings.Contains(cause, "iptables not found") {
			return errors.New(cause)
		}
	}
	return fmt.Errorf("setting up the sandbox (%s): %s", stage, cause)
}

// signalAll asks the init to send sig to every process of the sandbox.
func (s *sandbox) signalAll(sig syscall.Signal) error {
	_, err := s.ctl.Write([]byte{msgSignal, byte(sig)})
	return err
}

// kill kills the sandbox: the init, and with it, by the kernel, everything
// in its PID namespace.
func (s *sandbox) kill() { _ = s.cmd.Process.Kill() }

func (s *sandbox) close() {
	_ = s.ln.Close()
	_ = s.dns.Close()
	_ = s.ctl.Close()
}

// Init is the sandbox's init (stopgate InitVerb [--nameserver A:P]... -- CMD
// ARGS...). It returns the exit status for os.Exit.
func Init(args []string) int {
	ctl := os.NewFile(initFD, "sandbox-control")
	fail := func(stage string, err error) int {
		_, _ = ctl.Write(append([]byte{msgFailed}, stage+"\x00"+err.Error()...))
		return 125
	}
	var nameservers []netip.AddrPort
	for len(args) > 0 && args[0] != "--" {
		if len(args) < 2 || args[0] != "--nameserver" {
			return fail("args", fmt.Errorf("unexpected arguments %q", args))
		}
		ns, err := netip.ParseAddrPort(args[1])
		if err != nil {
			return fail("args", err)
		}
		nameservers = append(nameservers, ns)
		args = args[2:]
	}
	if len(args) < 2 {
		return fail("args", errors.New("no command"))
	}
	argv := args[1:]
	// Nothing in the sandbox reads the init's memory (CMD is the same
	// user, and without this could ptrace it and take the control socket).
	_ = unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0)

	if err := loopbackUp(); err != nil {
		return fail("network", err)
	}
	if err := routeAllToLoopback(); err != nil {
		return fail("network", err)
	}
	ipv6Off()
	ln, err := net.ListenTCP("tcp4", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		return fail("network", err)
	}
	pc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		return fail("network", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), readyTimeout)
	err = redirect.InstallSandbox(ctx, redirect.Sandbox{
		TCPPort: uint16(ln.Addr().(*net.TCPAddr).Port), DNSPort: uint16(pc.LocalAddr().(*net.UDPAddr).Port), Nameservers: nameservers,
	})
	cancel()
	if err != nil {
		return fail("rules", err)
	}
	if err := mountProc(); err != nil {
		return fail("mount", err)
	}
	lf, err := ln.File()
	if err != nil {
		return fail("network", err)
	}
	uf, err := pc.File()
	if err != nil {
		return fail("network", err)
	}
	_ = ln.Close()
	_ = pc.Close()
	path, err := exec.LookPath(argv[0])
	if err != nil {
		return fail("start", fmt.Errorf("CMD %s: %w", argv[0], err))
	}
	// Signals for CMD, caught before it starts so none is lost.
	sigs := make(chan os.Signal, 16)
	signal.Notify(sigs, forwarded...)
	proc, err := startDropped(path, argv)
	if err != nil {
		return fail("start", err)
	}
	if err := unix.Sendmsg(initFD, []byte{msgReady}, unix.UnixRights(int(lf.Fd()), int(uf.Fd())), nil, 0); err != nil {
		_ = proc.Kill()
		return 125
	}
	_ = lf.Close()
	_ = uf.Close()
	go func() {
		for s := range sigs {
			_ = proc.Signal(s)
		}
	}()
	go func() {
		buf := make([]byte, 16)
		for {
			n, err := ctl.Read(buf)
			if err != nil || n == 0 {
				// exec is gone: so is its sandbox.
				_ = syscall.Kill(-1, syscall.SIGKILL)
				os.Exit(137)
			}
			if n == 2 && buf[0] == msgSignal {
				// Every process in the PID namespace but this one.
				_ = syscall.Kill(-1, syscall.Signal(buf[1]))
			}
		}
	}()
	return reap(proc.Pid)
}

// forwarded are the signals the init passes on to CMD (exec passes them
// on to the init as it gets them).
var forwarded = []os.Signal{syscall.SIGTERM, syscall.SIGHUP, syscall.SIGINT, syscall.SIGQUIT, syscall.SIGUSR1, syscall.SIGUSR2, syscall.SIGWINCH}

// reap waits for every child (as PID 1 must: orphans are its children)
// until CMD ends, and returns CMD's status, 128+N for a death by signal N.
func reap(cmd int) int {
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, 0, nil)
		if errors.Is(err, syscall.EINTR) {
			continue
		}
		if err != nil {
			return 125
		}
		if pid != cmd {
			continue
		}
		if ws.Signaled() {
			return 128 + int(ws.Signal())
		}
		return ws.ExitStatus()
	}
}

// startDropped starts CMD without any capability, never to gain one: no
// ambient or inheritable set, an empty bounding set, uid 0 without its
// privileges, no_new_privs. Capabilities belong to a thread, and a child
// is forked from the thread that asks: the goroutine keeps its thread,
// drops them there, and the thread dies with the goroutine.
func startDropped(path string, argv []string) (*os.Process, error) {
	type result struct {
		p   *os.Process
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with us
		if err := dropCapabilities(); err != nil {
			ch <- result{err: fmt.Errorf("dropping the sandbox's capabilities: %w", err)}
			return
		}
		// The init's sockets are close-on-exec: CMD gets none of them.
		p, err := os.StartProcess(path, argv, &os.ProcAttr{
			Env:   os.Environ(),
			Files: []*os.File{os.Stdin, os.Stdout, os.Stderr},
			Sys:   &syscall.SysProcAttr{Setpgid: !stdinIsTerminal()},
		})
		ch <- result{p, err}
	}()
	r := <-ch
	return r.p, r.err
}

func dropCapabilities() error {
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("no_new_privs: %w", err)
	}
	// SECBIT_NOROOT, SECBIT_NO_SETUID_FIXUP and SECBIT_NO_CAP_AMBIENT_RAISE,
	// each with its lock (linux/securebits.h): uid 0 means no privilege.
	const secure = 1<<0 | 1<<1 | 1<<2 | 1<<3 | 1<<6 | 1<<7
	if err := unix.Prctl(unix.PR_SET_SECUREBITS, secure, 0, 0, 0); err != nil {
		return fmt.Errorf("securebits: %w", err)
	}
	for c := 0; c <= 63; c++ {
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("bounding set: capability %d: %w", c, err)
		}
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil {
		return fmt.Errorf("ambient set: %w", err)
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	return nil
}

// mountProc gives the PID namespace its own /proc, so that CMD sees only
// the sandbox's processes (not exec's, nor the machine's), in a mount
// namespace whose changes stay its own.
func mountProc() error {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("making the sandbox's mounts private: %w", err)
	}
	if err := unix.Mount("proc", "/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mounting the sandbox's /proc: %w", err)
	}
	return nil
}

// ipv6Off switches IPv6 off in the sandbox: its rules are IPv4, and an
// IPv6 connection fails at once (no address, no route) rather than go
// unguarded. Clients fall back to IPv4, which names resolve to as well.
func ipv6Off() {
	for _, dev := range []string{"all", "default", "lo"} {
		_ = os.WriteFile("/proc/sys/net/ipv6/conf/"+dev+"/disable_ipv6", []byte("1"), 0)
	}
}

func stdinIsTerminal() bool {
	_, err := unix.IoctlGetTermios(0, unix.TCGETS)
	return err == nil
}
