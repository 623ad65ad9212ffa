package redisstore_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/redisstore"
)

// TestExposureReport: whether a client with no credentials reads the
// store, and how Redis evicts, as Exposure reports them and the sentences
// serve logs.
func TestExposureReport(t *testing.T) {
	ctx := tctx(t)
	for _, tc := range []struct {
		name string
		opts redisserver.Options
		// acl are ACL SETUSER commands run first; url then authenticates
		// as app:secret.
		acl      [][]any
		auth     redisstore.AuthState
		eviction string
		says     []string
	}{
		{name: "no password", auth: redisstore.AuthOpen, eviction: "noeviction", says: []string{"asks no password", "ACTIVE"}},
		{name: "requirepass", opts: redisserver.Options{Password: "pw-0123456789"}, auth: redisstore.AuthRequired, eviction: "noeviction"},
		{name: "default user off", acl: [][]any{{"ACL", "SETUSER", "app", "on", ">secret", "~*", "&*", "+@all"}, {"ACL", "SETUSER", "default", "off"}},
			auth: redisstore.AuthRequired, eviction: "noeviction"},
		{name: "default user kept off stopgate's keys", acl: [][]any{{"ACL", "SETUSER", "app", "on", ">secret", "~*", "&*", "+@all"},
			{"ACL", "SETUSER", "default", "resetkeys", "~cache:*"}}, auth: redisstore.AuthRequired, eviction: "noeviction"},
		{name: "allkeys-lru", opts: redisserver.Options{Password: "pw-0123456789", Args: []string{"--maxmemory-policy", "allkeys-lru"}},
			auth: redisstore.AuthRequired, eviction: "allkeys-lru", says: []string{"evicts keys", "allkeys-lru", "noeviction"}},
		{name: "CONFIG refused", acl: [][]any{{"ACL", "SETUSER", "app", "on", ">secret", "~*", "&*", "+@all", "-config"}, {"ACL", "SETUSER", "default", "off"}},
			auth: redisstore.AuthRequired, eviction: "", says: []string{"will not say its maxmemory-policy"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := redisserver.Start(t, tc.opts)
			url := srv.URL()
			if tc.acl != nil {
				admin := raw(t, srv.Addr())
				for _, cmd := range tc.acl {
					if err := admin.Do(ctx, cmd...).Err(); err != nil {
						t.Fatal(err)
					}
				}
				url = "redis://app:secret@" + srv.Addr() + "/0"
			}
			x := must(open(t, url, redisstore.Options{}).Exposure(ctx))(t)
			if x.Auth != tc.auth || x.Eviction != tc.eviction || !strings.Contains(x.AuthDetail, srv.Addr()) {
				t.Fatalf("exposure %+v, want auth %s, eviction %q, naming %s", x, tc.auth, tc.eviction, srv.Addr())
			}
			problems := strings.Join(x.Problems(), " ")
			if x.Safe() != (len(tc.says) == 0) || (problems == "") != x.Safe() {
				t.Fatalf("safe %v with problems %q", x.Safe(), problems)
			}
			for _, say := range tc.says {
				if !strings.Contains(problems, say) {
					t.Errorf("problems %q do not say %q", problems, say)
				}
			}
		})
	}
}

// TestAPasswordGivenApartIsUsed: Options.Password authenticates to a
// Redis that requires one, whatever the URL's form; a URL with a password
// of its own besides is refused, and the error shows neither.
func TestAPasswordGivenApartIsUsed(t *testing.T) {
	ctx := tctx(t)
	srv := redisserver.Start(t, redisserver.Options{Password: "pw-0123456789"})
	bare := "redis://" + srv.Addr() + "/0"
	if _, err := redisstore.Open(ctx, bare, redisstore.Options{Logger: quiet(t)}); err == nil || !strings.Contains(err.Error(), "NOAUTH") {
		t.Fatalf("open without the password: %v; want NOAUTH", err)
	}
	s := open(t, bare, redisstore.Options{Password: "pw-0123456789"})
	must(s.Admit(ctx, state.AdmitRequest{RunID: "r", Actor: "t"}))(t)

	_, err := redisstore.Open(ctx, "redis://:in-url@"+srv.Addr()+"/0", redisstore.Options{Password: "apart-0123", Logger: quiet(t)})
	if !errors.Is(err, state.ErrInvalid) || strings.Contains(err.Error(), "in-url") || strings.Contains(err.Error(), "apart-0123") {
		t.Fatalf("two passwords: %v; want ErrInvalid showing neither", err)
	}

	for _, url := range []string{
		"redis://h:6379/0",
		"rediss://h:6380/0",
		"redis://app@h:6379/0",
		"redis-sentinel://a:26379,b:26379/0?master=m&sentinel_password=sp",
		"redis-cluster://n1:7000,n2:7001",
	} {
		got, err := redisstore.ClientPassword(url, "apart-0123")
		if err != nil || got != "apart-0123" {
			t.Errorf("%s with a password given apart: the client authenticates with %q (%v)", url, got, err)
		}
	}
}
