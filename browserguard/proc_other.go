//go:build unix && !linux

package browserguard

import "syscall"

// procAttr puts the browser in a process group of its own, so that it can
// be stopped whole.
func procAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}

// zombie is not told apart from a live process here.
func zombie(int) bool { return false }
