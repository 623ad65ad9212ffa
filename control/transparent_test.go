package control_test

import (
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/refusal"
)

func TestEndpointsSaysWhereToSendAnAgent(t *testing.T) {
	h, err := control.New(control.Options{Store: testkit.FileStore(t), Token: "tok", DrainTimeout: time.Second, Logger: slog.New(slog.DiscardHandler),
		Endpoints: control.Endpoints{Proxy: "127.0.0.1:8080", Transparent: "127.0.0.1:15001", RunTokens: control.RunTokensOff}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	auth := map[string]string{"Authorization": "Bearer tok"}
	if r := do(t, srv, http.MethodGet, "/v1/endpoints", "", nil); r.status != http.StatusUnauthorized {
		t.Fatalf("without the token: %d %s", r.status, r.body)
	}
	r := do(t, srv, http.MethodGet, "/v1/endpoints", "", auth)
	var got control.Endpoints
	r.json(t, &got)
	if r.status != http.StatusOK || got.Proxy != "127.0.0.1:8080" || got.Transparent != "127.0.0.1:15001" || got.RunTokens != "off" {
		t.Fatalf("%d %s", r.status, r.body)
	}
	// No binder: transparent mode is off, and says how to turn it on.
	for _, c := range []struct{ method, path, body string }{
		{http.MethodPost, "/v1/transparent/bindings", `{"uid":65534,"run_id":"r1"}`},
		{http.MethodPost, "/v1/transparent/bindings/abc/renew", ""},
		{http.MethodDelete, "/v1/transparent/bindings/abc", ""},
	} {
		r := do(t, srv, c.method, c.path, c.body, auth)
		var e refusal.Refusal
		r.json(t, &e)
		if r.status != http.StatusNotFound || e.Code != refusal.TransparentOff {
			t.Errorf("%s %s: %d %s", c.method, c.path, r.status, r.body)
		}
	}
}
