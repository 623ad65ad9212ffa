package client_test

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/control/client"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/filestore"
)

// operatorToken is the operator token of the API these tests serve.
const operatorToken = "sgop_client-test"

// api serves the real control API on the embedded store, under prefix (as
// behind a reverse proxy) when prefix is not empty.
func api(t *testing.T, prefix string) string {
	t.Helper()
	store, err := filestore.Open(filepath.Join(t.TempDir(), "stopgate.db"), filestore.Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = store.Close() })
	h, err := control.New(control.Options{Store: store, Token: operatorToken, DrainTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	var handler http.Handler = h
	if prefix != "" {
		handler = http.StripPrefix(prefix, h)
	}
	srv := httptest.NewServer(handler)
	t.Cleanup(srv.Close)
	return srv.URL + prefix
}

func TestCalls(t *testing.T) {
	ctx := context.Background()
	c, err := client.New(api(t, "/stopgate")+"/", client.Options{Token: operatorToken, Actor: "cli:test"})
	if err != nil {
		t.Fatal(err)
	}
	r, err := c.Admit(ctx, "r1")
	if err != nil || r.StatusCode != http.StatusCreated || r.Value.Status != state.StatusActive {
		t.Fatalf("admit: %+v %v", r, err)
	}
	var raw map[string]any
	if err := json.Unmarshal(r.Body, &raw); err != nil || raw["run_id"] != "r1" {
		t.Fatalf("Body is not the API's row: %s", r.Body)
	}
	if r, err = c.Admit(ctx, "r1"); err != nil || r.StatusCode != http.StatusOK {
		t.Fatalf("second admit: %+v %v", r, err)
	}
	drain := 5 * time.Second
	cr, err := c.Cancel(ctx, "r1", client.CancelOptions{Reason: "test", Drain: &drain})
	if err != nil || !cr.Value.Changed || cr.Value.Run.DrainDeadline.Sub(cr.Value.Run.CancelledAt) != drain {
		t.Fatalf("cancel: %+v %v", cr.Value, err)
	}
	_, err = c.Admit(ctx, "r1")
	var ae *client.APIError
	if !errors.As(err, &ae) || ae.StatusCode != http.StatusConflict || ae.Code != state.RefusalRunNotActive || ae.Run == nil || ae.Run.CancelVersion != 2 {
		t.Fatalf("admit after cancel: %#v", err)
	}
	ev, err := c.Events(ctx, "r1")
	if err != nil || len(ev.Value.Events) != 2 || ev.Value.Events[1].Actor != "operator (cli:test)" {
		t.Fatalf("events: %+v %v", ev.Value, err)
	}
	runs, err := c.Runs(ctx, state.StatusCancelling)
	if err != nil || len(runs.Value.Runs) != 1 {
		t.Fatalf("runs: %+v %v", runs.Value, err)
	}
	a, err := c.Audit(ctx, "r1")
	if err != nil || a.Value.Run.ID != "r1" || len(a.Value.Events) != 2 {
		t.Fatalf("audit: %+v %v", a.Value, err)
	}
	if _, err := c.Run(ctx, "nope"); !errors.As(err, &ae) || ae.Code != refusal.NotFound {
		t.Fatalf("unknown run: %v", err)
	}
}

// TestNotTheAPI: an answer that is not the API's JSON (a proxy, another
// server on the port) is still an error that says what came back.
func TestNotTheAPI(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "upstream connect error", http.StatusBadGateway)
	}))
	defer srv.Close()
	c, err := client.New(srv.URL, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Run(context.Background(), "r1")
	var ae *client.APIError
	if !errors.As(err, &ae) || ae.StatusCode != http.StatusBadGateway || !strings.Contains(ae.Message, "upstream connect error") {
		t.Fatalf("got %#v", err)
	}
}

func TestNewRejectsBadURLs(t *testing.T) {
	for _, u := range []string{"", "127.0.0.1:8081", "ftp://h", "http://", "http://h/?x=1", "http://h/#f"} {
		if _, err := client.New(u, client.Options{}); err == nil {
			t.Errorf("New(%q) accepted", u)
		}
	}
}
