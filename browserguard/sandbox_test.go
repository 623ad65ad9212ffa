//go:build linux

package browserguard

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/cdproto/target"

	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/runwatch"
)

// sandboxedBrowser launches a browser for run with sb and returns the host
// pid of its first process (Chromium, the init of its pid namespace).
func sandboxedBrowser(t *testing.T, run string, sb Sandbox) (*Launcher, *browser) {
	t.Helper()
	store := testkit.FileStore(t)
	log := testkit.Logger()
	ledger := intents.NewLedger(store, intents.LedgerOptions{Owner: "sandbox:test", LeaseTTL: 15 * time.Second, StoreTimeout: 5 * time.Second, Logger: log})
	watcher := runwatch.New(store, runwatch.Options{Interval: time.Second, StoreTimeout: 5 * time.Second, Logger: log})
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	sb.Helper = exe
	l, err := NewLauncher(LauncherConfig{
		Chromium: testkit.Chromium(t), Ledger: ledger, Watcher: watcher, GuardAddr: "127.0.0.1:1", AutoAdmit: true,
		Egress:  func(string) (http.Handler, error) { return http.NotFoundHandler(), nil },
		TempDir: t.TempDir(), Logger: log, StartTimeout: time.Minute, Sandbox: sb,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = l.Close(ctx)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	if _, err := l.Launch(ctx, LaunchRequest{Run: run, Actor: "test"}); err != nil {
		t.Fatalf("launch: %v", err)
	}
	return l, l.running(run)
}

// TestBrowserSeesNothingOfTheMachine (issue 23, finding 1, the operating
// system's part): a sandboxed browser's file system holds the system's
// directories, read-only, and nothing of stopgate's: not its data
// directory, not the secrets it hides even under a directory the browser
// is given, not its environment, not /proc of any process but the
// browser's own. It has no capabilities, no way to gain any, a network of
// its own, and Chromium's policy, which keeps file: URLs and downloads off
// even when a command reaches the browser around the guard.
func TestBrowserSeesNothingOfTheMachine(t *testing.T) {
	secret := "sgop_" + strconv.FormatInt(time.Now().UnixNano(), 36)
	t.Setenv("STOPGATE_CONTROL_TOKEN", secret)
	data := filepath.Join(t.TempDir(), "stopgate-data")
	if err := os.MkdirAll(data, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(data, "operator.token"), []byte(secret), 0o600); err != nil {
		t.Fatal(err)
	}
	// An upload directory holding a secret that must stay hidden.
	uploads := t.TempDir()
	runDir := filepath.Join(uploads, "iso")
	hidden := filepath.Join(runDir, "run-token.secret")
	visible := filepath.Join(runDir, "invoice.txt")
	if err := os.MkdirAll(runDir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, f := range []struct{ path, text string }{{hidden, secret}, {visible, "invoice 42"}} {
		if err := os.WriteFile(f.path, []byte(f.text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(uploads, 0o755); err != nil {
		t.Fatal(err)
	}

	_, b := sandboxedBrowser(t, "iso", Sandbox{Hide: []string{data, hidden}, Uploads: uploads})
	pid := strconv.Itoa(b.cmd.Process.Pid)
	root := filepath.Join("/proc", pid, "root")

	// Its root: the system's directories, its /tmp (where its profile is), nothing else.
	entries, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	allowed := []string{"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "opt", "proc", "sbin", "tmp", "usr", "var"}
	for _, e := range entries {
		if !slices.Contains(allowed, e.Name()) {
			t.Errorf("the browser's root has /%s", e.Name())
		}
	}
	for _, p := range []string{data, filepath.Join(data, "operator.token"), "/root", "/home", "/run", "/var/lib", os.TempDir() + "/" + filepath.Base(filepath.Dir(data))} {
		if _, err := os.Lstat(filepath.Join(root, p)); err == nil {
			t.Errorf("the browser sees %s", p)
		}
	}
	if b, err := os.ReadFile(filepath.Join(root, visible)); err != nil || string(b) != "invoice 42" {
		t.Errorf("the run's upload directory in the browser's root: %q %v", b, err)
	}
	if b, err := os.ReadFile(filepath.Join(root, hidden)); err != nil || len(b) != 0 {
		t.Errorf("a hidden file in the browser's root reads %q (%v), want empty", b, err)
	}
	if err := os.WriteFile(filepath.Join(root, "etc", "stopgate-was-here"), nil, 0o644); err == nil {
		t.Errorf("the browser's /etc is writable")
	}
	if _, err := os.Stat(filepath.Join(root, "etc/chromium/policies/managed/stopgate.json")); err != nil {
		t.Errorf("no policy in the browser's root: %v", err)
	}

	// Its processes, as its own /proc shows them: its own and no other.
	procs, _ := filepath.Glob(filepath.Join(root, "proc", "[0-9]*"))
	for _, p := range procs {
		cmdline, _ := os.ReadFile(filepath.Join(p, "cmdline"))
		if len(cmdline) > 0 && !strings.Contains(string(cmdline), "chrom") {
			t.Errorf("the browser's /proc shows %s: %q", filepath.Base(p), cmdline)
		}
	}
	if len(procs) == 0 {
		t.Error("the browser's /proc shows no process")
	}

	status := procStatus(t, pid)
	wantUID := strconv.Itoa(os.Getuid())
	if os.Geteuid() == 0 {
		wantUID = strconv.Itoa(DefaultBrowserUID)
	}
	for field, want := range map[string]string{"Uid": wantUID, "CapEff": "0000000000000000", "CapPrm": "0000000000000000",
		"CapBnd": "0000000000000000", "CapAmb": "0000000000000000", "NoNewPrivs": "1"} {
		if got := strings.Fields(status[field]); len(got) == 0 || got[0] != want {
			t.Errorf("the browser's %s is %q, want %s", field, status[field], want)
		}
	}
	env, _ := os.ReadFile(filepath.Join("/proc", pid, "environ"))
	if strings.Contains(string(env), "STOPGATE_") || strings.Contains(string(env), secret) {
		t.Errorf("the browser's environment has stopgate's: %q", env)
	}
	for _, ns := range []string{"net", "mnt", "pid", "ipc"} {
		mine, _ := os.Readlink("/proc/self/ns/" + ns)
		theirs, _ := os.Readlink(filepath.Join("/proc", pid, "ns", ns))
		if mine == theirs || theirs == "" {
			t.Errorf("the browser shares stopgate's %s namespace (%s)", ns, theirs)
		}
	}

	// Around the guard, on its own pipe: Chromium's policy still keeps
	// file: off, and a download DevTools allows (the policy does not stop
	// those) lands in the browser's own /tmp, never on the host.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pol := openPage(ctx, t, b.dt, "chrome://policy/")
	var shown string
	testkit.Eventually(t, 10*time.Second, "chrome://policy lists the launcher's policy", func() bool {
		shown = pol.eval(ctx, `(function walk(n) { let s = ''; for (const e of n.querySelectorAll('*')) if (e.shadowRoot) s += e.shadowRoot.textContent + walk(e.shadowRoot); return s })(document)`)
		return strings.Contains(shown, "URLBlocklist") && strings.Contains(shown, `file://*`) && strings.Contains(shown, "DownloadRestrictions")
	})
	page := openPage(ctx, t, b.dt, "file://"+visible)
	time.Sleep(500 * time.Millisecond)
	// Chromium shows an error page (offline, in a network of its own)
	// where the file would be.
	if text := page.eval(ctx, "document.documentElement.outerHTML"); strings.Contains(text, "invoice 42") || !strings.Contains(text, "ERR_") {
		t.Errorf("a file: page opened around the guard shows %q, want an error page", regexp.MustCompile(`ERR_[A-Z_]+|invoice 42`).FindAllString(text, -1))
	}
	downloads := t.TempDir()
	if err := b.dt.call(ctx, "Browser.setDownloadBehavior", map[string]any{"behavior": "allow", "downloadPath": downloads}, nil); err != nil {
		t.Fatal(err)
	}
	page = openPage(ctx, t, b.dt, "about:blank")
	page.eval(ctx, `Object.assign(document.createElement('a'), {href: 'data:text/plain,downloaded', download: 'x.txt'}).click(); 1`)
	time.Sleep(time.Second)
	if got, _ := os.ReadDir(downloads); len(got) > 0 {
		t.Errorf("a download around the guard reached the host's %s: %v", downloads, got)
	}
}

func procStatus(t *testing.T, pid string) map[string]string {
	t.Helper()
	f, err := os.Open(filepath.Join("/proc", pid, "status"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, _ := strings.Cut(sc.Text(), ":")
		out[k] = strings.TrimSpace(v)
	}
	return out
}

// rawPage is a page session on the browser's own pipe, around the guard.
type rawPage struct {
	t *testing.T
	a *attachment
	n int64
}

func openPage(ctx context.Context, t *testing.T, d *DevTools, url string) *rawPage {
	t.Helper()
	var created target.CreateTargetResult
	if err := d.call(ctx, target.CommandCreateTarget, map[string]any{"url": url}, &created); err != nil {
		t.Fatalf("create a target at %s: %v", url, err)
	}
	a, err := d.attach(ctx, string(created.TargetID))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.detach(context.Background()) })
	return &rawPage{t: t, a: a}
}

// eval runs an expression in the page and returns its value as text.
func (p *rawPage) eval(ctx context.Context, expr string) string {
	p.t.Helper()
	p.n++
	frame, _ := json.Marshal(map[string]any{"id": p.n, "method": "Runtime.evaluate", "params": map[string]any{"expression": expr, "returnByValue": true}})
	c, err := parseCommand(frame)
	if err != nil {
		p.t.Fatal(err)
	}
	if err := p.a.send(c, frame); err != nil {
		p.t.Fatal(err)
	}
	for {
		select {
		case f := <-p.a.frames:
			if r := parseReply(f); r.HasID && r.ID == p.n {
				return string(f)
			}
		case <-ctx.Done():
			p.t.Fatalf("no answer to %s", expr)
		}
	}
}

// TestBrowserSeesNothingOfTheMachineWithoutRoot runs the test above as a
// user that is not root, where the browser's namespaces are made in a user
// namespace of its own.
func TestBrowserSeesNothingOfTheMachineWithoutRoot(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("runs as another user: needs root to become it (TestBrowserSeesNothingOfTheMachine runs as this one)")
	}
	testkit.NeedTools(t, "setpriv")
	// Somewhere that user can read the test binary and write its temp files.
	dir, err := os.MkdirTemp("", "stopgate-nonroot-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "browserguard.test")
	if err := copyFile(exe, bin); err != nil {
		t.Fatal(err)
	}
	tmp := filepath.Join(dir, "tmp")
	if err := os.Mkdir(tmp, 0o700); err != nil {
		t.Fatal(err)
	}
	const nobody = "65534"
	if err := os.Chown(tmp, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "setpriv", "--reuid", nobody, "--regid", nobody, "--clear-groups",
		bin, "-test.run", "^TestBrowserSeesNothingOfTheMachine$", "-test.v", "-test.count=1")
	cmd.Env = []string{"TMPDIR=" + tmp, "PATH=" + os.Getenv("PATH"), "HOME=" + tmp}
	if c := os.Getenv("STOPGATE_CHROMIUM"); c != "" {
		cmd.Env = append(cmd.Env, "STOPGATE_CHROMIUM="+c)
	}
	cmd.WaitDelay = 10 * time.Second
	out, err := cmd.CombinedOutput()
	t.Logf("as uid %s:\n%s", nobody, out)
	if err != nil || !regexp.MustCompile(`(?m)^--- PASS: TestBrowserSeesNothingOfTheMachine\b`).Match(out) {
		t.Fatalf("as uid %s: %v", nobody, err)
	}
}

func copyFile(from, to string) error {
	in, err := os.Open(from)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(to, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o755)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
