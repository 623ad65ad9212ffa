package control

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"mime"
	"net/http"
	"reflect"
	"strings"

	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
)

// writeError answers err as the refusal it stands for (package refusal
// decides the code and the status). A store that did not answer is logged
// as a warning, a bug (500) with the error; a missing run or intent gets a
// message naming what the path asked for.
func (h *Handler) writeError(w http.ResponseWriter, r *http.Request, err error) {
	rf := refusal.FromError(err)
	switch rf.Code {
	case refusal.NotFound:
		if errors.Is(err, state.ErrNotFound) {
			rf = h.notFound(r, err)
		}
	case refusal.StoreUnavailable:
		h.log.Warn("control: store unavailable", "method", r.Method, "path", r.URL.Path, "err", err)
	case refusal.Internal:
		h.log.Error("control: unexpected error", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	rf.WriteHTTP(w)
}

func (h *Handler) notFound(r *http.Request, err error) *refusal.Refusal {
	// Not every store tells a missing run from a missing intent.
	if id, key := r.PathValue("run"), r.PathValue("key"); key != "" {
		return refusal.Wrap(err, refusal.NotFound, "run %s has no intent %s (or the run was never admitted)", id, key)
	} else if id != "" {
		return refusal.Wrap(err, refusal.NotFound, "run %s not found: it was never admitted nor cancelled", id)
	}
	return refusal.Wrap(err, refusal.NotFound, "%v", err)
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
	data, err := io.ReadAll(http.MaxBytesReader(nil, r.Body, MaxBodyBytes))
	if err != nil {
		return decodeError(err)
	}
	if err := checkKeys(data, reflect.TypeOf(dst)); err != nil {
		return err
	}
	dec := json.NewDecoder(bytes.NewReader(data))
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
			return refusal.New(refusal.InvalidJSON, "invalid JSON: more than one value in the body; send one object")
		}
		return decodeError(err)
	}
	return nil
}

func tooLarge() error {
	return refusal.New(refusal.BodyTooLarge, "request body is larger than %d bytes", MaxBodyBytes)
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
	return refusal.New(refusal.UnsupportedMediaType, "Content-Type %q is not JSON; send application/json", ct)
}

func decodeError(err error) error {
	var maxErr *http.MaxBytesError
	var syntaxErr *json.SyntaxError
	var typeErr *json.UnmarshalTypeError
	switch {
	case errors.As(err, &maxErr):
		return tooLarge()
	case errors.As(err, &syntaxErr):
		return refusal.New(refusal.InvalidJSON, "invalid JSON at byte %d: %v", syntaxErr.Offset, syntaxErr)
	case errors.Is(err, io.ErrUnexpectedEOF):
		return refusal.New(refusal.InvalidJSON, "invalid JSON: the body ends in the middle of a value")
	case errors.As(err, &typeErr):
		if typeErr.Field == "" {
			return refusal.New(refusal.InvalidJSON, "invalid JSON: want an object, got %s", typeErr.Value)
		}
		return refusal.New(refusal.InvalidJSON, "field %s: want %s, got %s", typeErr.Field, jsonKind(typeErr.Type.Kind().String()), typeErr.Value)
	}
	msg := err.Error()
	// encoding/json reports unknown fields only by message.
	if field, ok := strings.CutPrefix(msg, "json: unknown field "); ok {
		return refusal.New(refusal.UnknownField, "%s", "unknown field "+field)
	}
	// Errors of a field's own UnmarshalJSON (drain_timeout) name the field.
	return refusal.New(refusal.InvalidJSON, "%s", strings.TrimPrefix(msg, "json: "))
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
