package browserguard

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The helper's side of the launch. Go cannot run code between fork and
// exec, so the launcher starts its Helper (stopgate itself) in the new
// namespaces; SandboxMain, first thing in its main, sees that it is one,
// builds the browser's world, and execs Chromium in its place. The
// helper's file descriptors: 3 and 4 the DevTools pipe (kept for
// Chromium), 5 the spec (JSON), 6 a socket back to the launcher, on which
// it sends the egress listener it opened inside the browser's network
// namespace, then any error, and which closes when Chromium is exec'd.

// sandboxMarker marks a helper's environment; its value is the protocol
// version.
const sandboxMarker = "STOPGATE_BROWSER_SANDBOX"

const (
	helperSpecFD   = 5
	helperSocketFD = 6
)

// SandboxMain sets up a browser's sandbox and becomes Chromium when this
// process was started as a launcher's helper; it never returns then. In
// any other process it returns at once. Call it first in main (and in the
// TestMain of tests that launch browsers with IsolateNamespaces).
func SandboxMain() {
	if os.Getenv(sandboxMarker) != "1" {
		return
	}
	// Every step below that is per thread (capabilities, securebits,
	// no_new_privs, the parent-death signal) must be on the thread that
	// execs Chromium.
	runtime.LockOSThread()
	sock := os.NewFile(helperSocketFD, "launcher")
	err := sandboxChild(sock)
	// Only reached when something failed: say what to the launcher.
	_, _ = fmt.Fprintf(sock, "error: %v", err)
	fmt.Fprintf(os.Stderr, "stopgate browser sandbox: %v\n", err)
	os.Exit(125)
}

// sandboxChild builds the browser's world and execs Chromium; it returns
// only an error.
func sandboxChild(sock *os.File) error {
	var spec sandboxSpec
	// Closed through its *os.File: a bare close would leave the File's
	// finalizer to close the descriptor's next owner.
	specFile := os.NewFile(helperSpecFD, "spec")
	err := json.NewDecoder(specFile).Decode(&spec)
	_ = specFile.Close()
	if err != nil {
		return fmt.Errorf("reading the sandbox spec: %w", err)
	}
	// What is mounted here must never reach the host's namespace.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("making the mounts private: %w", err)
	}
	if err := loopbackUp(); err != nil {
		return fmt.Errorf("bringing up the loopback of the browser's network namespace: %w", err)
	}
	if err := sendListener(sock, spec.ProxyPort); err != nil {
		return err
	}
	if err := buildRoot(spec); err != nil {
		return err
	}
	if err := dropPrivileges(spec); err != nil {
		return err
	}
	unix.CloseOnExec(int(sock.Fd()))
	err = unix.Exec(spec.Exe, spec.Args, spec.Env)
	return fmt.Errorf("exec %s: %w", spec.Exe, err)
}

// loopbackUp sets IFF_UP on lo, as `ip link set lo up` does.
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return err
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	return unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr)
}

// sendListener opens the egress listener in the browser's network
// namespace and hands it to the launcher, which serves it: only processes
// in this namespace (the browser) can ever connect to it.
func sendListener(sock *os.File, port int) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("egress listener: %w", err)
	}
	defer unix.Close(fd)
	if err := unix.Bind(fd, &unix.SockaddrInet4{Port: port, Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		return fmt.Errorf("egress listener on 127.0.0.1:%d: %w", port, err)
	}
	if err := unix.Listen(fd, 128); err != nil {
		return fmt.Errorf("egress listener: %w", err)
	}
	if err := unix.Sendmsg(int(sock.Fd()), []byte("listener"), unix.UnixRights(fd), nil, 0); err != nil {
		return fmt.Errorf("handing the egress listener to the launcher: %w", err)
	}
	return nil
}

