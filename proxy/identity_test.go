package proxy

import (
	"encoding/base64"
	"net/http"
	"testing"

	"github.com/stopgate/stopgate/state"
)

func TestIdentifyPrecedence(t *testing.T) {
	basic := func(s string) string { return "Basic " + base64.StdEncoding.EncodeToString([]byte(s)) }
	static := &identity{run: "static", via: "static"}
	for _, tc := range []struct {
		name     string
		header   http.Header
		fallback *identity
		want     identity
	}{
		{"headers win over credentials", http.Header{"X-Run-Id": {"h"}, "X-Run-Version": {"3"}, "Proxy-Authorization": {basic("c:1")}}, static, identity{run: "h", version: 3, via: "header"}},
		{"credentials win over the static run", http.Header{"Proxy-Authorization": {basic("c:2")}}, static, identity{run: "c", version: 2, via: "credentials"}},
		{"credentials without a version check ACTIVE alone", http.Header{"Proxy-Authorization": {basic("c:")}}, nil, identity{run: "c", version: 0, via: "credentials"}},
		{"user without a colon", http.Header{"Proxy-Authorization": {basic("c")}}, nil, identity{run: "c", version: 0, via: "credentials"}},
		{"the static run last", http.Header{}, static, identity{run: "static", version: 0, via: "static"}},
		{"a bound listener's run over everything", http.Header{"X-Run-Id": {"h"}, "Proxy-Authorization": {basic("c:1")}}, &identity{run: "b", via: "bound listener", bound: true}, identity{run: "b", via: "bound listener", bound: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := identify(tc.header, tc.fallback)
			if err != nil || got != tc.want {
				t.Fatalf("got %+v %v, want %+v", got, err, tc.want)
			}
		})
	}
}

// FuzzIdentify: whatever the headers, identify answers an identity with a
// valid run id or an error; it never panics.
func FuzzIdentify(f *testing.F) {
	for _, seed := range [][3]string{
		{"run_1", "1", ""}, {"", "", "Basic cjox"}, {"", "", "Basic !!"}, {"a b", "x", ""}, {"", "2", ""},
		{"", "", "Bearer t"}, {"", "", "Basic " + base64.StdEncoding.EncodeToString([]byte(":1"))},
	} {
		f.Add(seed[0], seed[1], seed[2])
	}
	f.Fuzz(func(t *testing.T, run, version, auth string) {
		h := http.Header{}
		if run != "" {
			h.Set("X-Run-Id", run)
		}
		if version != "" {
			h.Set("X-Run-Version", version)
		}
		if auth != "" {
			h.Set("Proxy-Authorization", auth)
		}
		id, err := identify(h, nil)
		if err != nil {
			return
		}
		if verr := state.ValidateRunID(id.run); verr != nil || id.version < 0 {
			t.Fatalf("identify accepted %+v: %v", id, verr)
		}
	})
}
