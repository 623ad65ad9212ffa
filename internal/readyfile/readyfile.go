// Package readyfile is the file `stopgate serve --ready-file` writes once
// every listener is up: the addresses they are bound to, as JSON, so that a
// caller that asked for port 0 (a test suite, a supervisor) learns them
// without parsing logs and without picking a port that another process
// may take first. It owns the format; it never opens a listener.
package readyfile

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// Addrs are serve's bound listeners, host:port each.
type Addrs struct {
	Proxy   string `json:"proxy"`
	Control string `json:"control"`
	Browser string `json:"browser"`
	// Metrics is empty without --metrics-addr.
	Metrics string `json:"metrics,omitempty"`
	// Transparent lists the transparent listeners (none without
	// --transparent-addr).
	Transparent []string `json:"transparent,omitempty"`
}

// Write puts a at path whole or not at all: a reader never sees half a
// file (a temporary file in the same directory, renamed over path).
func Write(path string, a Addrs) error {
	b, err := json.MarshalIndent(a, "", "  ")
	if err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return fmt.Errorf("ready file %s: %w", path, err)
	}
	_, werr := f.Write(append(b, '\n'))
	cerr := f.Close()
	if err := errors.Join(werr, cerr); err != nil {
		_ = os.Remove(f.Name())
		return fmt.Errorf("ready file %s: %w", path, err)
	}
	if err := os.Rename(f.Name(), path); err != nil {
		_ = os.Remove(f.Name())
		return fmt.Errorf("ready file %s: %w", path, err)
	}
	return nil
}

// Read reads the file Write wrote; os.ErrNotExist until it has.
func Read(path string) (Addrs, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return Addrs{}, err
	}
	var a Addrs
	if err := json.Unmarshal(b, &a); err != nil {
		return Addrs{}, fmt.Errorf("ready file %s: %w", path, err)
	}
	return a, nil
}
