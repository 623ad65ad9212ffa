package control

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"net/http"
	"strings"
	"time"

	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/runtoken"
)

// Who may do what on the control plane. A request proves who it is with a
// bearer token (or, on the operator console, a session cookie that a token
// opened); its Principal says what that proves, and each route says what it
// needs. The audit log records the Principal's name: a caller never picks it.

// Scope is what a control-plane credential may do.
type Scope string

const (
	// ScopeOperator may do everything: admit, cancel, complete, resolve,
	// mint run tokens, and all a worker and a reader may.
	ScopeOperator Scope = "operator"
	// ScopeWorker is bound to one run: it guards and reports that run's
	// effects (claims, retries, intents, outcomes, heartbeats, its browser)
	// and reads that run. It never cancels, completes, resolves, admits or
	// mints, and never touches another run. A worker's credential is the
	// signed run token the operator minted for its run.
	ScopeWorker Scope = "worker"
	// ScopeReadOnly reads every run (status, lists, intents, events,
	// audit) and changes nothing.
	ScopeReadOnly Scope = "read-only"
	// scopeWebhook is a provider's signed resolve; resolve checks the
	// signature itself (verifyWebhook).
	scopeWebhook Scope = "webhook"
)

// Principal is who a request is, as its credential proves it.
type Principal struct {
	Scope Scope
	// Run is the one run a worker is bound to.
	Run string
	// Claimed is the name an operator gave itself (X-Stopgate-Actor, the
	// CLI sends cli:$USER): recorded beside what the token proves, never
	// instead of it. Empty for workers and readers, whose header is ignored.
	Claimed string
	// Anonymous is a caller without a credential on a control plane served
	// with Options.Open: it may do what an operator may, and proves nothing.
	Anonymous bool
}

// AnonymousActor names a caller without a credential on an open control plane.
const AnonymousActor = "anonymous"

// Actor is the name the audit log records: operator, worker:RUN or
// read-only, then what an operator claimed in parentheses, e.g.
// "operator (cli:alice)".
func (p Principal) Actor() string {
	var base string
	switch {
	case p.Anonymous:
		base = AnonymousActor
	case p.Scope == ScopeWorker:
		base = "worker:" + p.Run
	default:
		base = string(p.Scope)
	}
	if p.Claimed != "" {
		return base + " (" + p.Claimed + ")"
	}
	return base
}

// access is what a route needs of the principal.
type access int

const (
	// accessRead: operators and readers; a worker for its own run only.
	accessRead access = iota
	// accessWork: operators; a worker for its own run only.
	accessWork
	// accessOperate: operators only.
	accessOperate
	// accessResolve: operators, or a provider's signed webhook.
	accessResolve
)

// allow says whether p may call a route that needs a, on run (the path's
// {run}; empty for a route that spans runs), and why not in words that
// say which credential would do.
func (p Principal) allow(a access, run, what string) error {
	switch p.Scope {
	case ScopeOperator:
		return nil
	case scopeWebhook:
		if a == accessResolve {
			return nil
		}
	case ScopeReadOnly:
		if a == accessRead {
			return nil
		}
		return refusal.New(refusal.Forbidden, "a read-only token may not %s: it reads runs and changes nothing; use the operator token", what)
	case ScopeWorker:
		if a == accessRead || a == accessWork {
			if run == p.Run {
				return nil
			}
			if run == "" {
				return refusal.New(refusal.Forbidden, "the worker token of run %s may not %s: it reads its own run only (/v1/runs/%s)", p.Run, what, p.Run)
			}
			return refusal.New(refusal.Forbidden, "the worker token of run %s may not %s of run %s: a worker acts for its own run only", p.Run, what, run)
		}
		return refusal.New(refusal.Forbidden, "the worker token of run %s may not %s: cancel, complete, resolve, admit and minting tokens need the operator token", p.Run, what)
	}
	return refusal.New(refusal.Forbidden, "%s may not %s", p.Actor(), what)
}

// workerOwner is who holds a lease a worker takes: the worker itself,
// whatever name it gives (a worker of run r1 naming "w-7" holds it as
// worker:r1/w-7), so that no worker can renew or report on a lease the
// egress proxy, or another run's worker, holds.
func (p Principal) workerOwner(name string) string {
	if name == "" {
		return p.Actor()
	}
	return p.Actor() + "/" + name
}

// carries reports whether a lease owner is this worker's (see workerOwner).
func (p Principal) carries(owner string) bool {
	a := p.Actor()
	return owner == a || strings.HasPrefix(owner, a+"/")
}

type principalKey struct{}

// principalOf is the principal ServeHTTP authenticated for r.
func principalOf(r *http.Request) Principal {
	p, _ := r.Context().Value(principalKey{}).(Principal)
	return p
}