// buildRoot makes the browser's root on spec.Root and pivots into it:
// system directories read-only, a fresh /proc (of its own pid namespace),
// a few devices, private /tmp and /dev/shm, its profile, the launcher's
// policy, and nothing of the host's besides.
func buildRoot(spec sandboxSpec) error {
	root := spec.Root
	if err := unix.Mount("tmpfs", root, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0755,size=16m"); err != nil {
		return fmt.Errorf("the browser's root on %s: %w", root, err)
	}
	in := func(p string) string { return filepath.Join(root, p) }
	for _, m := range []struct{ at, opts string }{
		{"/tmp", "mode=1777,size=" + sandboxTmpSize},
		{"/dev", "mode=0755,size=64k"},
	} {
		if err := os.MkdirAll(in(m.at), 0o755); err != nil {
			return err
		}
		if err := unix.Mount("tmpfs", in(m.at), "tmpfs", unix.MS_NOSUID, m.opts); err != nil {
			return fmt.Errorf("tmpfs on %s: %w", m.at, err)
		}
	}
	// After /tmp: what is bound may be under it (an upload directory).
	for _, d := range spec.Binds {
		if err := bindInto(root, d); err != nil {
			return err
		}
	}
	if err := bindEtc(root); err != nil {
		return err
	}
	if spec.Uploads != "" {
		if err := bindInto(root, spec.Uploads); err != nil {
			return err
		}
	}
	for _, dev := range []string{"null", "zero", "full", "random", "urandom"} {
		target := in("/dev/" + dev)
		if err := os.WriteFile(target, nil, 0o644); err != nil {
			return err
		}
		if err := unix.Mount("/dev/"+dev, target, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("binding /dev/%s: %w", dev, err)
		}
	}
	for link, to := range map[string]string{"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2"} {
		if err := os.Symlink(to, in("/dev/"+link)); err != nil {
			return err
		}
	}
	if err := os.MkdirAll(in("/dev/shm"), 0o1777); err != nil {
		return err
	}
	if err := unix.Mount("tmpfs", in("/dev/shm"), "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=1777,size="+sandboxShmSize); err != nil {
		return fmt.Errorf("tmpfs on /dev/shm: %w", err)
	}
	if err := os.MkdirAll(in("/proc"), 0o555); err != nil {
		return err
	}
	if err := unix.Mount("proc", in("/proc"), "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("a /proc of the browser's own: %w", err)
	}
	for _, dir := range policyDirs {
		if err := os.MkdirAll(in(dir), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(in(dir), "stopgate.json"), spec.Policy, 0o644); err != nil {
			return fmt.Errorf("the browser's policy: %w", err)
		}
	}
	// The profile, at the path Chromium is told (the root's own path).
	// Its parents are made traversable: the browser may not be root.
	if err := os.MkdirAll(filepath.Dir(in(root)), 0o755); err != nil {
		return err
	}
	if err := os.Mkdir(in(root), 0o700); err != nil {
		return err
	}
	owner := ""
	if spec.AsRoot {
		owner = fmt.Sprintf(",uid=%d,gid=%d", spec.UID, spec.GID)
	}
	if err := unix.Mount("tmpfs", in(root), "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0700,size="+sandboxProfileSize+owner); err != nil {
		return fmt.Errorf("the browser's profile: %w", err)
	}
	if err := pivot(root); err != nil {
		return err
	}
	if err := hide(spec.Hide); err != nil {
		return err
	}
	// The root itself (but its tmpfs mounts) is read-only from here on.
	if err := unix.Mount("", "/", "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		return fmt.Errorf("making the browser's root read-only: %w", err)
	}
	return unix.Chdir(root)
}

// bindInto binds host directory dir read-only at the same path under
// root; a symbolic link is copied as a link, a missing path skipped.
func bindInto(root, dir string) error {
	fi, err := os.Lstat(dir)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return nil
	case err != nil:
		return err
	}
	target := filepath.Join(root, dir)
	if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
		return err
	}
	if fi.Mode()&os.ModeSymlink != 0 {
		to, err := os.Readlink(dir)
		if err != nil {
			return err
		}
		return os.Symlink(to, target)
	}
	if fi.IsDir() {
		err = os.Mkdir(target, 0o755)
	} else {
		err = os.WriteFile(target, nil, 0o644)
	}
	if err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	if err := unix.Mount(dir, target, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("binding %s: %w", dir, err)
	}
	return readOnly(target)
}

