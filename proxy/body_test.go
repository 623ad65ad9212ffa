package proxy

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
)

func TestSpoolTakesOnlyWholeBodies(t *testing.T) {
	for _, tc := range []struct {
		name, raw string
		// body is what spool must hand on; "" with wantErr for a refusal.
		body    string
		wantErr error
	}{
		{"content-length whole", "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nhello", "hello", nil},
		{"content-length short", "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 20\r\n\r\n14 bytes here.", "", errBodyIncomplete},
		{"chunked whole", "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", "hello", nil},
		{"chunked without its last chunk", "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", "", errBodyIncomplete},
		{"chunked cut inside a chunk", "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\na\r\nhel", "", errBodyIncomplete},
		{"over the limit", "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 40\r\n\r\n" + strings.Repeat("x", 40), "", errBodyTooLarge},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, err := http.ReadRequest(bufio.NewReader(strings.NewReader(tc.raw)))
			if err != nil {
				t.Fatal(err)
			}
			b, err := spool(req.Body, t.TempDir(), 32)
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("spool: %v, want %v", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer b.Close()
			got, _ := io.ReadAll(b)
			if string(got) != tc.body || b.size != int64(len(tc.body)) {
				t.Fatalf("spooled %q (%d), want %q", got, b.size, tc.body)
			}
		})
	}
}

// FuzzSpool: whatever the bytes on the wire and their framing
// (Content-Length or chunked, whole or cut anywhere), spool hands on a body
// exactly when the framing delivered a whole one, and then exactly its
// bytes and their digest; past the limit it refuses. It never forwards a
// part of a body as if it were all of it.
func FuzzSpool(f *testing.F) {
	for _, seed := range []struct {
		raw   string
		limit uint16
	}{
		{"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nhello", 64},
		{"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 20\r\n\r\n14 bytes here.", 64},
		{"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 64},
		{"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", 64},
		{"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n0\r\nTrailer: x\r\n\r\n", 64},
		{"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\n\r\nabcdef", 2},
		{"POST / HTTP/1.0\r\nHost: h\r\n\r\nread until the connection ends", 64},
	} {
		f.Add([]byte(seed.raw), seed.limit)
	}
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, raw []byte, limit uint16) {
		req, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(raw)))
		if err != nil {
			return
		}
		// What the framing delivers, read by net/http itself.
		again, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(raw)))
		if err != nil {
			t.Fatalf("the same bytes parsed once, then not: %v", err)
		}
		want, wantErr := io.ReadAll(again.Body)
		// A small memory limit as well, so that the fuzzer also goes
		// through the temporary file.
		b, err := spoolWith(req.Body, dir, int64(limit), 16)
		switch {
		case wantErr != nil && err == nil:
			t.Fatalf("framing failed (%v) but spool handed on %d bytes", wantErr, b.size)
		case wantErr != nil:
			return
		case int64(len(want)) > int64(limit):
			if !errors.Is(err, errBodyTooLarge) {
				t.Fatalf("%d bytes over a limit of %d: %v", len(want), limit, err)
			}
			return
		case err != nil:
			t.Fatalf("a whole body of %d bytes refused: %v", len(want), err)
		}
		defer b.Close()
		got, err := io.ReadAll(b)
		sum := sha256.Sum256(want)
		if err != nil || !bytes.Equal(got, want) || b.size != int64(len(want)) || b.digest != "sha256:"+hex.EncodeToString(sum[:]) {
			t.Fatalf("spooled %q (%d, %s, %v), want %q", got, b.size, b.digest, err, want)
		}
	})
}
