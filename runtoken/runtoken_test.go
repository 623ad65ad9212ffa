package runtoken_test

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/runtoken"
)

var secret = []byte("0123456789abcdef0123456789abcdef")

func TestTokenVerifiesUntilItExpires(t *testing.T) {
	s, err := runtoken.New(secret)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	tok := s.Sign("run_42", 1, now.Add(time.Hour))
	if !runtoken.IsToken(tok) || strings.ContainsAny(tok, ":@/ ") {
		t.Fatalf("token %q must be a proxy password as it is", tok)
	}
	c, err := s.Verify(tok, now)
	if err != nil || c.RunID != "run_42" || c.Version != 1 {
		t.Fatalf("verify: %+v %v", c, err)
	}
	if _, err := s.Verify(tok, now.Add(2*time.Hour)); !errors.Is(err, runtoken.ErrInvalid) || !strings.Contains(err.Error(), "expired") {
		t.Fatalf("an expired token: %v", err)
	}
}

func TestTokenRefusesWhatWasNotSigned(t *testing.T) {
	s, _ := runtoken.New(secret)
	other, _ := runtoken.New([]byte(strings.Repeat("x", 32)))
	now := time.Now()
	tok := s.Sign("run_42", 1, now.Add(time.Hour))
	// The claims of another run under this token's signature.
	forged := other.Sign("run_43", 1, now.Add(time.Hour))
	swapped := forged[:strings.LastIndexByte(forged, '.')] + tok[strings.LastIndexByte(tok, '.'):]
	for name, bad := range map[string]string{
		"another secret":  other.Sign("run_42", 1, now.Add(time.Hour)),
		"claims swapped":  swapped,
		"signature cut":   tok[:len(tok)-3],
		"not a token":     "1",
		"prefix only":     "sg1.",
		"garbage payload": "sg1.!!!." + tok[strings.LastIndexByte(tok, '.')+1:],
		"empty":           "",
	} {
		if _, err := s.Verify(bad, now); !errors.Is(err, runtoken.ErrInvalid) {
			t.Errorf("%s: verified (%v)", name, err)
		}
	}
	if _, err := runtoken.New([]byte("short")); err == nil {
		t.Fatal("a short secret was accepted")
	}
}

// FuzzVerify: whatever the input, Verify answers claims or ErrInvalid.
func FuzzVerify(f *testing.F) {
	s, _ := runtoken.New(secret)
	f.Add(s.Sign("r", 1, time.Now().Add(time.Hour)))
	f.Add("sg1..")
	f.Add("sg1.e30.")
	f.Fuzz(func(t *testing.T, tok string) {
		c, err := s.Verify(tok, time.Now())
		if err == nil && (c.RunID == "" || c.Version < 1) {
			t.Fatalf("verified empty claims from %q", tok)
		}
		if err != nil && !errors.Is(err, runtoken.ErrInvalid) {
			t.Fatalf("unexpected error kind: %v", err)
		}
	})
}

// TestTokensOfTheFirstFormatStillVerify: a token written by hand in the
// sg1. format (HMAC-SHA256 of everything before the last dot) verifies:
// moving the format into package signed changed no token in the field.
func TestTokensOfTheFirstFormatStillVerify(t *testing.T) {
	s, _ := runtoken.New(secret)
	exp := time.Now().Add(time.Hour).Unix()
	body := "sg1." + base64.RawURLEncoding.EncodeToString([]byte(`{"r":"run_42","v":2,"e":`+strconv.FormatInt(exp, 10)+`}`))
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(body))
	c, err := s.Verify(body+"."+base64.RawURLEncoding.EncodeToString(m.Sum(nil)), time.Now())
	if err != nil || c.RunID != "run_42" || c.Version != 2 || c.ExpUnix != exp {
		t.Fatalf("a token of the first format: %+v %v", c, err)
	}
}
