package browserguard

import (
	"context"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/chromedp/chromedp"
)

// TestStaleProfilesAreRemoved: a profile whose browser died with its
// stopgate (kill -9) is removed at the next start; a live browser's, one of
// another host, and one without a lock are left alone.
func TestStaleProfilesAreRemoved(t *testing.T) {
	dir := t.TempDir()
	host, err := os.Hostname()
	if err != nil {
		t.Skip("no hostname:", err)
	}
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	profiles := map[string]string{
		"dead":  host + "-" + strconv.Itoa(dead.Process.Pid),
		"live":  host + "-" + strconv.Itoa(os.Getpid()),
		"other": "elsewhere-" + strconv.Itoa(dead.Process.Pid),
		"none":  "",
	}
	for name, lock := range profiles {
		p := filepath.Join(dir, profilePrefix+name)
		if err := os.MkdirAll(filepath.Join(p, "Default"), 0o700); err != nil {
			t.Fatal(err)
		}
		if lock != "" {
			if err := os.Symlink(lock, filepath.Join(p, "SingletonLock")); err != nil {
				t.Fatal(err)
			}
		}
	}
	l := &Launcher{cfg: LauncherConfig{TempDir: dir}, log: slog.New(slog.DiscardHandler)}
	l.removeStaleProfiles()
	for name := range profiles {
		_, err := os.Stat(filepath.Join(dir, profilePrefix+name))
		if gone := os.IsNotExist(err); gone != (name == "dead") {
			t.Errorf("profile %s: removed %v", name, gone)
		}
	}
}

// TestFlagsKeepChromedpDefaults: the launched browser gets every flag of
// chromedp's default set (its features lists item by item), and is driven
// over a pipe as chromedp's own allocator drives it, never over a port.
func TestFlagsKeepChromedpDefaults(t *testing.T) {
	var theirs []string
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(filepath.Join(t.TempDir(), "no-chromium")),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.ModifyCmdFunc(func(cmd *exec.Cmd) { theirs = cmd.Args[1:] }))
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	defer cancelAlloc()
	ctx, cancel := chromedp.NewContext(actx)
	defer cancel()
	// The binary does not exist: the command is built, then fails to start.
	_ = chromedp.Do(ctx)
	if len(theirs) == 0 {
		t.Fatal("chromedp built no command line")
	}

	ours := chromiumArgs("/profile", "127.0.0.1:1")
	have := map[string]string{}
	for _, a := range ours {
		name, value, _ := strings.Cut(a, "=")
		have[name] = value
	}
	for _, a := range theirs {
		name, value, _ := strings.Cut(a, "=")
		got, ok := have[name]
		switch {
		case name == "--user-data-dir" || !strings.HasPrefix(name, "--"):
		case !ok:
			t.Errorf("chromedp's %s is not among the launcher's flags", a)
		case name == "--enable-features" || name == "--disable-features":
			for _, f := range strings.Split(value, ",") {
				if !slices.Contains(strings.Split(got, ","), f) {
					t.Errorf("chromedp's %s has %s; the launcher's %s=%s does not", name, f, name, got)
				}
			}
		case got != value:
			t.Errorf("chromedp's %s; the launcher's is %s=%s", a, name, got)
		}
	}
	if !slices.Contains(theirs, "--remote-debugging-pipe") || !slices.Contains(ours, "--remote-debugging-pipe") {
		t.Errorf("not both on the DevTools pipe: chromedp %q, launcher %q", theirs, ours)
	}
	for _, a := range ours {
		if strings.HasPrefix(a, "--remote-debugging-port") || strings.HasPrefix(a, "--remote-debugging-address") {
			t.Errorf("the launcher opens a DevTools port: %s", a)
		}
	}
}
