// Package client calls the control API (package control) over HTTP for the
// stopgate CLI and for programs that drive runs. Each call returns the
// decoded value and the API's JSON byte for byte, so a caller can print
// exactly what the server said; a non-2xx answer is an *APIError carrying
// the server's code and message.
package client

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
)

// DefaultTimeout bounds one call when Options.HTTPClient is nil.
const DefaultTimeout = 30 * time.Second

// maxReplyBytes bounds what the client reads of one answer; an audit of a
// very busy run is the largest thing the API sends.
const maxReplyBytes = 64 << 20

// Options configure a Client.
type Options struct {
	// Token is sent as Authorization: Bearer when set: the operator's,
	// the read-only one, or a worker's run token.
	Token string
	// Actor is sent as X-Stopgate-Actor: with the operator token the audit
	// log records it beside the token's scope ("operator (cli:alice)");
	// with another token the server ignores it.
	Actor string
	// HTTPClient carries the calls; nil uses one with DefaultTimeout.
	HTTPClient *http.Client
}

// Client calls one control API.
type Client struct {
	base  *url.URL
	token string
	actor string
	hc    *http.Client
	// long carries the calls that outlive hc's timeout (a watch stream, a
	// long poll): hc's transport, bounded by their own contexts instead.
	long *http.Client
}

