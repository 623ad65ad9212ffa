package proxy

import (
	"net/http"
	"net/url"
	"testing"

	"github.com/stopgate/stopgate/refusal"
)

// TestIntentHeaderIsKeyedAsNetHTTPStoresIt: an answer's intent header is
// set in its header map directly, which replaces an upstream's header of
// that name only under the key net/http stores it by.
func TestIntentHeaderIsKeyedAsNetHTTPStoresIt(t *testing.T) {
	if got := http.CanonicalHeaderKey(refusal.IntentHeader); got != refusal.IntentHeader {
		t.Fatalf("net/http keys %s as %q: an upstream's header of that name would reach the agent beside stopgate's", refusal.IntentHeader, got)
	}
}

// TestCanonicalAddrIsWhatTheTransportDials: a request's destination is
// checked as host:port the way Go's transport writes the address it dials,
// whether or not the URL spells its port, and however it brackets its host.
func TestCanonicalAddrIsWhatTheTransportDials(t *testing.T) {
	for _, tc := range []struct{ url, want string }{
		{"http://api.example/v1", "api.example:80"},
		{"https://api.example/v1", "api.example:443"},
		{"wss://api.example/v1", "api.example:443"},
		{"http://api.example:8080/v1", "api.example:8080"},
		{"http://API.example:8080/v1", "API.example:8080"},
		{"http://127.0.0.1:9/", "127.0.0.1:9"},
		{"http://[::1]:8080/", "[::1]:8080"},
		{"https://[::1]/", "[::1]:443"},
		{"http://[fe80::1%25eth0]:80/", "[fe80::1%eth0]:80"},
		{"http://api.example:/v1", "api.example:80"},
	} {
		u, err := url.Parse(tc.url)
		if err != nil {
			t.Fatal(err)
		}
		if got := canonicalAddr(u); got != tc.want {
			t.Errorf("canonicalAddr(%s) = %s, want %s", tc.url, got, tc.want)
		}
	}
}
