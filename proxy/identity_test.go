package proxy

import (
	"encoding/base64"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/runtoken"
	"github.com/stopgate/stopgate/state"
)

// TestIdentityKeysAreTheOnesNetHTTPStores: the headers that name a run are
// read and stripped by their keys in the header map, which are net/http's
// own spelling of them; any other spelling would never see them.
func TestIdentityKeysAreTheOnesNetHTTPStores(t *testing.T) {
	if got := http.CanonicalHeaderKey(HeaderRunID); got != keyRunID {
		t.Fatalf("net/http keys %s as %q; keyRunID is %q, so the proxy would not see the header", HeaderRunID, got, keyRunID)
	}
	keys := identityKeys()
	for _, k := range append(keys[:], "Proxy-Connection") {
		if got := http.CanonicalHeaderKey(k); got != k {
			t.Errorf("net/http keys %s as %q, so the proxy would neither read nor strip it", k, got)
		}
	}
}

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
			got, err := identify(tc.header, tc.fallback, tokenCheck{})
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
		id, err := identify(h, nil, tokenCheck{})
		if err != nil {
			return
		}
		if verr := state.ValidateRunID(id.run); verr != nil || id.version < 0 {
			t.Fatalf("identify accepted %+v: %v", id, verr)
		}
	})
}

func TestRunTokens(t *testing.T) {
	signer, err := runtoken.New([]byte("0123456789abcdef0123456789abcdef"))
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	tok := signer.Sign("r1", 1, now.Add(time.Hour))
	expired := signer.Sign("r1", 1, now.Add(-time.Second))
	basic := func(s string) string { return "Basic " + base64.StdEncoding.EncodeToString([]byte(s)) }
	optional := tokenCheck{signer: signer}
	required := tokenCheck{signer: signer, require: true}
	static := &identity{run: "static", via: "static"}
	for _, tc := range []struct {
		name     string
		header   http.Header
		fallback *identity
		check    tokenCheck
		want     identity
		wantErr  string
	}{
		{"token as the proxy password", http.Header{"Proxy-Authorization": {basic("r1:" + tok)}}, nil, optional, identity{run: "r1", version: 1, via: "credentials token"}, ""},
		{"token in X-Run-Token", http.Header{"X-Run-Token": {tok}}, nil, required, identity{run: "r1", version: 1, via: "token header"}, ""},
		{"token with its own run id", http.Header{"X-Run-Id": {"r1"}, "X-Run-Token": {tok}}, nil, required, identity{run: "r1", version: 1, via: "token header"}, ""},
		{"token for another run (credentials)", http.Header{"Proxy-Authorization": {basic("r2:" + tok)}}, nil, optional, identity{}, "the run token is for run r1, not r2"},
		{"token for another run (headers)", http.Header{"X-Run-Id": {"r2"}, "X-Run-Token": {tok}}, nil, optional, identity{}, "the run token is for run r1, not r2"},
		{"token and version together", http.Header{"X-Run-Token": {tok}, "X-Run-Version": {"1"}}, nil, optional, identity{}, "the token carries the version"},
		{"expired token", http.Header{"Proxy-Authorization": {basic("r1:" + expired)}}, nil, optional, identity{}, "expired"},
		{"forged token", http.Header{"Proxy-Authorization": {basic("r1:" + tok[:len(tok)-2] + "xx")}}, nil, optional, identity{}, "signature does not match"},
		{"a token without a secret", http.Header{"Proxy-Authorization": {basic("r1:" + tok)}}, nil, tokenCheck{}, identity{}, "no run-token secret"},
		{"required: a version is not enough", http.Header{"Proxy-Authorization": {basic("r1:1")}}, nil, required, identity{}, "a signed run token is required"},
		{"required: headers without a token", http.Header{"X-Run-Id": {"r1"}}, nil, required, identity{}, "a signed run token is required"},
		{"required: the static run still binds", http.Header{}, static, required, *static, ""},
		{"optional: a version still works", http.Header{"Proxy-Authorization": {basic("r1:1")}}, nil, optional, identity{run: "r1", version: 1, via: "credentials"}, ""},
		{"required: a token password with its own X-Run-ID", http.Header{"Proxy-Authorization": {basic("r1:" + tok)}, "X-Run-Id": {"r1"}}, nil, required, identity{run: "r1", version: 1, via: "credentials token"}, ""},
		{"a token password with another X-Run-ID", http.Header{"Proxy-Authorization": {basic("r1:" + tok)}, "X-Run-Id": {"r2"}}, nil, optional, identity{}, "X-Run-ID names run r2, the proxy credentials run r1"},
		{"a token password with X-Run-Version", http.Header{"Proxy-Authorization": {basic("r1:" + tok)}, "X-Run-Id": {"r1"}, "X-Run-Version": {"1"}}, nil, optional, identity{}, "the token carries the version"},
		{"two X-Run-Token", http.Header{"X-Run-Token": {tok, tok}}, nil, optional, identity{}, "2 X-Run-Token headers"},
		{"two X-Run-ID", http.Header{"X-Run-Id": {"r1", "r2"}}, nil, optional, identity{}, "2 X-Run-ID headers"},
		{"two X-Run-Version", http.Header{"X-Run-Id": {"r1"}, "X-Run-Version": {"1", "1"}}, nil, optional, identity{}, "2 X-Run-Version headers"},
		{"two Proxy-Authorization", http.Header{"Proxy-Authorization": {basic("r1:1"), basic("r2:1")}}, nil, optional, identity{}, "2 Proxy-Authorization headers"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := identify(tc.header, tc.fallback, tc.check)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("got %+v %v, want an error saying %q", got, err, tc.wantErr)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("got %+v %v, want %+v", got, err, tc.want)
			}
		})
	}
}
