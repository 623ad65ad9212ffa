//go:build !linux

package browserguard

import (
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"time"
)

// SandboxMain does nothing here: browsers run in namespaces on Linux only.
func SandboxMain() {}

type sandboxed struct {
	cmd      *exec.Cmd
	listener net.Listener
}

func startSandboxed(sandboxSpec, string, []*os.File, io.Writer, time.Time) (*sandboxed, error) {
	return nil, errors.New("browser isolation with namespaces needs Linux: start serve with --browser-isolation=none")
}
