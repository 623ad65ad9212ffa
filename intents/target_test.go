package intents_test

import (
	"net/url"
	"testing"

	"github.com/stopgate/stopgate/intents"
)

// TestRecordedTargetLeavesOutCredentialsQueryAndFragment: the ledger keeps
// where a request went, never what its URL may carry as secrets, whether
// or not the caller has already written the URL out.
func TestRecordedTargetLeavesOutCredentialsQueryAndFragment(t *testing.T) {
	for _, tc := range []struct{ url, want string }{
		{"http://api.example/v1/chat", "http://api.example/v1/chat"},
		{"https://api.example:8443/a%20b/c", "https://api.example:8443/a%20b/c"},
		{"http://u:secret@api.example/v1", "http://api.example/v1"},
		{"http://api.example/v1?key=secret", "http://api.example/v1"},
		{"http://api.example/v1#frag", "http://api.example/v1"},
		{"http://u@api.example/v1?key=secret#frag", "http://api.example/v1"},
		{"http://api.example/v1?", "http://api.example/v1"},
		{"http://api.example/v1?a=1?b=2", "http://api.example/v1"},
		{"http://api.example/a%3Fb?c=d", "http://api.example/a%3Fb"},
		{"http://api.example/a%3Fb", "http://api.example/a%3Fb"},
		{"http://api.example?q=1", "http://api.example"},
		{"http://u@api.example/v1?key=secret", "http://api.example/v1"},
		{"http://api.example/v1?key=secret#", "http://api.example/v1"},
		{"http://[::1]:80/x", "http://[::1]:80/x"},
	} {
		u, err := url.Parse(tc.url)
		if err != nil {
			t.Fatal(err)
		}
		for _, whole := range []string{"", u.String()} {
			if got := intents.RecordedTarget(u, whole); got != tc.want {
				t.Errorf("RecordedTarget(%s, whole %q) = %s, want %s", tc.url, whole, got, tc.want)
			}
		}
	}
}
