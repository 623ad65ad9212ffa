package signed_test

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"strings"
	"testing"

	"github.com/stopgate/stopgate/signed"
)

type claims struct {
	R string `json:"r"`
	V int64  `json:"v"`
}

// TestSealIsThePrefixTheClaimsAndTheirMAC pins the one sealed format
// against an HMAC computed here, apart: a run token and a console session
// are this, under their own prefix.
func TestSealIsThePrefixTheClaimsAndTheirMAC(t *testing.T) {
	secret := []byte("0123456789abcdef0123456789abcdef")
	k := signed.NewKey(secret)
	v, err := k.Seal("sg1.", claims{R: "run_42", V: 3})
	if err != nil {
		t.Fatal(err)
	}
	body := base64.RawURLEncoding.EncodeToString([]byte(`{"r":"run_42","v":3}`))
	m := hmac.New(sha256.New, secret)
	m.Write([]byte("sg1." + body))
	if want := "sg1." + body + "." + base64.RawURLEncoding.EncodeToString(m.Sum(nil)); v != want {
		t.Fatalf("sealed %q, want %q", v, want)
	}
	var got claims
	if err := k.Open("sg1.", v, &got); err != nil || got != (claims{"run_42", 3}) {
		t.Fatalf("open: %+v %v", got, err)
	}
	for name, tc := range map[string]struct {
		prefix, value string
		want          error
	}{
		"another prefix": {"sgs1.", v, signed.ErrPrefix},
		// The same bytes under another prefix: its MAC covers the prefix.
		"prefix swapped": {"sgs1.", "sgs1." + strings.TrimPrefix(v, "sg1."), signed.ErrSignature},
		"cut":            {"sg1.", v[:len(v)-2], signed.ErrSignature},
		"no MAC":         {"sg1.", "sg1." + body, signed.ErrSignature},
		"not JSON":       {"sg1.", "sg1.e30x." + k.Sum("sg1.", "e30x"), signed.ErrClaims},
	} {
		if err := k.Open(tc.prefix, tc.value, &got); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", name, err, tc.want)
		}
	}
	if err := signed.NewKey([]byte("another")).Open("sg1.", v, &got); !errors.Is(err, signed.ErrSignature) {
		t.Errorf("another key opened it: %v", err)
	}
	if k.Derive("a").Sum("p", "x") == k.Derive("b").Sum("p", "x") || k.Sum("a", "bc") == k.Sum("b", "bc") {
		t.Error("keys or MACs of different purposes agree")
	}
}

// TestWebhookIsSHA256HexOfTheBody pins the webhook format providers sign
// with: exactly one header, sha256=<hex HMAC-SHA256 of the body as sent>.
func TestWebhookIsSHA256HexOfTheBody(t *testing.T) {
	secret, body := []byte("whsec_x"), []byte(`{"outcome":"applied"}`)
	m := hmac.New(sha256.New, secret)
	m.Write(body)
	good := "sha256=" + hex.EncodeToString(m.Sum(nil))
	if got := signed.Webhook(secret, body); got != good {
		t.Fatalf("Webhook = %s, want %s", got, good)
	}
	for name, tc := range map[string]struct {
		values            []string
		wellFormed, match bool
	}{
		"good":        {[]string{good}, true, true},
		"spaces":      {[]string{" " + good + " "}, true, true},
		"other body":  {[]string{signed.Webhook(secret, []byte("{}"))}, true, false},
		"two headers": {[]string{good, good}, false, false},
		"none":        {nil, false, false},
		"sha1":        {[]string{"sha1=" + good[len("sha256="):]}, false, false},
		"short":       {[]string{good[:len(good)-2]}, false, false},
		"not hex":     {[]string{"sha256=" + strings.Repeat("z", 64)}, false, false},
	} {
		wf, match := signed.CheckWebhook(secret, body, tc.values)
		if wf != tc.wellFormed || match != tc.match {
			t.Errorf("%s: well formed %v, match %v; want %v, %v", name, wf, match, tc.wellFormed, tc.match)
		}
	}
}
