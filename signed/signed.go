// Package signed owns stopgate's HMAC-SHA256 formats, each written once:
//
//   - a MAC of a purpose and a text, base64url (Key.Sum): a console form's
//     CSRF token, and the MAC of every sealed value;
//   - sealed claims (Key.Seal, Key.Open): a prefix that says what they are
//     and in which format ("sg1." for a run token), the claims as base64url
//     JSON, a dot, and the Sum of all before it under the prefix: run tokens
//     and console sessions;
//   - the webhook signature a provider puts on a body (Webhook,
//     CheckWebhook): "sha256=" and the hex HMAC of the body as sent, the
//     format GitHub and Stripe use.
//
// It only signs and checks; what the claims mean, how long they last and
// who may hold them are its callers' to say.
package signed

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
)

// Why Open refused a value.
var (
	// ErrPrefix: the value does not start with the prefix it must have.
	ErrPrefix = errors.New("not a sealed value of this kind")
	// ErrSignature: the MAC is missing or does not match.
	ErrSignature = errors.New("the signature does not match")
	// ErrClaims: the signature matches, the claims do not decode.
	ErrClaims = errors.New("unreadable claims")
)

// Key is an HMAC-SHA256 key.
type Key struct{ k []byte }

// NewKey keeps a copy of secret as a key.
func NewKey(secret []byte) Key { return Key{k: append([]byte(nil), secret...)} }

// Derive is the key for one purpose, from k: a secret given for one use
// (the operator token) serves another (console sessions) without being the
// key of both.
func (k Key) Derive(purpose string) Key { return Key{k: k.mac(purpose, "")} }

func (k Key) mac(purpose, text string) []byte {
	m := hmac.New(sha256.New, k.k)
	m.Write([]byte(purpose))
	m.Write([]byte(text))
	return m.Sum(nil)
}

// Sum is the base64url MAC of purpose and text together: purpose keeps a
// MAC made for one use from standing in for another.
func (k Key) Sum(purpose, text string) string {
	return base64.RawURLEncoding.EncodeToString(k.mac(purpose, text))
}

// Equal compares two MACs in constant time; an empty one never matches.
func Equal(a, b string) bool { return a != "" && hmac.Equal([]byte(a), []byte(b)) }

// Seal is claims as a sealed value under prefix.
func (k Key) Seal(prefix string, claims any) (string, error) {
	payload, err := json.Marshal(claims)
	if err != nil {
		return "", fmt.Errorf("seal: %w", err)
	}
	body := base64.RawURLEncoding.EncodeToString(payload)
	return prefix + body + "." + k.Sum(prefix, body), nil
}

// Open checks a sealed value's prefix and MAC and decodes its claims into
// dst. Its errors are ErrPrefix, ErrSignature and ErrClaims.
func (k Key) Open(prefix, value string, dst any) error {
	rest, ok := strings.CutPrefix(value, prefix)
	if !ok {
		return ErrPrefix
	}
	i := strings.LastIndexByte(rest, '.')
	if i < 0 || !Equal(rest[i+1:], k.Sum(prefix, rest[:i])) {
		return ErrSignature
	}
	payload, err := base64.RawURLEncoding.DecodeString(rest[:i])
	if err != nil || json.Unmarshal(payload, dst) != nil {
		return ErrClaims
	}
	return nil
}

// WebhookScheme leads a webhook signature.
const WebhookScheme = "sha256="

// Webhook is the signature header value of body under secret.
func Webhook(secret, body []byte) string {
	m := hmac.New(sha256.New, secret)
	m.Write(body)
	return WebhookScheme + hex.EncodeToString(m.Sum(nil))
}

// CheckWebhook reads the values of a webhook's signature header and checks
// them against body: wellFormed says there is exactly one, of the form
// sha256=<64 hex digits>; match that it is body's under secret. The MAC is
// computed whatever the header holds, so that the time of the answer tells
// nothing.
func CheckWebhook(secret, body []byte, values []string) (wellFormed, match bool) {
	m := hmac.New(sha256.New, secret)
	m.Write(body)
	want := m.Sum(nil)
	if len(values) != 1 {
		return false, false
	}
	hexSum, ok := strings.CutPrefix(strings.TrimSpace(values[0]), WebhookScheme)
	if !ok {
		return false, false
	}
	got, err := hex.DecodeString(hexSum)
	if err != nil || len(got) != sha256.Size {
		return false, false
	}
	return true, hmac.Equal(got, want)
}
