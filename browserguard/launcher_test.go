package browserguard

import (
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
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
