package filestore_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/filestore"
)

// These tests need a file system of their own to fill up or to break:
// they mount one (a tmpfs, or ext4 on a loop device), which needs root,
// and skip, saying why, where that cannot be done.

func mountTmpfs(t *testing.T, size int) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs to fill up needs root; run the tests as root to cover a full disk")
	}
	mnt := filepath.Join(t.TempDir(), "mnt")
	if err := os.Mkdir(mnt, 0o700); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", fmt.Sprintf("size=%d,mode=0700", size), "tmpfs", mnt).CombinedOutput(); err != nil {
		t.Skipf("cannot mount a tmpfs here (%v: %s); a full disk is not covered", err, strings.TrimSpace(string(out)))
	}
	t.Cleanup(func() { _ = exec.Command("umount", "-l", mnt).Run() })
	return mnt
}

// fill writes a file in dir until the file system is full, and returns it.
func fill(t *testing.T, dir string) string {
	t.Helper()
	path := filepath.Join(dir, "filler")
	f, err := os.Create(path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 4096)
	for range 1 << 20 {
		if _, err := f.Write(buf); err != nil {
			return path
		}
	}
	t.Fatal("the file system never filled up")
	return ""
}

// A first start on a full disk fails with an error and leaves no data
// file behind, so that it does not block the start after space is freed.
func TestFirstStartOnAFullDiskLeavesNoPartialFile(t *testing.T) {
	mnt := mountTmpfs(t, 256<<10)
	data := filepath.Join(mnt, "data")
	if err := os.Mkdir(data, 0o700); err != nil {
		t.Fatal(err)
	}
	filler := fill(t, mnt)
	path := filepath.Join(data, "stopgate.db")
	if s, err := filestore.Open(path, filestore.Options{Logger: quiet()}); err == nil {
		_ = s.Close()
		t.Fatal("a first start on a full disk succeeded")
	} else {
		t.Logf("first start on a full disk: %v", err)
	}
	left, _ := os.ReadDir(data)
	if len(left) != 0 {
		var names []string
		for _, e := range left {
			names = append(names, e.Name())
		}
		t.Fatalf("a failed first start left %v in the data directory", names)
	}

	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	s, err := filestore.Open(path, filestore.Options{Logger: quiet()})
	if err != nil {
		t.Fatalf("start after space was freed: %v", err)
	}
	defer s.Close()
	if _, err := s.Admit(testCtx(t), state.AdmitRequest{RunID: "r", Actor: "t"}); err != nil {
		t.Fatal(err)
	}
}

// Readiness (Ping) fails while the disk is full, and recovers when space
// comes back.
func TestPingFailsWhileTheDiskIsFull(t *testing.T) {
	mnt := mountTmpfs(t, 2<<20)
	s, err := filestore.Open(filepath.Join(mnt, "stopgate.db"), filestore.Options{Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := testCtx(t)
	if err := s.Ping(ctx); err != nil {
		t.Fatalf("ping with room on the disk: %v", err)
	}
	filler := fill(t, mnt)
	err = s.Ping(ctx)
	if !errors.Is(err, state.ErrUnavailable) || !strings.Contains(err.Error(), "full") {
		t.Fatalf("ping on a full disk: got %v, want ErrUnavailable saying the disk is full", err)
	}
	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	if err := s.Ping(ctx); err != nil {
		t.Fatalf("ping after space was freed: %v", err)
	}
}

// A file system that turns read-only under the store (ext4 after an
// error, errors=remount-ro) makes readiness fail, and the guard fails
// closed.
func TestPingFailsWhenTheFileSystemTurnsReadOnly(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting a loop device needs root; run the tests as root to cover a file system that turns read-only")
	}
	img := filepath.Join(t.TempDir(), "disk.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 16<<20); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("losetup", "-f", "--show", img).CombinedOutput()
	if err != nil {
		t.Skipf("cannot attach a loop device here (%v: %s)", err, strings.TrimSpace(string(out)))
	}
	loop := strings.TrimSpace(string(out))
	t.Cleanup(func() { _ = exec.Command("losetup", "-d", loop).Run() })
	if out, err := exec.Command("mkfs.ext4", "-q", loop).CombinedOutput(); err != nil {
		t.Skipf("cannot make an ext4 file system here (%v: %s)", err, out)
	}
	mnt := filepath.Join(t.TempDir(), "mnt")
	if err := os.Mkdir(mnt, 0o700); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", "-o", "errors=remount-ro", loop, mnt).CombinedOutput(); err != nil {
		t.Skipf("cannot mount ext4 here (%v: %s)", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("umount", "-l", mnt).Run() })
	trigger := filepath.Join("/sys/fs/ext4", filepath.Base(loop), "trigger_fs_error")
	if _, err := os.Stat(trigger); err != nil {
		t.Skipf("this kernel has no %s to make ext4 fail: %v", trigger, err)
	}

	s, err := filestore.Open(filepath.Join(mnt, "stopgate.db"), filestore.Options{Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := s.Admit(ctx, state.AdmitRequest{RunID: "r", Actor: "t"}); err != nil {
		t.Fatal(err)
	}
	if err := s.Ping(ctx); err != nil {
		t.Fatalf("ping on a healthy file system: %v", err)
	}
	if err := os.WriteFile(trigger, []byte("stopgate test"), 0o200); err != nil {
		t.Fatalf("making ext4 fail: %v", err)
	}
	if err := s.Ping(ctx); !errors.Is(err, state.ErrUnavailable) {
		t.Fatalf("ping on a file system turned read-only: got %v, want ErrUnavailable", err)
	}
	_, err = s.Guard(ctx, state.GuardRequest{RunID: "r", Key: "k", ExplicitKey: true, Boundary: state.BoundaryHTTP, LeaseOwner: "p", LeaseTTL: lease, Actor: "p"})
	if !errors.Is(err, state.ErrUnavailable) {
		t.Fatalf("guard on a file system turned read-only: got %v, want ErrUnavailable", err)
	}
}