// readOnly makes a bind mount and everything under it read-only, without
// set-user-ID programs or devices.
func readOnly(target string) error {
	attr := &unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV}
	err := unix.MountSetattr(-1, target, unix.AT_RECURSIVE, attr)
	if !errors.Is(err, unix.ENOSYS) {
		if err != nil {
			return fmt.Errorf("making %s read-only: %w", target, err)
		}
		return nil
	}
	// Kernels before 5.12: the top mount alone; flags the source has
	// locked (in a user namespace) must be kept.
	var st unix.Statfs_t
	if err := unix.Statfs(target, &st); err != nil {
		return err
	}
	flags := uintptr(unix.MS_REMOUNT | unix.MS_BIND | unix.MS_RDONLY | unix.MS_NOSUID | unix.MS_NODEV)
	for _, f := range []struct{ st, ms int64 }{{unix.ST_NOEXEC, unix.MS_NOEXEC}, {unix.ST_NOATIME, unix.MS_NOATIME}, {unix.ST_RELATIME, unix.MS_RELATIME}} {
		if st.Flags&f.st != 0 {
			flags |= uintptr(f.ms)
		}
	}
	if err := unix.Mount("", target, "", flags, ""); err != nil {
		return fmt.Errorf("making %s read-only: %w", target, err)
	}
	return nil
}

// bindEtc gives the root the host's /etc, entry by entry and read-only,
// but for Chromium's own directories, whose policies are the launcher's.
func bindEtc(root string) error {
	if err := os.MkdirAll(filepath.Join(root, "/etc"), 0o755); err != nil {
		return err
	}
	return bindEntries(root, "/etc", map[string]bool{"/etc/chromium": true, "/etc/opt": true, "/etc/opt/chrome": true})
}

// bindEntries binds each entry of host directory dir under root; those in
// skip are made as directories of their own, and their entries bound the
// same way when they are themselves in skip's set of parents.
func bindEntries(root, dir string, skip map[string]bool) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return err
	}
	for _, e := range entries {
		p := filepath.Join(dir, e.Name())
		if !skip[p] {
			if err := bindInto(root, p); err != nil {
				return err
			}
			continue
		}
		if err := os.MkdirAll(filepath.Join(root, p), 0o755); err != nil {
			return err
		}
		if p == "/etc/opt" {
			if err := bindEntries(root, p, skip); err != nil {
				return err
			}
		}
	}
	return nil
}

// pivot makes root the root, and the host's root goes.
func pivot(root string) error {
	old := filepath.Join(root, ".host")
	if err := os.Mkdir(old, 0o700); err != nil {
		return err
	}
	if err := unix.PivotRoot(root, old); err != nil {
		return fmt.Errorf("pivot_root to %s: %w", root, err)
	}
	if err := unix.Chdir("/"); err != nil {
		return err
	}
	if err := unix.Unmount("/.host", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detaching the host's root: %w", err)
	}
	return os.Remove("/.host")
}

// hide covers each path that is in the browser's root: a directory with an
// empty read-only tmpfs, a file with an empty read-only file. It runs once
// the root is the browser's, so that a link among the paths resolves
// there and never on the host.
func hide(paths []string) error {
	var empty string
	for _, p := range paths {
		fi, err := os.Stat(p)
		if err != nil {
			continue
		}
		if fi.IsDir() {
			if err := unix.Mount("tmpfs", p, "tmpfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=000,size=4k"); err != nil {
				return fmt.Errorf("hiding %s: %w", p, err)
			}
			continue
		}
		if empty == "" {
			empty = "/.hidden"
			if err := os.WriteFile(empty, nil, 0o444); err != nil {
				return err
			}
			// The mounts keep it; the root does not show it.
			defer os.Remove(empty)
		}
		if err := unix.Mount(empty, p, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("hiding %s: %w", p, err)
		}
		if err := readOnly(p); err != nil {
			return err
		}
	}
	return nil
}

