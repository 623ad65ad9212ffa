// Package runtoken signs and verifies run tokens: credentials that name one
// run and the cancel version its worker observed, signed by the control
// plane, so that a worker holding one cannot name another run. It only
// signs and checks; it never reads or changes a run.
package runtoken

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/stopgate/stopgate/signed"
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
type Signer struct{ key signed.Key }

// New returns a signer; a secret shorter than MinSecretLen is refused.
func New(secret []byte) (*Signer, error) {
	if len(secret) < MinSecretLen {
		return nil, fmt.Errorf("run token secret is %d bytes: want at least %d", len(secret), MinSecretLen)
	}
	return &Signer{key: signed.NewKey(secret)}, nil
}

// IsToken reports whether s has the shape of a token (not whether it verifies).
func IsToken(s string) bool { return strings.HasPrefix(s, prefix) }

// Sign makes a token for run at version, good until expires: the claims
// sealed under the prefix (package signed's one format).
func (s *Signer) Sign(run string, version int64, expires time.Time) string {
	tok, err := s.key.Seal(prefix, Claims{RunID: run, Version: version, ExpUnix: expires.Unix()})
	if err != nil {
		// Claims of a string and two numbers always encode.
		panic(err)
	}
	return tok
}

// Verify checks the signature and the expiry, and returns the claims.
func (s *Signer) Verify(token string, now time.Time) (Claims, error) {
	var c Claims
	switch err := s.key.Open(prefix, token, &c); {
	case errors.Is(err, signed.ErrPrefix):
		return Claims{}, fmt.Errorf("%w: not a run token (want %s…)", ErrInvalid, prefix)
	case err != nil:
		return Claims{}, fmt.Errorf("%w: %w", ErrInvalid, err)
	case c.RunID == "" || c.Version < 1:
		return Claims{}, fmt.Errorf("%w: %w", ErrInvalid, signed.ErrClaims)
	}
	c.Expires = time.Unix(c.ExpUnix, 0).UTC()
	if !now.Before(c.Expires) {
		return Claims{}, fmt.Errorf("%w: expired at %s", ErrInvalid, c.Expires.Format(time.RFC3339))
	}
	return c, nil
}
