package control

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/stopgate/stopgate/state"
)

// The request and response bodies of the API. The CLI's client decodes the
// same types, so a field renamed here is renamed for both sides at once.

// AdmitRequest is the body of POST /v1/runs.
type AdmitRequest struct {
	RunID  string `json:"run_id"`
	Reason string `json:"reason,omitempty"`
}

// CancelRequest is the body of POST /v1/runs/{run}/cancel. Every field is
// optional: an empty body cancels with the server's default drain.
type CancelRequest struct {
	Reason string `json:"reason,omitempty"`
	// DrainTimeout is how long in-flight work of the run may go on; nil
	// takes the server's default.
	DrainTimeout *Duration `json:"drain_timeout,omitempty"`
}

// CancelResponse is the answer to a cancel: the row as it stands, and
// whether this call moved it (false when it was already past ACTIVE).
type CancelResponse struct {
	Run     state.Run `json:"run"`
	Changed bool      `json:"changed"`
}

// CompleteRequest is the body of POST /v1/runs/{run}/complete.
type CompleteRequest struct {
	// CancelVersion is the version the caller observed; a run cancelled
	// since then is not completed (409 stale_version or run_not_active).
	CancelVersion int64  `json:"cancel_version"`
	Reason        string `json:"reason,omitempty"`
}

// RunList is the answer to GET /v1/runs.
type RunList struct {
	Runs []state.Run `json:"runs"`
}

// EventList is the answer to GET /v1/runs/{run}/events.
type EventList struct {
	Events []state.Event `json:"events"`
}

// IntentList is the answer to GET /v1/runs/{run}/intents.
type IntentList struct {
	Intents []state.Intent `json:"intents"`
}

// Audit is the answer to GET /v1/runs/{run}/audit, and what
// `stopgate audit RUN --json` prints.
type Audit struct {
	Run     state.Run      `json:"run"`
	Intents []state.Intent `json:"intents"`
	Events  []state.Event  `json:"events"`
}

// Error is the body of every answer that is not a success.
type Error struct {
	// Code is stable for programs: one of the Code* constants, or a
	// state.Conflict code (run_not_active, stale_version, ...).
	Code string `json:"error"`
	// Message says, for a person, what was wrong.
	Message string `json:"message"`
	// Run is the row that refused a transition (409 only).
	Run *state.Run `json:"run,omitempty"`
}

// Error codes besides the state.Conflict codes.
const (
	CodeInvalidJSON          = "invalid_json"           // 400: body is not JSON of the right shape
	CodeUnknownField         = "unknown_field"          // 400: body has a field the endpoint does not take
	CodeInvalidRequest       = "invalid_request"        // 400: a field, header, path or query value is not valid
	CodeUnauthorized         = "unauthorized"           // 401: bearer token missing or wrong
	CodeNotFound             = "not_found"              // 404: unknown run or endpoint
	CodeMethodNotAllowed     = "method_not_allowed"     // 405
	CodeBodyTooLarge         = "body_too_large"         // 413
	CodeUnsupportedMediaType = "unsupported_media_type" // 415
	CodeInternal             = "internal"               // 500: a bug; logged with its stack
	CodeStoreUnavailable     = "store_unavailable"      // 503: the store did not answer in time
)

// Duration is a drain timeout on the wire: a Go duration string ("30s",
// "1m30s") or a number of seconds (30, 0.5). It is written back as a string.
type Duration time.Duration

// UnmarshalJSON accepts both spellings, so a shell script can send 30 and a
// Go program can send "30s".
func (d *Duration) UnmarshalJSON(b []byte) error {
	s := strings.TrimSpace(string(b))
	if s == "null" {
		return nil
	}
	if strings.HasPrefix(s, `"`) {
		var str string
		if err := json.Unmarshal(b, &str); err != nil {
			return err
		}
		v, err := ParseDuration(str)
		if err != nil {
			return err
		}
		*d = Duration(v)
		return nil
	}
	secs, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return fmt.Errorf("drain_timeout: want a duration such as \"30s\" or a number of seconds, got %s", s)
	}
	v, err := secondsToDuration(secs)
	if err != nil {
		return err
	}
	*d = Duration(v)
	return nil
}

// MarshalJSON writes the duration as a Go duration string.
func (d Duration) MarshalJSON() ([]byte, error) {
	return json.Marshal(time.Duration(d).String())
}

// ParseDuration reads a drain timeout as a Go duration ("30s") or a bare
// number of seconds ("30"), the two forms the API and the CLI accept.
func ParseDuration(s string) (time.Duration, error) {
	s = strings.TrimSpace(s)
	if v, err := time.ParseDuration(s); err == nil {
		return v, nil
	}
	secs, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return 0, fmt.Errorf("drain_timeout: want a duration such as \"30s\" or a number of seconds, got %q", s)
	}
	return secondsToDuration(secs)
}

func secondsToDuration(secs float64) (time.Duration, error) {
	// Bound before converting: a float beyond int64 nanoseconds would wrap.
	const maxSecs = float64(1<<63-1) / float64(time.Second)
	if secs != secs || secs > maxSecs || secs < -maxSecs {
		return 0, fmt.Errorf("drain_timeout: %v seconds is out of range", secs)
	}
	return time.Duration(secs * float64(time.Second)), nil
}
