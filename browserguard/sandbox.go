package browserguard

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// Isolation is how a launched browser is kept from the machine it runs on.
type Isolation string

const (
	// IsolateNamespaces (the default) starts Chromium in namespaces of its
	// own (mount, pid, network, IPC; and user, where stopgate is not
	// root): its file system is a new root holding only the system's
	// directories (read-only), a private /tmp and its profile, so that
	// stopgate's data directory, its secrets, /proc of other processes and
	// every home directory are not there to be read; its network is a
	// loopback of its own where the only thing listening is its egress
	// proxy, so that no other process can reach that listener and the
	// browser can reach nothing else. Where stopgate is root, Chromium also
	// runs as a uid of its own (Sandbox.UID).
	IsolateNamespaces Isolation = "namespaces"
	// IsolateNone starts Chromium as a plain child process, as stopgate's
	// own user, with its egress listener on the host's loopback (open to
	// every local process). Only for machines that cannot make namespaces:
	// the guard's refusals still hold, the operating system's do not.
	IsolateNone Isolation = "none"
)

// ParseIsolation reads an Isolation from its name.
func ParseIsolation(s string) (Isolation, error) {
	switch Isolation(s) {
	case IsolateNamespaces, IsolateNone:
		return Isolation(s), nil
	}
	return "", fmt.Errorf("isolation %q: want %s or %s", s, IsolateNamespaces, IsolateNone)
}

// DefaultBrowserUID is the uid (and gid) a browser runs as where stopgate
// is root: outside the ranges Debian, systemd (dynamic users, containers,
// homed), distroless images and container runtimes hand out, so that no
// agent or other service shares it.
const DefaultBrowserUID = 2147000000

// Sandbox is how the launcher isolates each browser.
type Sandbox struct {
	// Isolation is IsolateNamespaces when empty.
	Isolation Isolation
	// Helper is the executable that sets up a browser's namespaces and
	// then becomes Chromium: a program whose main calls SandboxMain first
	// (stopgate itself; a test binary whose TestMain does). Required with
	// IsolateNamespaces.
	Helper string
	// UID and GID are what the browser runs as where stopgate is root
	// (DefaultBrowserUID when zero); where it is not, the browser keeps
	// stopgate's user, in a user namespace.
	UID, GID int
	// Hide are paths (files or directories) the browser must never read:
	// stopgate's data directory and secret files. They are outside the
	// browser's root anyway unless they live under a system directory
	// (/etc, /opt, /usr, ...), where they are then covered by an empty
	// file or directory.
	Hide []string
	// Uploads is the directory whose RUN subdirectory (Uploads/RUN) the
	// browser of run RUN may upload files from (DOM.setFileInputFiles,
	// dropped files); it is bound read-only into the browser's root.
	// Empty: no uploads at all.
	Uploads string
}

// UploadDir is the directory run's browser may upload from, "" for none.
func (s Sandbox) UploadDir(run string) string {
	if s.Uploads == "" {
		return ""
	}
	return filepath.Join(s.Uploads, strings.ReplaceAll(run, "/", "_"))
}

// sandboxProxyPort is where a browser in its own network namespace finds
// its egress proxy: the namespace is new, so any port is free.
const sandboxProxyPort = 3128

// The sandbox's file system.
const (
	// The tmpfs sizes: memory, used only as it is written.
	sandboxTmpSize     = "256m"
	sandboxShmSize     = "256m"
	sandboxProfileSize = "512m"
)

// systemDirs are bound read-only into a browser's root, where they exist:
// programs, libraries, and the system's configuration (fonts, locales,
// time zones, the dynamic linker's cache). /etc is bound entry by entry so
// that Chromium's policy directories can be the launcher's own.
var systemDirs = []string{"/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt", "/var/cache/fontconfig"}

// policyDirs are where Chromium builds read managed policies; each gets
// the launcher's policy file.
var policyDirs = []string{"/etc/chromium/policies/managed", "/etc/opt/chrome/policies/managed"}

// browserPolicy is Chromium's managed policy for a sandboxed browser: a
// layer under the guard's own refusals, for what a page asks for itself.
// No local files by any URL, no downloads, no file pickers, no extensions,
// no File System Access. Not chrome:// and devtools:// (the guard refuses
// them, and pages cannot open them): blocked by policy, Chromium 156
// stops delivering some rendering updates (Puppeteer's clicks time out
// waiting for an IntersectionObserver).
var browserPolicy = map[string]any{
	"URLBlocklist":                       []string{"file://*", "view-source:*", "filesystem:*"},
	"DownloadRestrictions":               3,
	"AllowFileSelectionDialogs":          false,
	"ExtensionInstallBlocklist":          []string{"*"},
	"DefaultFileSystemReadGuardSetting":  2,
	"DefaultFileSystemWriteGuardSetting": 2,
}

// sandboxSpec is what the launcher tells the helper (as JSON on its fd 5).
type sandboxSpec struct {
	// Root is the host directory the browser's root is mounted on; it is
	// also the path of its profile inside that root.
	Root string
	// Exe and Args are Chromium's; Env its whole environment.
	Exe  string
	Args []string
	Env  []string
	// Binds are host directories bound read-only at the same path.
	Binds []string
	// Uploads is bound read-only at the same path ("" for none).
	Uploads string
	Hide    []string
	Policy  json.RawMessage
	// AsRoot is set where the helper runs as the real root: it drops to
	// UID and GID itself before it becomes Chromium.
	AsRoot   bool
	UID, GID int
	// ProxyPort is where the helper opens the listener it hands back.
	ProxyPort int
}

// browserEnv is a launched browser's whole environment: nothing of
// stopgate's own (which may hold its secrets), a home in its profile (so
// that ~/Downloads and ~/.config are the profile's).
func browserEnv(profile string) []string {
	env := []string{
		"HOME=" + profile,
		"TMPDIR=/tmp",
		"PATH=/usr/local/bin:/usr/bin:/bin",
		"XDG_CONFIG_HOME=" + filepath.Join(profile, ".config"),
		"XDG_CACHE_HOME=" + filepath.Join(profile, ".cache"),
	}
	for _, k := range []string{"LANG", "LC_ALL", "TZ"} {
		if v := os.Getenv(k); v != "" {
			env = append(env, k+"="+v)
		}
	}
	return env
}
