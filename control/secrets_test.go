package control_test

import (
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/stopgate/stopgate/control"
)

// TestSecretIsCreatedOnceAndNeverOverwritten: the first start writes the
// secret whole, 0600; every later start (or a racing one) reads that one.
func TestSecretIsCreatedOnceAndNeverOverwritten(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data") // not there yet: created 0700
	path := filepath.Join(dir, control.OperatorTokenFile)
	gen := func() (string, error) { return control.GenerateToken(control.OperatorTokenPrefix) }

	// Starts racing on a fresh directory agree on one secret.
	const racers = 8
	got := make([]string, racers)
	created := make([]bool, racers)
	var wg sync.WaitGroup
	for i := range racers {
		wg.Go(func() {
			s, c, _, err := control.LoadOrCreateSecret(path, gen)
			if err != nil {
				t.Errorf("racer %d: %v", i, err)
			}
			got[i], created[i] = s, c
		})
	}
	wg.Wait()
	n := 0
	for i := range racers {
		if got[i] != got[0] {
			t.Fatalf("racers got different secrets: %q", got)
		}
		if created[i] {
			n++
		}
	}
	if n != 1 || !strings.HasPrefix(got[0], control.OperatorTokenPrefix) || len(got[0]) < 40 {
		t.Fatalf("%d racers say they created %q; want exactly one, a prefixed 32-byte token", n, got[0])
	}
	st, err := os.Stat(path)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("secret file %v mode %v, want 0600", err, st.Mode().Perm())
	}
	if st, err := os.Stat(dir); err != nil || st.Mode().Perm() != 0o700 {
		t.Fatalf("data directory %v mode %v, want 0700", err, st.Mode().Perm())
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Errorf("temporary files left behind: %v", entries)
	}

	// A later start reads it; so does one given another generator.
	again, c, exposed, err := control.LoadOrCreateSecret(path, func() (string, error) { return "sgop_other", nil })
	if err != nil || c || exposed || again != got[0] {
		t.Fatalf("second start: %q created=%v exposed=%v %v; want the first secret, read", again, c, exposed, err)
	}

	// A file others can read still works, and says so.
	if err := os.Chmod(path, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, _, exposed, err := control.LoadOrCreateSecret(path, gen); err != nil || !exposed {
		t.Fatalf("a 0644 secret: exposed=%v %v; want it reported", exposed, err)
	}
}

func TestSecretFilesThatAreRefused(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	if s, _, err := control.ReadSecretFile(write("ok", "  sgop_abc\n")); err != nil || s != "sgop_abc" {
		t.Errorf("surrounding white space: %q %v", s, err)
	}
	for name, path := range map[string]string{
		"Empty":     write("empty", "\n\n"),
		"TwoWords":  write("words", "sgop_abc def\n"),
		"Control":   write("ctl", "sgop_\x01abc"),
		"TooLong":   write("long", strings.Repeat("a", control.MaxSecretLen+1)),
		"Directory": dir,
		"Missing":   filepath.Join(dir, "absent"),
	} {
		if s, _, err := control.ReadSecretFile(path); err == nil {
			t.Errorf("%s: read %q", name, s)
		}
	}
	// An empty file is not replaced by a fresh secret: someone put it there.
	empty := filepath.Join(dir, "empty")
	if _, _, _, err := control.LoadOrCreateSecret(empty, control.GenerateSecret); err == nil {
		t.Errorf("an empty secret file was accepted or replaced")
	}
}