// dropPrivileges leaves Chromium no way back: no capabilities (none in
// its bounding set, none gained by exec as uid 0), no new privileges, and
// where the helper is the real root, the browser's own uid and gid.
func dropPrivileges(spec sandboxSpec) error {
	last, err := lastCap()
	if err != nil {
		return err
	}
	for c := 0; c <= last; c++ {
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("dropping capability %d from the bounding set: %w", c, err)
		}
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("clearing ambient capabilities: %w", err)
	}
	if spec.AsRoot {
		if err := syscall.Setgroups(nil); err != nil {
			return fmt.Errorf("setgroups: %w", err)
		}
		if err := syscall.Setresgid(spec.GID, spec.GID, spec.GID); err != nil {
			return fmt.Errorf("setresgid %d: %w", spec.GID, err)
		}
		if err := syscall.Setresuid(spec.UID, spec.UID, spec.UID); err != nil {
			return fmt.Errorf("setresuid %d: %w", spec.UID, err)
		}
		// A change of credentials clears it; the browser must still die
		// with stopgate.
		if err := unix.Prctl(unix.PR_SET_PDEATHSIG, uintptr(unix.SIGKILL), 0, 0, 0); err != nil {
			return fmt.Errorf("parent-death signal: %w", err)
		}
		if parentGone(helperSocketFD) {
			return errors.New("the launcher is gone")
		}
	} else {
		// uid 0 of its user namespace: exec gives it no capabilities.
		const bits = 1<<0 | 1<<1 | 1<<2 | 1<<3 | 1<<5 // NOROOT, its lock, NO_SETUID_FIXUP, its lock, KEEP_CAPS_LOCKED
		if err := unix.Prctl(unix.PR_SET_SECUREBITS, bits, 0, 0, 0); err != nil {
			return fmt.Errorf("securebits: %w", err)
		}
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("no_new_privs: %w", err)
	}
	return nil
}

// parentGone reports whether the launcher's end of fd has closed.
func parentGone(fd int) bool {
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLRDHUP}}
	n, err := unix.Poll(fds, 0)
	return err == nil && n > 0 && fds[0].Revents&(unix.POLLRDHUP|unix.POLLHUP) != 0
}

func lastCap() (int, error) {
	b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap")
	if err != nil {
		return 0, fmt.Errorf("reading the last capability: %w", err)
	}
	return strconv.Atoi(strings.TrimSpace(string(b)))
}

// The launcher's side.

// sandboxed is a helper started, with the egress listener it opened.
type sandboxed struct {
	cmd      *exec.Cmd
	listener net.Listener
	sock     *net.UnixConn
}

