// Package runtoken signs and verifies run tokens: credentials that name one
// run and the cancel version its worker observed, signed by the control
// plane, so that a worker holding one cannot name another run. It only
// signs and checks; it never reads or changes a run.
package runtoken

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
)

// prefix marks a token and its format version, so a password that is a
// token is told apart from one that is a cancel version.
const prefix = "sg1."

// MinSecretLen is the shortest secret accepted.
const MinSecretLen = 32

// ErrInvalid is every token that does not verify; the wrapping message says why.
var ErrInvalid = errors.New("invalid run token")

// Claims are what a token says.
type Claims struct {
	RunID   string    `json:"r"`
	Version int64     `json:"v"`
	Expires time.Time `json:"-"`
	ExpUnix int64     `json:"e"`
}

// Signer signs and verifies tokens with one secret.
type Signer struct{ key []byte }

// New returns a signer; a secret shorter than MinSecretLen is refused.
func New(secret []byte) (*Signer, error) {
	if len(secret) < MinSecretLen {
		return nil, fmt.Errorf("run token secret is %d bytes: want at least %d", len(secret), MinSecretLen)
	}
	return &Signer{key: append([]byte(nil), secret...)}, nil
}

// IsToken reports whether s has the shape of a token (not whether it verifies).
func IsToken(s string) bool { return strings.HasPrefix(s, prefix) }

// Sign makes a token for run at version, good until expires.
func (s *Signer) Sign(run string, version int64, expires time.Time) string {
	payload, _ := json.Marshal(Claims{RunID: run, Version: version, ExpUnix: expires.Unix()})
	body := prefix + base64.RawURLEncoding.EncodeToString(payload)
	return body + "." + base64.RawURLEncoding.EncodeToString(s.mac(body))
}

// Verify checks the signature and the expiry, and returns the claims.
func (s *Signer) Verify(token string, now time.Time) (Claims, error) {
	if !IsToken(token) {
		return Claims{}, fmt.Errorf("%w: not a run token (want %s…)", ErrInvalid, prefix)
	}
	i := strings.LastIndexByte(token, '.')
	body, sig := token[:i], token[i+1:]
	got, err := base64.RawURLEncoding.DecodeString(sig)
	if err != nil || !hmac.Equal(got, s.mac(body)) {
		return Claims{}, fmt.Errorf("%w: the signature does not match", ErrInvalid)
	}
	payload, err := base64.RawURLEncoding.DecodeString(strings.TrimPrefix(body, prefix))
	if err != nil {
		return Claims{}, fmt.Errorf("%w: unreadable claims", ErrInvalid)
	}
	var c Claims
	if err := json.Unmarshal(payload, &c); err != nil || c.RunID == "" || c.Version < 1 {
		return Claims{}, fmt.Errorf("%w: unreadable claims", ErrInvalid)
	}
	c.Expires = time.Unix(c.ExpUnix, 0).UTC()
	if !now.Before(c.Expires) {
		return Claims{}, fmt.Errorf("%w: expired at %s", ErrInvalid, c.Expires.Format(time.RFC3339))
	}
	return c, nil
}

func (s *Signer) mac(body string) []byte {
	m := hmac.New(sha256.New, s.key)
	m.Write([]byte(body))
	return m.Sum(nil)
}