// credentials are the secrets the handler checks bearer tokens against.
type credentials struct {
	open        bool
	operatorSum [sha256.Size]byte
	readSum     [sha256.Size]byte
	hasOperator bool
	hasRead     bool
	runTokens   *runtoken.Signer
}

func newCredentials(opts Options) (credentials, error) {
	c := credentials{open: opts.Open, runTokens: opts.Tokens}
	if opts.Token == "" && !opts.Open {
		return c, errors.New("control: no operator token (Options.Token); set Options.Open to serve the API without authentication")
	}
	if opts.ReadToken != "" && opts.ReadToken == opts.Token {
		return c, errors.New("control: the read-only token is the operator token; they must differ")
	}
	for _, t := range []string{opts.Token, opts.ReadToken} {
		if runtoken.IsToken(t) {
			return c, errors.New("control: an operator or read-only token may not look like a run token (sg1.…)")
		}
	}
	if opts.Token != "" {
		// Digests, so that the comparison takes the same time whatever
		// the length of the token presented.
		c.operatorSum, c.hasOperator = sha256.Sum256([]byte(opts.Token)), true
	}
	if opts.ReadToken != "" {
		c.readSum, c.hasRead = sha256.Sum256([]byte(opts.ReadToken)), true
	}
	return c, nil
}

// errNoCredential is a request that presented none.
var errNoCredential = errors.New("no credential")

// bearer reads the one bearer token of r; errNoCredential when there is none.
func bearer(r *http.Request) (string, error) {
	vals := r.Header.Values("Authorization")
	switch {
	case len(vals) == 0:
		return "", errNoCredential
	case len(vals) > 1:
		return "", refusal.New(refusal.Unauthorized, "more than one Authorization header; send one: Authorization: Bearer <token>")
	}
	scheme, token, ok := strings.Cut(vals[0], " ")
	token = strings.TrimSpace(token)
	if !ok || !strings.EqualFold(scheme, "Bearer") || token == "" {
		return "", refusal.New(refusal.Unauthorized, "the Authorization header is not a bearer token; send Authorization: Bearer <token>")
	}
	return token, nil
}

// check says who a token proves: the operator, a reader, or the worker of
// the run a signed run token names.
func (c credentials) check(token string, now time.Time) (Principal, error) {
	if runtoken.IsToken(token) {
		if c.runTokens == nil {
			return Principal{}, refusal.New(refusal.Unauthorized, "run tokens are not accepted here: this stopgate has no run-token secret")
		}
		claims, err := c.runTokens.Verify(token, now)
		if err != nil {
			// The reason (expired, bad signature) is the caller's own
			// token's; saying it helps and reveals nothing.
			return Principal{}, refusal.Wrap(err, refusal.Unauthorized, "the run token was refused: %v", err)
		}
		return Principal{Scope: ScopeWorker, Run: claims.RunID}, nil
	}
	sum := sha256.Sum256([]byte(token))
	// Both comparisons always run, so that the time of the answer does
	// not tell which tokens exist.
	isOperator := subtle.ConstantTimeCompare(sum[:], c.operatorSum[:]) == 1 && c.hasOperator
	isRead := subtle.ConstantTimeCompare(sum[:], c.readSum[:]) == 1 && c.hasRead
	switch {
	case isOperator:
		return Principal{Scope: ScopeOperator}, nil
	case isRead:
		return Principal{Scope: ScopeReadOnly}, nil
	}
	return Principal{}, refusal.New(refusal.Unauthorized, "wrong bearer token: send the operator token (stopgate serve writes it to DATA_DIR/%s on first start), a read-only token or a run token", OperatorTokenFile)
}

// authenticate says who r is: its bearer token, else (for the console)
// its session cookie, else anonymous on an open control plane.
func (h *Handler) authenticate(r *http.Request) (Principal, error) {
	token, err := bearer(r)
	if err == nil {
		return h.creds.check(token, time.Now())
	}
	if !errors.Is(err, errNoCredential) {
		return Principal{}, err
	}
	if h.creds.open {
		return Principal{Scope: ScopeOperator, Anonymous: true}, nil
	}
	return Principal{}, refusal.New(refusal.Unauthorized, "the control API needs a bearer token: send Authorization: Bearer <token> (the CLI reads DATA_DIR/%s, --token or STOPGATE_CONTROL_TOKEN)", OperatorTokenFile)
}

// withPrincipal is r carrying p, for the handlers that need more than
// the actor's name (whose lease a worker may touch).
func withPrincipal(r *http.Request, p Principal) *http.Request {
	return r.WithContext(context.WithValue(r.Context(), principalKey{}, p))
}
