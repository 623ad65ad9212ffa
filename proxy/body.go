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
	// mem is the Reader of a body kept in memory.
	mem bytes.Reader
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
	// The buffer grows with what arrives: a client that sends slowly holds
	// the bytes it sent, not the whole memory limit up front.
	var head bytes.Buffer
	n, err := head.ReadFrom(io.LimitReader(r, inMemory+1))
	if err != nil {
		return nil, bodyError(err)
	}
	if n <= inMemory {
		if n > limit {
			return nil, errBodyTooLarge
		}
		// Digested whole, as it is all here: no hash that reads along.
		sum := sha256.Sum256(head.Bytes())
		b := &spooledBody{size: n, digest: sha256Digest(sum[:])}
		b.mem.Reset(head.Bytes())
		b.Reader = &b.mem
		return b, nil
	}
	h := sha256.New()
	h.Write(head.Bytes())
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
	var sum [sha256.Size]byte
	return &spooledBody{Reader: f, size: written, digest: sha256Digest(h.Sum(sum[:0])), file: f}, nil
}

// sha256Digest is a body's digest as the ledger records it, written out
// in one string.
func sha256Digest(sum []byte) string {
	const prefix = "sha256:"
	var b [len(prefix) + 2*sha256.Size]byte
	copy(b[:], prefix)
	hex.Encode(b[len(prefix):], sum)
	return string(b[:])
}

func bodyError(err error) error {
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("read request body: %w: %w", errBodyIncomplete, err)
	}
	return fmt.Errorf("read request body: %w", err)
}
