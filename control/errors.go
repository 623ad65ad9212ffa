package control

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"

	"github.com/stopgate/stopgate/state"
)

// httpError is a refusal decided at the edge, before or instead of a store
// call: its status and code are final.
type httpError struct {
	status  int
	code    string
	message string
}

func (e *httpError) Error() string { return e.message }

// writeError maps err to its status and JSON body. A guard refusal is sent
// as its own body (Refusal). Store errors map by kind: ErrInvalid 400, ErrNotFound 404, *Conflict 409, ErrUnavailable and
// timeouts 503; anything else is a 500 with the error logged.
func (h *Handler) writeError(w http.ResponseWriter, r *http.Request, err error) {
	var refused *refusalError
	if errors.As(err, &refused) {
		writeJSON(w, refused.status, refused.body)
		return
	}
	status, body := h.errorBody(r, err)
	writeJSON(w, status, body)
}

func (h *Handler) errorBody(r *http.Request, err error) (int, Error) {
	var he *httpError
	var conflict *state.Conflict
	switch {
	case errors.As(err, &he):
		return he.status, Error{Code: he.code, Message: he.message}
	case errors.As(err, &conflict):
		run := normRun(conflict.Run)
		return http.StatusConflict, Error{Code: conflict.Code, Message: conflict.Error(), Run: &run}
	case errors.Is(err, state.ErrInvalid):
		return http.StatusBadRequest, Error{Code: CodeInvalidRequest, Message: err.Error()}
	case errors.Is(err, state.ErrNotFound):
		msg := err.Error()
		if id, key := r.PathValue("run"), r.PathValue("key"); key != "" {
			// Not every store tells a missing run from a missing intent.
			msg = fmt.Sprintf("run %s has no intent %s (or the run was never admitted)", id, key)
		} else if id != "" {
			msg = fmt.Sprintf("run %s not found: it was never admitted nor cancelled", id)
		}
		return http.StatusNotFound, Error{Code: CodeNotFound, Message: msg}
	case errors.Is(err, state.ErrUnavailable), errors.Is(err, context.DeadlineExceeded):
		h.log.Warn("control: store unavailable", "method", r.Method, "path", r.URL.Path, "err", err)
		return http.StatusServiceUnavailable, Error{Code: CodeStoreUnavailable, Message: "the store did not answer: " + err.Error()}
	case errors.Is(err, context.Canceled) && r.Context().Err() != nil:
		// The client went away; nobody reads this answer.
		return http.StatusServiceUnavailable, Error{Code: CodeStoreUnavailable, Message: "request cancelled by the client"}
	default:
		h.log.Error("control: unexpected error", "method", r.Method, "path", r.URL.Path, "err", err)
		return http.StatusInternalServerError, Error{Code: CodeInternal, Message: err.Error()}
	}
}

func writeJSON(w http.ResponseWriter, status int, body any) {
	var buf bytes.Buffer
	if err := json.NewEncoder(&buf).Encode(body); err != nil {
		// Every body here is a plain struct of this package or of state;
		// failing to encode one is a bug, reported without a second try.
		status = http.StatusInternalServerError
		buf.Reset()
		fmt.Fprintf(&buf, "{\"error\":%q,\"message\":%q}\n", CodeInternal, "encoding the answer failed: "+err.Error())
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	_, _ = w.Write(buf.Bytes())
}

// decode reads a JSON body into dst, strictly: one object, no unknown
// fields, at most MaxBodyBytes. An empty body leaves dst as it is, so that
// endpoints whose fields are all optional take no body at all.
func decode(r *http.Request, dst any) error {
	if r.ContentLength > MaxBodyBytes {
		return tooLarge()
	}
	if r.ContentLength != 0 {
		if err := checkContentType(r.Header.Get("Content-Type")); err != nil {
			return err
		}
	}
	// No ResponseWriter: the wrapped one could not tell the server to
	// close the connection anyway, and the 413 below says what happened.
	body := http.MaxBytesReader(nil, r.Body, MaxBodyBytes)
	dec := json.NewDecoder(body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(dst); err != nil {
		if errors.Is(err, io.EOF) {
			return nil
		}
		return decodeError(err)
	}
	// A second value after the object is as wrong as a syntax error: the
	// client meant something we would silently drop.
	var extra json.RawMessage
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		if err == nil {
			return &httpError{http.StatusBadRequest, CodeInvalidJSON, "invalid JSON: more than one value in the body; send one object"}
		}
		return decodeError(err)
	}
	return nil
}

func tooLarge() error {
	return &httpError{http.StatusRequestEntityTooLarge, CodeBodyTooLarge, fmt.Sprintf("request body is larger than %d bytes", MaxBodyBytes)}
}

// checkContentType accepts JSON (application/json or any +json type) and
// a missing Content-Type, which curl-less scripts often leave out.
func checkContentType(ct string) error {
	if ct == "" {
		return nil
	}
	mt, _, err := mime.ParseMediaType(ct)
	if err == nil && (mt == "application/json" || strings.HasSuffix(mt, "+json")) {
		return nil
	}
	return &httpError{http.StatusUnsupportedMediaType, CodeUnsupportedMediaType, fmt.Sprintf("Content-Type %q is not JSON; send application/json", ct)}
}

func decodeError(err error) error {
	var maxErr *http.MaxBytesError
	var syntaxErr *json.SyntaxError
	var typeErr *json.UnmarshalTypeError
	switch {
	case errors.As(err, &maxErr):
		return tooLarge()
	case errors.As(err, &syntaxErr):
		return &httpError{http.StatusBadRequest, CodeInvalidJSON, fmt.Sprintf("invalid JSON at byte %d: %v", syntaxErr.Offset, syntaxErr)}
	case errors.Is(err, io.ErrUnexpectedEOF):
		return &httpError{http.StatusBadRequest, CodeInvalidJSON, "invalid JSON: the body ends in the middle of a value"}
	case errors.As(err, &typeErr):
		if typeErr.Field == "" {
			return &httpError{http.StatusBadRequest, CodeInvalidJSON, fmt.Sprintf("invalid JSON: want an object, got %s", typeErr.Value)}
		}
		return &httpError{http.StatusBadRequest, CodeInvalidJSON, fmt.Sprintf("field %s: want %s, got %s", typeErr.Field, jsonKind(typeErr.Type.Kind().String()), typeErr.Value)}
	}
	msg := err.Error()
	// encoding/json reports unknown fields only by message.
	if field, ok := strings.CutPrefix(msg, "json: unknown field "); ok {
		return &httpError{http.StatusBadRequest, CodeUnknownField, "unknown field " + field}
	}
	// Errors of a field's own UnmarshalJSON (drain_timeout) name the field.
	return &httpError{http.StatusBadRequest, CodeInvalidJSON, strings.TrimPrefix(msg, "json: ")}
}

func jsonKind(goKind string) string {
	switch {
	case strings.HasPrefix(goKind, "int"), strings.HasPrefix(goKind, "uint"), strings.HasPrefix(goKind, "float"):
		return "a number"
	case goKind == "string":
		return "a string"
	case goKind == "bool":
		return "true or false"
	case goKind == "struct", goKind == "map":
		return "an object"
	case goKind == "slice":
		return "an array"
	}
	return goKind
}
