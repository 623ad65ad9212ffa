package redirect_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/redirect"
)

// TestBindingOnTheWire: a binding reads back as it was written, its lease
// spelt as a Go duration, so the proxy's binding is the API's and the
// client's without a second type.
func TestBindingOnTheWire(t *testing.T) {
	b := redirect.Binding{ID: "ab12", UID: 61040, RunID: "r1", CancelVersion: 3, Port: 15001,
		Addrs: []string{"127.0.0.1:15001", "[::1]:15001"}, LeaseTTL: 30 * time.Second, ExpiresAt: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
	data, err := json.Marshal(b)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"lease_ttl":"30s"`, `"run_id":"r1"`, `"cancel_version":3`, `"expires_at":"2026-01-02T03:04:05Z"`} {
		if !strings.Contains(string(data), want) {
			t.Errorf("%s lacks %s", data, want)
		}
	}
	var back redirect.Binding
	if err := json.Unmarshal(data, &back); err != nil {
		t.Fatal(err)
	}
	if back.LeaseTTL != b.LeaseTTL || back.ID != b.ID || back.Port != b.Port || !back.ExpiresAt.Equal(b.ExpiresAt) || len(back.Addrs) != 2 {
		t.Errorf("read back %+v, want %+v", back, b)
	}
	if err := json.Unmarshal([]byte(`{"id":"x","lease_ttl":"soon"}`), &back); err == nil || !strings.Contains(err.Error(), "lease_ttl") {
		t.Errorf("a lease that is not a duration: %v", err)
	}
}