// startSandboxed starts the helper in new namespaces with the DevTools
// pipe's child ends (extra: fds 3 and 4), and waits, until deadline, for
// the egress listener it opens in the browser's network namespace.
func startSandboxed(spec sandboxSpec, helper string, extra []*os.File, out io.Writer, deadline time.Time) (*sandboxed, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("the sandbox's socket: %w", err)
	}
	parentEnd, childEnd := os.NewFile(uintptr(fds[0]), "sandbox"), os.NewFile(uintptr(fds[1]), "sandbox-child")
	specR, specW, err := os.Pipe()
	if err != nil {
		parentEnd.Close()
		childEnd.Close()
		return nil, err
	}

	// "-test.run=^$": a test binary that forgot SandboxMain runs no test
	// and exits, rather than running its tests again here.
	cmd := &exec.Cmd{Path: helper, Args: []string{"stopgate-browser-sandbox", "-test.run=^$"}, Env: []string{sandboxMarker + "=1"}}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.ExtraFiles = append(append([]*os.File{}, extra...), specR, childEnd)
	flags := uintptr(unix.CLONE_NEWNS | unix.CLONE_NEWPID | unix.CLONE_NEWNET | unix.CLONE_NEWIPC)
	attr := &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if !spec.AsRoot {
		flags |= unix.CLONE_NEWUSER
		attr.UidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getuid(), Size: 1}}
		attr.GidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getgid(), Size: 1}}
		attr.GidMappingsEnableSetgroups = false
	}
	attr.Cloneflags = flags
	cmd.SysProcAttr = attr
	cmd.WaitDelay = waitDelay
	err = cmd.Start()
	// The helper's copies only, from here: the end of its socket (EOF) is
	// how the launcher learns that it became Chromium.
	childEnd.Close()
	specR.Close()
	if err != nil {
		parentEnd.Close()
		specW.Close()
		return nil, fmt.Errorf("starting the browser's sandbox (%s): %w%s", helper, err, namespaceHint(err))
	}
	b, err := json.Marshal(spec)
	if err == nil {
		_, err = specW.Write(b)
	}
	specW.Close()
	conn, cerr := net.FileConn(parentEnd)
	parentEnd.Close()
	if err == nil {
		err = cerr
	}
	s := &sandboxed{cmd: cmd}
	fail := func(err error) (*sandboxed, error) {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = cmd.Wait()
		if s.sock != nil {
			s.sock.Close()
		}
		return nil, err
	}
	if err != nil {
		return fail(fmt.Errorf("the browser's sandbox: %w", err))
	}
	s.sock = conn.(*net.UnixConn)
	_ = s.sock.SetReadDeadline(deadline)
	buf, oob := make([]byte, 4096), make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := s.sock.ReadMsgUnix(buf, oob)
	switch {
	case err != nil:
		return fail(fmt.Errorf("the browser's sandbox did not hand over its egress listener: %w", err))
	case n == 0:
		return fail(errors.New("the browser's sandbox exited before it handed over its egress listener (is SandboxMain called first in the helper's main?)"))
	case string(buf[:n]) != "listener":
		return fail(helperError(buf[:n]))
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(msgs) != 1 {
		return fail(fmt.Errorf("the browser's sandbox sent no listener: %v", err))
	}
	got, err := unix.ParseUnixRights(&msgs[0])
	if err != nil || len(got) != 1 {
		return fail(fmt.Errorf("the browser's sandbox sent no listener: %v", err))
	}
	lf := os.NewFile(uintptr(got[0]), "egress")
	s.listener, err = net.FileListener(lf)
	lf.Close()
	if err != nil {
		return fail(fmt.Errorf("the browser's egress listener: %w", err))
	}
	// Then the helper execs Chromium (the socket closes: EOF) or says why
	// it could not.
	n, err = s.sock.Read(buf)
	if n > 0 {
		s.listener.Close()
		return fail(helperError(buf[:n]))
	}
	if err != nil && !errors.Is(err, io.EOF) {
		s.listener.Close()
		return fail(fmt.Errorf("the browser's sandbox did not start Chromium: %w", err))
	}
	return s, nil
}

// helperError is what the helper said went wrong, with what to do when
// the kernel refused it.
func helperError(msg []byte) error {
	text := strings.TrimPrefix(string(msg), "error: ")
	hint := ""
	if strings.Contains(text, "operation not permitted") || strings.Contains(text, "permission denied") {
		hint = " (in a container: the browser's own /proc needs an unmasked /proc, e.g. procMount: Unmasked, " +
			"or docker run --security-opt systempaths=unconfined; or start serve with --browser-isolation=none, " +
			"which gives up the operating system's part of the browser's isolation)"
	}
	return fmt.Errorf("the browser's sandbox: %s%s", text, hint)
}

// namespaceHint says what to do when the kernel refuses the namespaces.
func namespaceHint(err error) string {
	if errors.Is(err, syscall.EPERM) || errors.Is(err, syscall.EINVAL) || errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EACCES) {
		return " (this machine does not let stopgate make the namespaces the browser runs in: allow unprivileged user namespaces " +
			"(kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0, no seccomp profile refusing clone), run stopgate as root, " +
			"or start serve with --browser-isolation=none, which gives up the operating system's part of the browser's isolation)"
	}
	return ""
}
