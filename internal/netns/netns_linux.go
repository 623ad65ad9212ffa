// Package netns runs a test inside a fresh network namespace of its own, with
// only a loopback interface, so that tests can install iptables rules and
// redirect real connections without touching the machine's network. The
// test binary re-runs itself, for that one test, in the new namespace.
//
// It needs root (or CAP_SYS_ADMIN); where namespaces cannot be made it skips
// the test with the reason. It never changes the caller's own namespace.
package netns

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"
)

// marker names the test a re-run is for; set only in the re-run's environment.
const marker = "STOPGATE_TEST_IN_NETNS"

// Timeout bounds a whole re-run.
const Timeout = 5 * time.Minute

// Enter reports whether the calling test runs in its own network namespace:
// true in the re-run (loopback is up; go on with the test), false in the
// caller, once the re-run has passed (or the test was failed or skipped with
// its output). Call it first in a top-level test.
func Enter(t *testing.T) bool {
	t.Helper()
	if os.Getenv(marker) == t.Name() {
		if err := loopbackUp(); err != nil {
			t.Fatalf("bring up lo in the new network namespace: %v", err)
		}
		return true
	}
	if strings.Contains(t.Name(), "/") {
		t.Fatalf("netns.Enter needs a top-level test, not %s", t.Name())
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root to make a network namespace (unshare -n); run the tests as root")
	}
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run", "^"+regexp.QuoteMeta(t.Name())+"$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), marker+"="+t.Name())
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
	cmd.WaitDelay = 10 * time.Second
	out, err := cmd.CombinedOutput()
	var errno syscall.Errno
	if errors.As(err, &errno) && (errno == syscall.EPERM || errno == syscall.EINVAL || errno == syscall.ENOSYS) {
		t.Skipf("network namespaces cannot be made here (%v): run as root on a kernel that allows unshare -n", err)
	}
	t.Logf("in a new network namespace:\n%s", out)
	switch {
	case ctx.Err() != nil:
		t.Fatalf("the namespace run did not end within %s", Timeout)
	case err != nil:
		t.Fatalf("the namespace run failed: %v", err)
	case regexp.MustCompile(`(?m)^\s*--- SKIP: ` + regexp.QuoteMeta(t.Name()) + `\b`).Match(out):
		t.Skip("skipped in the namespace (see above)")
	case !regexp.MustCompile(`(?m)^\s*--- PASS: ` + regexp.QuoteMeta(t.Name()) + `\b`).Match(out):
		t.Fatalf("the namespace run did not report %s passed", t.Name())
	}
	return false
}

// loopbackUp sets IFF_UP on lo (what `ip link set lo up` does).
func loopbackUp() error {
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_DGRAM, 0)
	if err != nil {
		return err
	}
	defer syscall.Close(fd)
	var ifr struct {
		name  [syscall.IFNAMSIZ]byte
		flags uint16
		_     [22]byte
	}
	copy(ifr.name[:], "lo")
	if _, _, e := syscall.Syscall(syscall.SYS_IOCTL, uintptr(fd), syscall.SIOCGIFFLAGS, uintptr(unsafe.Pointer(&ifr))); e != 0 {
		return fmt.Errorf("SIOCGIFFLAGS: %w", e)
	}
	ifr.flags |= syscall.IFF_UP
	if _, _, e := syscall.Syscall(syscall.SYS_IOCTL, uintptr(fd), syscall.SIOCSIFFLAGS, uintptr(unsafe.Pointer(&ifr))); e != 0 {
		return fmt.Errorf("SIOCSIFFLAGS: %w", e)
	}
	return nil
}
