package proxy

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
)

// memoryBodyLimit is the largest request body kept in memory while it is
// digested; larger ones are spooled to an unlinked temporary file, so that
// the guard can name the effect by its digest before anything is sent and a
// large upload never sits whole in memory.
const memoryBodyLimit = 64 << 10

var errBodyTooLarge = errors.New("request body too large")

// spooledBody is a request body read once, digested, and replayable once.
type spooledBody struct {
	io.Reader
	size   int64
	digest string
	file   *os.File
}

func (b *spooledBody) Close() error {
	if b.file != nil {
		return b.file.Close()
	}
	return nil
}

// spool reads r to its end (at most limit bytes), computing its SHA-256.
func spool(r io.Reader, dir string, limit int64) (*spooledBody, error) {
	h := sha256.New()
	head := make([]byte, memoryBodyLimit+1)
	n, err := io.ReadFull(io.TeeReader(r, h), head)
	if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("read request body: %w", err)
	}
	if n <= memoryBodyLimit {
		if int64(n) > limit {
			return nil, errBodyTooLarge
		}
		return &spooledBody{Reader: bytes.NewReader(head[:n]), size: int64(n), digest: "sha256:" + hex.EncodeToString(h.Sum(nil))}, nil
	}
	f, err := os.CreateTemp(dir, "stopgate-body-*")
	if err != nil {
		return nil, fmt.Errorf("spool request body: %w", err)
	}
	// Unlinked at once: the file is gone whatever happens to this process.
	_ = os.Remove(f.Name())
	written, err := io.Copy(f, io.LimitReader(io.MultiReader(bytes.NewReader(head[:n]), io.TeeReader(r, h)), limit+1))
	if err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("spool request body: %w", err)
	}
	if written > limit {
		_ = f.Close()
		return nil, errBodyTooLarge
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("rewind spooled body: %w", err)
	}
	return &spooledBody{Reader: f, size: written, digest: "sha256:" + hex.EncodeToString(h.Sum(nil)), file: f}, nil
}
