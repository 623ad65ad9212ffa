package control

import (
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// The control plane's secrets in the data directory. stopgate serve
// creates each on its first start when it is not given one, and the CLI
// reads the operator token from there, so that a fresh install is closed
// and yet usable from the same directory without copying a secret by hand.
const (
	// DefaultDataDir is serve's data directory, and where the CLI looks
	// for the operator token, when none is named.
	DefaultDataDir = "./stopgate-data"
	// OperatorTokenFile holds the operator token.
	OperatorTokenFile = "operator.token"
	// ReadTokenFile holds the read-only token, for dashboards and people
	// who watch but do not act.
	ReadTokenFile = "read-only.token"
	// RunTokenSecretFile holds the secret that signs run tokens.
	RunTokenSecretFile = "run-token.secret"
)

// Token prefixes: a token found in a log or a paste says what it is.
const (
	OperatorTokenPrefix = "sgop_"
	ReadTokenPrefix     = "sgro_"
)

// MaxSecretLen bounds a secret read from a file: a token is one line.
const MaxSecretLen = 4096

// GenerateToken is prefix and 32 random bytes, base64url: a bearer token
// that fits any header, URL and shell without quoting.
func GenerateToken(prefix string) (string, error) {
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("generate a token: %w", err)
	}
	return prefix + base64.RawURLEncoding.EncodeToString(b[:]), nil
}

// GenerateSecret is 32 random bytes, hex: a run-token signing secret.
func GenerateSecret() (string, error) {
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("generate a secret: %w", err)
	}
	return hex.EncodeToString(b[:]), nil
}

// CheckSecret accepts a token or secret that can travel in an HTTP header
// as it is: printable ASCII, no spaces.
func CheckSecret(s string) error {
	if s == "" {
		return errors.New("is empty")
	}
	if len(s) > MaxSecretLen {
		return fmt.Errorf("is %d bytes, longer than %d", len(s), MaxSecretLen)
	}
	for i := 0; i < len(s); i++ {
		if s[i] < 0x21 || s[i] > 0x7e {
			return fmt.Errorf("has a space, a control character or a byte outside ASCII at offset %d", i)
		}
	}
	return nil
}

// ReadSecretFile reads a secret kept alone in a file (surrounding white
// space, a trailing newline included, is not part of it). exposed reports
// a file that users other than its owner may read.
func ReadSecretFile(path string) (secret string, exposed bool, err error) {
	f, err := os.Open(path)
	if err != nil {
		return "", false, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return "", false, err
	}
	if !st.Mode().IsRegular() {
		return "", false, fmt.Errorf("%s is not a regular file", path)
	}
	raw, err := io.ReadAll(io.LimitReader(f, MaxSecretLen+2))
	if err != nil {
		return "", false, fmt.Errorf("read %s: %w", path, err)
	}
	secret = strings.TrimSpace(string(raw))
	if err := CheckSecret(secret); err != nil {
		return "", false, fmt.Errorf("the secret in %s %v", path, err)
	}
	return secret, st.Mode().Perm()&0o077 != 0, nil
}

// LoadOrCreateSecret reads the secret kept in path, or creates the file
// with a fresh one from generate: mode 0600, written whole under a
// temporary name and then linked into place, so that nobody ever reads a
// half-written secret, and an existing file (another process's, created
// meanwhile) is never overwritten. created says which happened.
func LoadOrCreateSecret(path string, generate func() (string, error)) (secret string, created, exposed bool, err error) {
	secret, exposed, err = ReadSecretFile(path)
	if err == nil {
		return secret, false, exposed, nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return "", false, false, err
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", false, false, fmt.Errorf("create %s: %w", dir, err)
	}
	if secret, err = generate(); err != nil {
		return "", false, false, err
	}
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".*") // 0600
	if err != nil {
		return "", false, false, fmt.Errorf("create %s: %w", path, err)
	}
	defer os.Remove(tmp.Name())
	_, err = tmp.WriteString(secret + "\n")
	if err == nil {
		err = tmp.Chmod(0o600)
	}
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return "", false, false, fmt.Errorf("write %s: %w", path, err)
	}
	// A link fails where a rename would replace: the first writer wins.
	if err := os.Link(tmp.Name(), path); err != nil {
		if errors.Is(err, fs.ErrExist) {
			secret, exposed, err = ReadSecretFile(path)
			return secret, false, exposed, err
		}
		return "", false, false, fmt.Errorf("create %s: %w", path, err)
	}
	syncDir(dir)
	return secret, true, false, nil
}

// syncDir makes the new name durable; a failure only loses the file in a
// crash, and the next start creates another.
func syncDir(dir string) {
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		_ = d.Close()
	}
}
