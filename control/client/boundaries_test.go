package client_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"testing"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/control/client"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/filestore"
)

func TestBoundaryCalls(t *testing.T) {
	ctx := context.Background()
	store, err := filestore.Open(filepath.Join(t.TempDir(), "stopgate.db"), filestore.Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = store.Close() })
	pem := []byte("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
	h, err := control.New(control.Options{Store: store, Token: operatorToken, CACertPEM: pem})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	c, err := client.New(srv.URL, client.Options{Token: operatorToken, Actor: "cli:test"})
	if err != nil {
		t.Fatal(err)
	}

	got, err := c.CA(ctx)
	if err != nil || !bytes.Equal(got, pem) {
		t.Fatalf("CA: %q %v; want the PEM byte for byte", got, err)
	}
	if _, err := c.Admit(ctx, "r1"); err != nil {
		t.Fatal(err)
	}
	claim, err := c.Claim(ctx, "r1", control.ClaimRequest{StepID: "s1", CancelVersion: 1, Worker: "w1"})
	if err != nil || claim.StatusCode != http.StatusCreated || claim.Value.Intent.Key != "claim:s1" || claim.Value.Intent.LeaseOwner != "w1" {
		t.Fatalf("claim: %+v %v", claim, err)
	}
	key := "mail/1?#"
	begun, err := c.Begin(ctx, "r1", control.IntentRequest{Key: key, Method: "SMTP"})
	if err != nil || begun.Value.Intent.State != state.IntentInFlight {
		t.Fatalf("begin: %+v %v", begun, err)
	}
	done, err := c.Finish(ctx, "r1", key, control.OutcomeRequest{Outcome: control.OutcomeUnknown})
	if err != nil || done.Value.Key != key || done.Value.State != state.IntentUnknown {
		t.Fatalf("finish a key that needs escaping: %+v %v", done, err)
	}
	resolved, err := c.Resolve(ctx, "r1", key, control.ResolveRequest{Outcome: control.OutcomeApplied, Note: "seen in the outbox"})
	if err != nil || resolved.Value.State != state.IntentApplied || resolved.Value.Source != "operator" {
		t.Fatalf("resolve: %+v %v", resolved, err)
	}
	read, err := c.Intent(ctx, "r1", key)
	if err != nil || read.Value.State != state.IntentApplied {
		t.Fatalf("intent: %+v %v", read, err)
	}
	at := time.Now().Add(time.Hour).UTC().Format(time.RFC3339)
	if r, err := c.Retry(ctx, "r1", control.RetryRequest{StepID: "s1", Attempt: 2, NotBefore: at}); err != nil || r.Value.Intent.State != state.IntentScheduled {
		t.Fatalf("retry: %+v %v", r, err)
	}
	if _, err := c.Cancel(ctx, "r1", client.CancelOptions{}); err != nil {
		t.Fatal(err)
	}
	_, err = c.Claim(ctx, "r1", control.ClaimRequest{StepID: "s2", CancelVersion: 1})
	var ae *client.APIError
	if !errors.As(err, &ae) || ae.StatusCode != http.StatusConflict || ae.Code != state.RefusalRunNotActive || ae.Run == nil || ae.Run.CancelVersion != 2 {
		t.Fatalf("claim after cancel: %#v", err)
	}
}

func TestCAAbsent(t *testing.T) {
	c, err := client.New(api(t, ""), client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.CA(context.Background())
	var ae *client.APIError
	if !errors.As(err, &ae) || ae.StatusCode != http.StatusNotFound {
		t.Fatalf("CA without one: %#v", err)
	}
}
