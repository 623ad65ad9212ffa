package control

import (
	"crypto/rand"
	"encoding/base64"
	"errors"
	"net/http"
	"strings"
	"time"

	"github.com/stopgate/stopgate/signed"
)

// Console sessions: the login form takes a token once and hands the browser
// a cookie that says which scope it proved, signed, so that the token
// itself never lives in the browser. The cookie is HttpOnly (no script
// reads it) and SameSite=Strict (no other site's page sends it), and every
// form carries a CSRF token bound to the cookie besides.

const (
	// SessionCookie is the console's cookie.
	SessionCookie = "stopgate_session"
	// SessionTTL is how long a login lasts.
	SessionTTL = 12 * time.Hour
	// csrfField is the hidden field of every console form.
	csrfField = "csrf"
	// maxConsoleName bounds the name an operator gives at login.
	maxConsoleName = 64
)

// session is what a console cookie says.
type session struct {
	Scope   Scope  `json:"s"`
	Name    string `json:"n,omitempty"`
	Expires int64  `json:"e"`
	// Nonce makes two logins' cookies (and their CSRF tokens) differ.
	Nonce string `json:"x"`
}

// sessionKeys sign the console's cookies and CSRF tokens.
type sessionKeys struct{ key signed.Key }

// Prefixes of what the console signs: a cookie is a sealed session, a
// form's CSRF token the MAC of its cookie.
const (
	sessionPrefix = "sgs1."
	csrfPurpose   = "sgcsrf1."
)

// newSessionKeys derives the key from the operator token, so that sessions
// survive a restart and work on every instance sharing the token, and end
// when the token is replaced. Without one (an open control plane) the key
// is random: sessions end with the process.
func newSessionKeys(operatorToken string) (sessionKeys, error) {
	if operatorToken == "" {
		k := make([]byte, 32)
		if _, err := rand.Read(k); err != nil {
			return sessionKeys{}, err
		}
		return sessionKeys{key: signed.NewKey(k)}, nil
	}
	return sessionKeys{key: signed.NewKey([]byte(operatorToken)).Derive("stopgate console session v1")}, nil
}

// issue is the cookie value of a new session.
func (k sessionKeys) issue(scope Scope, name string, now time.Time) (string, error) {
	nonce := make([]byte, 12)
	if _, err := rand.Read(nonce); err != nil {
		return "", err
	}
	return k.key.Seal(sessionPrefix, session{Scope: scope, Name: name, Expires: now.Add(SessionTTL).Unix(), Nonce: base64.RawURLEncoding.EncodeToString(nonce)})
}

var errBadSession = errors.New("the console session is not valid: log in again")

// open checks a cookie value and says what it proves.
func (k sessionKeys) open(value string, now time.Time) (session, error) {
	var s session
	if err := k.key.Open(sessionPrefix, value, &s); err != nil || (s.Scope != ScopeOperator && s.Scope != ScopeReadOnly) {
		return session{}, errBadSession
	}
	if now.Unix() >= s.Expires {
		return session{}, errors.New("the console session has expired: log in again")
	}
	return s, nil
}

// csrf is the form token of the session whose cookie value is given.
func (k sessionKeys) csrf(cookie string) string { return k.key.Sum(csrfPurpose, cookie) }

// setSessionCookie hands the browser its session.
func setSessionCookie(w http.ResponseWriter, r *http.Request, value string, maxAge int) {
	http.SetCookie(w, &http.Cookie{
		Name: SessionCookie, Value: value, Path: "/", MaxAge: maxAge,
		HttpOnly: true, SameSite: http.SameSiteStrictMode,
		// Secure only where the browser can send it back: the control
		// listener is plain HTTP unless something terminates TLS before it.
		Secure: r.TLS != nil,
	})
}

// consoleName checks the name an operator gives at login.
func consoleName(name string) (string, error) {
	name = strings.TrimSpace(name)
	if len(name) > maxConsoleName {
		return "", errors.New("the name is longer than 64 characters")
	}
	for i := 0; i < len(name); i++ {
		if name[i] < 0x21 || name[i] > 0x7e {
			return "", errors.New("the name may hold letters, digits and punctuation, no spaces")
		}
	}
	return name, nil
}