// New checks baseURL (http or https, with a host) and returns a client.
func New(baseURL string, opts Options) (*Client, error) {
	u, err := url.Parse(baseURL)
	if err != nil {
		return nil, fmt.Errorf("control URL %q: %w", baseURL, err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return nil, fmt.Errorf("control URL %q: want http:// or https://", baseURL)
	}
	if u.Host == "" {
		return nil, fmt.Errorf("control URL %q has no host", baseURL)
	}
	if u.RawQuery != "" || u.Fragment != "" {
		return nil, fmt.Errorf("control URL %q: want no query or fragment", baseURL)
	}
	u.Path = strings.TrimSuffix(u.Path, "/")
	hc := opts.HTTPClient
	if hc == nil {
		hc = &http.Client{Timeout: DefaultTimeout}
	}
	long := &http.Client{Transport: hc.Transport, CheckRedirect: hc.CheckRedirect, Jar: hc.Jar}
	return &Client{base: u, token: opts.Token, actor: opts.Actor, hc: hc, long: long}, nil
}

// Reply is a decoded answer with the bytes it came from.
type Reply[T any] struct {
	Value T
	// StatusCode tells apart, for an admit, 201 (created) from 200 (was
	// already ACTIVE).
	StatusCode int
	// Body is the API's JSON as sent.
	Body json.RawMessage
}

// APIError is an answer that is not a success: the status, and the
// refusal the API sent (the same body every stopgate edge sends).
type APIError struct {
	StatusCode int
	refusal.Refusal
}

// Error leads with the refusal's code, as the API's own messages do, so a
// program's log and a person both see the reason and the words.
func (e *APIError) Error() string {
	if e.Code == "" {
		return e.Message
	}
	return string(e.Code) + ": " + e.Message
}

// Admit creates the run ACTIVE at version 1, or returns it if it already
// is ACTIVE (StatusCode 200 rather than 201).
func (c *Client) Admit(ctx context.Context, runID string) (Reply[state.Run], error) {
	return call[state.Run](ctx, c, http.MethodPost, "/v1/runs", nil, control.AdmitRequest{RunID: runID})
}

// CancelOptions are the optional parts of a cancel.
type CancelOptions struct {
	Reason string
	// Drain, when set, overrides the server's default drain timeout.
	Drain *time.Duration
}

// Cancel moves the run to CANCELLING (or writes a tombstone for an unseen
// run); Value.Changed is false when it was already past ACTIVE.
func (c *Client) Cancel(ctx context.Context, runID string, opts CancelOptions) (Reply[control.CancelResponse], error) {
	body := control.CancelRequest{Reason: opts.Reason}
	if opts.Drain != nil {
		d := control.Duration(*opts.Drain)
		body.DrainTimeout = &d
	}
	return call[control.CancelResponse](ctx, c, http.MethodPost, runPath(runID, "cancel"), nil, body)
}

// Complete moves the run ACTIVE → COMPLETED if it is still at version.
func (c *Client) Complete(ctx context.Context, runID string, version int64, reason string) (Reply[state.Run], error) {
	return call[state.Run](ctx, c, http.MethodPost, runPath(runID, "complete"), nil, control.CompleteRequest{CancelVersion: version, Reason: reason})
}

// Run reads one row.
func (c *Client) Run(ctx context.Context, runID string) (Reply[state.Run], error) {
	return call[state.Run](ctx, c, http.MethodGet, runPath(runID, ""), nil, nil)
}

// Runs lists rows, all of them when status is empty.
func (c *Client) Runs(ctx context.Context, status state.Status) (Reply[control.RunList], error) {
	return c.RunsWhere(ctx, control.RunQuery{Status: status})
}

// RunsWhere lists the runs q matches, in q's order.
func (c *Client) RunsWhere(ctx context.Context, q control.RunQuery) (Reply[control.RunList], error) {
	return call[control.RunList](ctx, c, http.MethodGet, "/v1/runs", q.Values(), nil)
}

// Intents lists the run's intents in creation order.
func (c *Client) Intents(ctx context.Context, runID string) (Reply[control.IntentList], error) {
	return call[control.IntentList](ctx, c, http.MethodGet, runPath(runID, "intents"), nil, nil)
}

// Events lists the run's audit log.
func (c *Client) Events(ctx context.Context, runID string) (Reply[control.EventList], error) {
	return call[control.EventList](ctx, c, http.MethodGet, runPath(runID, "events"), nil, nil)
}

// Audit reads the row, its intents and its events.
func (c *Client) Audit(ctx context.Context, runID string) (Reply[control.Audit], error) {
	return call[control.Audit](ctx, c, http.MethodGet, runPath(runID, "audit"), nil, nil)
}

// Claim takes a queued step for a worker through the guard (POST
// /v1/runs/RUN/claims). A refusal is an *APIError: 409 run_not_active or
// stale_version when the run moved on (the refusal is recorded), 409
// intent_in_progress when the step is already claimed.
func (c *Client) Claim(ctx context.Context, runID string, req control.ClaimRequest) (Reply[control.GuardResponse], error) {
	return call[control.GuardResponse](ctx, c, http.MethodPost, runPath(runID, "claims"), nil, req)
}

// Token asks for a signed run token (POST /v1/runs/RUN/tokens).
func (c *Client) Token(ctx context.Context, runID string, req control.TokenRequest) (Reply[control.TokenResponse], error) {
	return call[control.TokenResponse](ctx, c, http.MethodPost, runPath(runID, "tokens"), nil, req)
}

// Retry schedules one attempt of a step (POST /v1/runs/RUN/retries); a
// cancel revokes it while it waits.
func (c *Client) Retry(ctx context.Context, runID string, req control.RetryRequest) (Reply[control.GuardResponse], error) {
	return call[control.GuardResponse](ctx, c, http.MethodPost, runPath(runID, "retries"), nil, req)
}

// DispatchRetry runs a scheduled retry when its time has come (POST
// /v1/runs/RUN/retries/STEP/ATTEMPT/dispatch): 201 with it IN_FLIGHT, leased
// to the worker; an *APIError 409 once the cancel revoked it.
func (c *Client) DispatchRetry(ctx context.Context, runID, step string, attempt int, req control.DispatchRequest) (Reply[control.GuardResponse], error) {
	path := runPath(runID, "retries/"+url.PathEscape(step)+"/"+strconv.Itoa(attempt)+"/dispatch")
	return call[control.GuardResponse](ctx, c, http.MethodPost, path, nil, req)
}

// Renew is a worker's heartbeat on an effect it carries (POST
// /v1/runs/RUN/intents/KEY/renew): the lease extended, and the run's row,
// which says whether the run was cancelled meanwhile. An *APIError 409
// intent_not_in_flight says the lease is no longer the worker's: stop, and
// do not report success.
func (c *Client) Renew(ctx context.Context, runID, key string, req control.RenewRequest) (Reply[control.RenewResponse], error) {
	return call[control.RenewResponse](ctx, c, http.MethodPost, intentPath(runID, key, "renew"), nil, req)
}

// Begin runs the guard for an effect the caller carries itself (POST
// /v1/runs/RUN/intents); report what happened with Finish.
func (c *Client) Begin(ctx context.Context, runID string, req control.IntentRequest) (Reply[control.GuardResponse], error) {
	return call[control.GuardResponse](ctx, c, http.MethodPost, runPath(runID, "intents"), nil, req)
}

// Finish reports the outcome of an IN_FLIGHT intent (PATCH
// /v1/runs/RUN/intents/KEY).
func (c *Client) Finish(ctx context.Context, runID, key string, req control.OutcomeRequest) (Reply[state.Intent], error) {
	return call[state.Intent](ctx, c, http.MethodPatch, intentPath(runID, key, ""), nil, req)
}

// Note appends one event about an intent the caller carries to the run's
// audit (POST /v1/runs/{run}/intents/{key}/notes).
func (c *Client) Note(ctx context.Context, runID, key string, req control.NoteRequest) error {
	_, err := call[json.RawMessage](ctx, c, http.MethodPost, intentPath(runID, key, "/notes"), nil, req)
	return err
}

// Intent reads one intent.
func (c *Client) Intent(ctx context.Context, runID, key string) (Reply[state.Intent], error) {
	return call[state.Intent](ctx, c, http.MethodGet, intentPath(runID, key, ""), nil, nil)
}

// Resolve records what reconciliation found out about an UNKNOWN intent,
// as an operator (the client's token and actor).
func (c *Client) Resolve(ctx context.Context, runID, key string, req control.ResolveRequest) (Reply[state.Intent], error) {
	return call[state.Intent](ctx, c, http.MethodPost, intentPath(runID, key, "resolve"), nil, req)
}

// WaitSettled reads the run's row every poll until it is no longer
// CANCELLING (the sweeper moved it to CANCELLED or UNKNOWN) or ctx ends,
// and returns the last row read. Failures that may pass — the server or
// its store restarting — are read through until then.
func (c *Client) WaitSettled(ctx context.Context, runID string, poll time.Duration) (Reply[state.Run], error) {
	var last Reply[state.Run]
	var lastErr error
	for {
		r, err := c.Run(ctx, runID)
		switch {
		case err == nil:
			last, lastErr = r, nil
			if r.Value.Status != state.StatusCancelling {
				return last, nil
			}
		case ctx.Err() == nil && !retryable(err):
			return last, err
		default:
			lastErr = err
		}
		select {
		case <-ctx.Done():
			if last.Body == nil {
				return last, fmt.Errorf("reading %s while waiting: %w", runID, cmp.Or(lastErr, ctx.Err()))
			}
			return last, nil
		case <-time.After(poll):
		}
	}
}

// retryable reports whether a failed call may succeed when tried again.
func retryable(err error) bool {
	var ae *APIError
	if errors.As(err, &ae) {
		return ae.StatusCode == http.StatusServiceUnavailable || ae.StatusCode == http.StatusBadGateway || ae.StatusCode == http.StatusGatewayTimeout
	}
	return true // the connection failed: the server may be restarting
}

// CA returns the egress proxy's MITM CA certificate, PEM, byte for byte.
func (c *Client) CA(ctx context.Context) ([]byte, error) {
	pem, _, err := c.do(ctx, http.MethodGet, "/v1/ca", nil, nil)
	return pem, err
}

// intentPath escapes the key as one segment: keys may hold "/", "?" or "#".
func intentPath(runID, key, tail string) string {
	p := runPath(runID, "intents/"+url.PathEscape(key))
	if tail != "" {
		p += "/" + tail
	}
	return p
}

func runPath(runID, tail string) string {
	p := "/v1/runs/" + url.PathEscape(runID)
	if tail != "" {
		p += "/" + tail
	}
	return p
}

func call[T any](ctx context.Context, c *Client, method, path string, query url.Values, body any) (Reply[T], error) {
	var reply Reply[T]
	raw, status, err := c.do(ctx, method, path, query, body)
	if err != nil {
		return reply, err
	}
	reply.StatusCode, reply.Body = status, bytes.TrimSpace(raw)
	if err := json.Unmarshal(raw, &reply.Value); err != nil {
		return reply, fmt.Errorf("%s %s: answer %d is not the expected JSON: %w", method, path, status, err)
	}
	return reply, nil
}

// do sends one request and returns a 2xx body as sent, or an error:
// *APIError for an answer, a wrapped transport error otherwise.
func (c *Client) do(ctx context.Context, method, path string, query url.Values, body any) (json.RawMessage, int, error) {
	return c.doWith(ctx, c.hc, method, path, query, body)
}

// doWith is do through hc.
func (c *Client) doWith(ctx context.Context, hc *http.Client, method, path string, query url.Values, body any) (json.RawMessage, int, error) {
	req, err := c.request(ctx, method, path, query, body)
	if err != nil {
		return nil, 0, err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, 0, fmt.Errorf("cannot reach the control API at %s: %w", c.base.Redacted(), unwrapURLError(err))
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, maxReplyBytes+1))
	if err != nil {
		return nil, resp.StatusCode, fmt.Errorf("%s %s: reading the answer: %w", method, path, err)
	}
	if len(raw) > maxReplyBytes {
		return nil, resp.StatusCode, fmt.Errorf("%s %s: answer is larger than %d bytes", method, path, maxReplyBytes)
	}
	if resp.StatusCode/100 == 2 {
		return raw, resp.StatusCode, nil
	}
	return nil, resp.StatusCode, apiError(resp, raw)
}

