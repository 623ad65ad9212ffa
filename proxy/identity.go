package proxy

import (
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/stopgate/stopgate/runtoken"
	"github.com/stopgate/stopgate/state"
)

// Headers a worker uses to name its run; they never reach the upstream.
const (
	HeaderRunID      = "X-Run-ID"
	HeaderRunVersion = "X-Run-Version"
	HeaderRunToken   = "X-Run-Token"
	// HeaderBindTunnel: "1" on a CONNECT binds every request inside the
	// tunnel to the CONNECT's run, whatever identity those requests carry
	// (stopgate exec sets it for the connections it carries).
	HeaderBindTunnel = "X-Stopgate-Bind-Tunnel"
)

// keyRunID is HeaderRunID as net/http keys it (http.CanonicalHeaderKey):
// every request looks it up and strips it, and a name not in canonical
// form is canonicalized into a new string at each lookup. The other names
// are canonical as they are spelled.
const keyRunID = "X-Run-Id"

// identity is the run a request belongs to and the cancel_version its
// worker observed (0: none given).
type identity struct {
	run     string
	version int64
	via     string
	// bound: the listener itself names the run (ForRun), and nothing the
	// client sends can name another: a page script must not be able to
	// spend another run's effects.
	bound bool
}

var errNoIdentity = errors.New("no run identity: send X-Run-ID (and X-Run-Version), or proxy credentials RUN_ID:VERSION, or start the sidecar with --run")

// badCredentials is proxy credentials that cannot be read; the client gets
// 407 so that it knows to fix them, with a message saying what is wrong.
type badCredentials struct{ msg string }

func (e badCredentials) Error() string { return e.msg }

// tokenCheck is how the proxy treats signed run tokens: verified with
// signer when one is configured, and with require, the only accepted way
// for a client to name its run (a static or bound run excepted).
type tokenCheck struct {
	signer  *runtoken.Signer
	require bool
}

// verify checks a token and that it names run (when run is given).
func (tc tokenCheck) verify(token, run, via string) (identity, error) {
	if tc.signer == nil {
		return identity{}, badCredentials{"this proxy has no run-token secret: send the cancel version instead of a token"}
	}
	c, err := tc.signer.Verify(token, time.Now())
	if err != nil {
		return identity{}, badCredentials{err.Error()}
	}
	if run != "" && run != c.RunID {
		return identity{}, badCredentials{fmt.Sprintf("the run token is for run %s, not %s", c.RunID, run)}
	}
	return identity{run: c.RunID, version: c.Version, via: via}, nil
}

// unsigned refuses an identity without a token when tokens are required.
func (tc tokenCheck) unsigned(id identity) (identity, error) {
	if tc.require {
		return identity{}, badCredentials{"a signed run token is required: send it as the proxy password (RUN_ID:TOKEN) or in " + HeaderRunToken + " (stopgate token RUN)"}
	}
	return id, nil
}

