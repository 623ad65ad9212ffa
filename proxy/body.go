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

// errBodyIncomplete is a body that ended before its framing said it would
// (a Content-Length not reached, a chunked body without its last chunk):
// forwarding it would send the upstream a request the client never finished.
var errBodyIncomplete = errors.New("the request body ended before its framing said it would (client gave up mid-body?)")

// spool reads r to its end (at most limit bytes), computing its SHA-256.
// Only a clean io.EOF ends a body: any other error, io.ErrUnexpectedEOF
// from a truncated framing included, refuses it.
func spool(r io.Reader, dir string, limit int64) (*spooledBody, error) {
	return spoolWith(r, dir, limit, memoryBodyLimit)
}

// spoolWith is spool keeping at most inMemory bytes in memory.
func spoolWith(r io.Reader, dir string, limit, inMemory int64) (*spooledBody, error) {
	h := sha256.New()
	// The buffer grows with what arrives: a client that sends slowly holds
	// the bytes it sent, not the whole memory limit up front.
	var head bytes.Buffer
	n, err := head.ReadFrom(io.LimitReader(io.TeeReader(r, h), inMemory+1))
	if err != nil {
		return nil, bodyError(err)
	}
	if n <= inMemory {
		if n > limit {
			return nil, errBodyTooLarge
		}
		return &spooledBody{Reader: bytes.NewReader(head.Bytes()), size: n, digest: "sha256:" + hex.EncodeToString(h.Sum(nil))}, nil
	}
	f, err := os.CreateTemp(dir, "stopgate-body-*")
	if err != nil {
		return nil, fmt.Errorf("spool request body: %w", err)
	}
	// Unlinked at once: the file is gone whatever happens to this process.
	_ = os.Remove(f.Name())
	written, err := io.Copy(f, io.LimitReader(io.MultiReader(&head, io.TeeReader(r, h)), limit+1))
	if err != nil {
		_ = f.Close()
		return nil, bodyError(err)
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

func bodyError(err error) error {
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("read request body: %w: %w", errBodyIncomplete, err)
	}
	return fmt.Errorf("read request body: %w", err)
}
