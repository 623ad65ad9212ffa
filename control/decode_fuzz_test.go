package control

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"reflect"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stopgate/stopgate/refusal"
)

// bodies are the request bodies the API decodes, one fresh value each.
var bodies = []func() any{
	func() any { return new(AdmitRequest) },
	func() any { return new(CancelRequest) },
	func() any { return new(CompleteRequest) },
	func() any { return new(ClaimRequest) },
	func() any { return new(RetryRequest) },
	func() any { return new(DispatchRequest) },
	func() any { return new(IntentRequest) },
	func() any { return new(RenewRequest) },
	func() any { return new(OutcomeRequest) },
	func() any { return new(ResolveRequest) },
	func() any { return new(TokenRequest) },
	func() any { return new(BrowserRequest) },
}

// decodeRefusals are the only answers decode may give to a bad body.
var decodeRefusals = []refusal.Code{refusal.InvalidJSON, refusal.UnknownField, refusal.BodyTooLarge, refusal.UnsupportedMediaType}

func decodeBytes(body []byte, dst any) error {
	r := httptest.NewRequest(http.MethodPost, "/v1/runs", bytes.NewReader(body))
	r.Header.Set("Content-Type", "application/json")
	return decode(r, dst)
}

// FuzzDecode: whatever the bytes, decoding a request body of any endpoint
// either yields a value that survives a round trip through JSON unchanged,
// or is refused as the client's mistake (400, 413, 415) with a message that
// renders as valid JSON. Never a panic, never a 500.
func FuzzDecode(f *testing.F) {
	for i, seed := range []string{
		`{"run_id":"r1","reason":"start"}`,
		`{"reason":"operator pressed stop","drain_timeout":"45s"}`,
		`{"drain_timeout":1.5}`,
		`{"drain_timeout":9223372036.854775807}`,
		`{"drain_timeout":-9223372036.854775808}`,
		`{"drain_timeout":1e300}`,
		`{"drain_timeout":"-2562047h47m16.854775808s"}`,
		`{"cancel_version":1}`,
		`{"step_id":"s1","cancel_version":1,"worker":"w-7","lease_ttl":600}`,
		`{"step_id":"s1","attempt":2,"not_before":"2026-01-02T10:05:00Z"}`,
		`{"cancel_version":1,"worker":"w1","lease_ttl":"10m"}`,
		`{"key":"mail-1","boundary":"delivery","allow_cancelling":true,"lease_ttl":null}`,
		`{"worker":"w-7","lease_ttl":"1h"}`,
		`{"outcome":"responded","status_code":250,"attempt":1}`,
		`{"outcome":"not_applied","source":"operator","note":"none","run_id":"r1","key":"k"}`,
		`{"ttl":"24h"}`,
		`{"cancel_version":3}`,
		`{"run_id":"a"}{"run_id":"b"}`,
		`{"run_id":"\u0000\ud800"}`,
		`[]`, `null`, ``, ` `, `{`, `{"runid":"x"}`, `{"cancel_version":"1"}`, `{"attempt":1e400}`,
	} {
		f.Add(uint8(i), []byte(seed))
	}
	f.Fuzz(func(t *testing.T, which uint8, body []byte) {
		newBody := bodies[int(which)%len(bodies)]
		v := newBody()
		err := decodeBytes(body, v)
		if err != nil {
			rf := refusal.FromError(err)
			if !slices.Contains(decodeRefusals, rf.Code) {
				t.Fatalf("%T from %q: refusal %s (%d) %q, want one of %v", v, body, rf.Code, rf.Status(), rf.Message, decodeRefusals)
			}
			if rf.Message == "" {
				t.Fatalf("%T from %q: refusal %s without a message", v, body, rf.Code)
			}
			rec := httptest.NewRecorder()
			rf.WriteHTTP(rec)
			var back refusal.Refusal
			if !utf8.Valid(rec.Body.Bytes()) || json.Unmarshal(rec.Body.Bytes(), &back) != nil || back.Code != rf.Code {
				t.Fatalf("%T from %q: the refusal does not render as JSON: %q", v, body, rec.Body.Bytes())
			}
			return
		}
		// What was accepted means the same when the client library sends
		// it back: a field that marshals to something decode reads
		// differently would change a request between CLI and server.
		out, err := json.Marshal(v)
		if err != nil {
			t.Fatalf("%T from %q: decoded %+v does not marshal: %v", v, body, v, err)
		}
		again := newBody()
		if err := decodeBytes(out, again); err != nil {
			t.Fatalf("%T from %q: its own JSON %s is refused: %v", v, body, out, err)
		}
		if !reflect.DeepEqual(v, again) {
			t.Fatalf("%T from %q: round trip through %s changed %+v into %+v", v, body, out, v, again)
		}
	})
}

// TestDecodeRefusesDuplicateAndCaseVariantKeys: encoding/json keeps the
// last of two equal keys and fills a field from a key in any case, so
// {"run_id":"a","run_id":"b"} and {"RUN_ID":"b"} would be read as another
// request than a reader of the first key sees. Both are 400s naming the
// key, as the CDP guard refuses a member that appears twice.
func TestDecodeRefusesDuplicateAndCaseVariantKeys(t *testing.T) {
	for _, tc := range []struct {
		name, body string
		dst        func() any
		code       refusal.Code
		message    string
	}{
		{"the same key twice", `{"run_id":"a","run_id":"b"}`, func() any { return new(AdmitRequest) }, refusal.InvalidJSON, `key "run_id" appears twice`},
		{"a key in another case beside it", `{"reason":"x","Reason":"y"}`, func() any { return new(CancelRequest) }, refusal.InvalidJSON, `keys "reason" and "Reason" differ only in case`},
		{"a key in another case alone", `{"RUN_ID":"b"}`, func() any { return new(AdmitRequest) }, refusal.UnknownField, `did you mean "run_id"`},
		{"a duplicate inside a nested value", `{"outcome":"responded","attempt":1,"x":{"a":1,"a":2}}`, func() any { return new(OutcomeRequest) }, refusal.InvalidJSON, `key "x.a" appears twice`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := decodeBytes([]byte(tc.body), tc.dst())
			r := refusal.FromError(err)
			if r == nil || r.Code != tc.code || !strings.Contains(r.Message, tc.message) || r.Status() != http.StatusBadRequest {
				t.Fatalf("decode %s: %v, want %s (400) saying %q", tc.body, err, tc.code, tc.message)
			}
		})
	}
	var ok AdmitRequest
	if err := decodeBytes([]byte(`{"run_id":"r1","reason":"start"}`), &ok); err != nil || ok.RunID != "r1" {
		t.Fatalf("a plain body: %+v %v", ok, err)
	}
}