// identify reads the run identity in the contract's order of precedence:
// headers, then proxy credentials, then the fallback (the CONNECT's identity
// inside a MITM tunnel, or the sidecar's static run) — except on a listener
// bound to a run, whose run is the only one its clients can name.
func identify(h http.Header, fallback *identity, tc tokenCheck) (identity, error) {
	if fallback != nil && fallback.bound {
		return *fallback, nil
	}
	// Each header that names the run is read once, by the key net/http
	// stores it under: every request reads all four, and Get or Values
	// would check the key's case and look it up again. Two values of one
	// are two answers to one question: refused, rather than letting the
	// first (or the last) win where a client and something in front of it
	// disagree.
	var values [4]string
	for i, k := range identityKeys() {
		switch vs := h[k]; len(vs) {
		case 0:
		case 1:
			values[i] = vs[0]
		default:
			if k == keyRunID {
				k = HeaderRunID // as the contract spells it
			}
			return identity{}, fmt.Errorf("%w: %d %s headers: send one", state.ErrInvalid, len(vs), k)
		}
	}
	run, version, tok, auth := values[0], values[1], values[2], values[3]
	if tok != "" {
		if version != "" {
			return identity{}, fmt.Errorf("%w: %s and %s together: the token carries the version", state.ErrInvalid, HeaderRunToken, HeaderRunVersion)
		}
		return tc.verify(tok, run, "token header")
	}
	if run != "" && auth != "" && tc.signer != nil {
		// A token as the proxy password next to X-Run-ID: the token is the
		// identity, and the header must name its run.
		if user, pass, err := basicCredentials(auth); err == nil && runtoken.IsToken(pass) {
			if version != "" {
				return identity{}, fmt.Errorf("%w: %s and a run token together: the token carries the version", state.ErrInvalid, HeaderRunVersion)
			}
			if user != run {
				return identity{}, badCredentials{fmt.Sprintf("%s names run %s, the proxy credentials run %s", HeaderRunID, run, user)}
			}
			return tc.verify(pass, run, "credentials token")
		}
	}
	if run != "" || version != "" {
		if run == "" {
			return identity{}, fmt.Errorf("%w: %s without %s", state.ErrInvalid, HeaderRunVersion, HeaderRunID)
		}
		if err := state.ValidateRunID(run); err != nil {
			return identity{}, fmt.Errorf("header %s: %w", HeaderRunID, err)
		}
		v, err := parseVersion(version)
		if err != nil {
			return identity{}, fmt.Errorf("header %s: %w", HeaderRunVersion, err)
		}
		return tc.unsigned(identity{run: run, version: v, via: "header"})
	}
	if auth != "" {
		return fromCredentials(auth, tc)
	}
	if fallback != nil {
		return *fallback, nil
	}
	return identity{}, errNoIdentity
}

// basicCredentials reads Basic user:password; the error, a badCredentials,
// says what else it is.
func basicCredentials(auth string) (user, pass string, err error) {
	scheme, encoded, found := strings.Cut(auth, " ")
	if !found || !strings.EqualFold(scheme, "Basic") {
		return "", "", badCredentials{"Proxy-Authorization must be Basic RUN_ID:VERSION"}
	}
	// Decoded on the stack, where a run id and a version fit: the one
	// string made of them holds both.
	var buf [128]byte
	raw, err := base64.StdEncoding.AppendDecode(buf[:0], []byte(strings.TrimSpace(encoded)))
	if err != nil {
		return "", "", badCredentials{"Proxy-Authorization is not valid base64"}
	}
	user, pass, _ = strings.Cut(string(raw), ":")
	return user, pass, nil
}

func fromCredentials(auth string, tc tokenCheck) (identity, error) {
	run, pass, err := basicCredentials(auth)
	if err != nil {
		return identity{}, err
	}
	if err := state.ValidateRunID(run); err != nil {
		return identity{}, badCredentials{"proxy credentials user (the run id): " + err.Error()}
	}
	if runtoken.IsToken(pass) {
		return tc.verify(pass, run, "credentials token")
	}
	v, err := parseVersion(pass)
	if err != nil {
		return identity{}, badCredentials{"proxy credentials password (the cancel version or a run token): " + err.Error()}
	}
	return tc.unsigned(identity{run: run, version: v, via: "credentials"})
}

func parseVersion(s string) (int64, error) {
	if s == "" {
		return 0, nil
	}
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil || v < 1 {
		return 0, fmt.Errorf("%w: cancel version %q is not a whole number of 1 or more", state.ErrInvalid, s)
	}
	return v, nil
}

// stripIdentity removes what names the run from a request bound upstream,
// by the keys net/http stores the headers under.
func stripIdentity(h http.Header) {
	for _, k := range identityKeys() {
		delete(h, k)
	}
	delete(h, "Proxy-Connection")
}

// identityKeys are the headers a client names its run with, in the order
// identify reads them, as net/http keys them (http.CanonicalHeaderKey):
// keyRunID for X-Run-ID, the others as they are spelled.
func identityKeys() [4]string {
	return [...]string{keyRunID, HeaderRunVersion, HeaderRunToken, "Proxy-Authorization"}
}