// request builds one request of the API, with the client's credentials.
func (c *Client) request(ctx context.Context, method, path string, query url.Values, body any) (*http.Request, error) {
	// path is already escaped (runPath), and the base has no query, so
	// joining strings keeps a run id's escapes as they are.
	target := c.base.String() + path
	if len(query) > 0 {
		target += "?" + query.Encode()
	}
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return nil, fmt.Errorf("encode %s %s: %w", method, path, err)
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, target, rd)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", method, path, err)
	}
	req.Header.Set("Accept", "application/json")
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	if c.actor != "" {
		req.Header.Set(control.ActorHeader, c.actor)
	}
	return req, nil
}

func apiError(resp *http.Response, raw []byte) error {
	var body refusal.Refusal
	if err := json.Unmarshal(raw, &body); err == nil && body.Code != "" {
		return &APIError{StatusCode: resp.StatusCode, Refusal: body}
	}
	// Not the API's JSON: something else answered (a proxy, another server
	// on the port). Say what, with the start of the body.
	snippet := strings.TrimSpace(string(raw))
	if len(snippet) > 200 {
		snippet = snippet[:200] + "..."
	}
	msg := fmt.Sprintf("control API answered %s", resp.Status)
	if snippet != "" {
		msg += ": " + snippet
	}
	return &APIError{StatusCode: resp.StatusCode, Refusal: refusal.Refusal{Message: msg}}
}

// unwrapURLError drops *url.Error's "Post \"http://...\":" prefix, which
// repeats what the caller's message already says.
func unwrapURLError(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err
	}
	return err
}
