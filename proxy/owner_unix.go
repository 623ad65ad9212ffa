//go:build unix

package proxy

import (
	"io/fs"
	"syscall"
)

// ownedByRoot reports whether uid 0 owns the file.
func ownedByRoot(info fs.FileInfo) bool {
	st, ok := info.Sys().(*syscall.Stat_t)
	return ok && st.Uid == 0
}
