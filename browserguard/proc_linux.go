package browserguard

import (
	"bytes"
	"os"
	"strconv"
	"syscall"
)

// procAttr puts the browser in a process group of its own, so that it can
// be stopped whole, and kills it if stopgate dies without stopping it
// (kill -9): a browser left behind would outlive its run's guard.
func procAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}

// zombie reports whether pid has exited and is not yet reaped: a browser
// whose stopgate was killed stays one until init reaps it.
func zombie(pid int) bool {
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	// The state follows the command name, which is in parentheses and may
	// itself hold any byte.
	i := bytes.LastIndexByte(stat, ')')
	return i >= 0 && i+2 < len(stat) && stat[i+2] == 'Z'
}
