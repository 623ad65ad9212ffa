package browserguard

import "syscall"

// procAttr puts the browser in a process group of its own, so that it can
// be stopped whole, and kills it if stopgate dies without stopping it
// (kill -9): a browser left behind would outlive its run's guard.
func procAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
