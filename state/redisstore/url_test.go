package redisstore_test

import (
	"crypto/tls"
	"errors"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/redisstore"
)

// TestEveryURLFormReadsWithItsServersAndTLS: every form docs/redis.md
// promises, with TLS and without, is read by go-redis's parsers into what
// it names: its kind, its servers (the default port filled in), whether it
// speaks TLS, and a redacted form without the password.
func TestEveryURLFormReadsWithItsServersAndTLS(t *testing.T) {
	for _, tc := range []struct {
		url   string
		kind  string
		tls   bool
		addrs []string
	}{
		{"redis://u:pw-1@h:6379/0", redisstore.KindNode, false, []string{"h:6379"}},
		{"redis://h", redisstore.KindNode, false, []string{"h:6379"}},
		{"rediss://default:pw-1@cache.example:6380/2?skip_verify=true", redisstore.KindNode, true, []string{"cache.example:6380"}},
		{"redis://[::1]:6379/0", redisstore.KindNode, false, []string{"[::1]:6379"}},
		{"redis-sentinel://:pw-1@a:26379,b:26380/1?master=m&sentinel_password=pw-2", redisstore.KindSentinel, false, []string{"a:26379", "b:26380"}},
		{"rediss-sentinel://app:pw-1@a:26379,[::1]:26380/0?master=m&sentinel_password=pw-2&client_name=sg", redisstore.KindSentinel, true, []string{"a:26379", "[::1]:26380"}},
		{"redis-cluster://admin:pw-1@n1:7000,n2:7001", redisstore.KindCluster, false, []string{"n1:7000", "n2:7001"}},
		{"rediss-cluster://admin:pw-1@n1:7000,n2:7001,n3:7002/0?pool_size=4", redisstore.KindCluster, true, []string{"n1:7000", "n2:7001", "n3:7002"}},
		{"REDISS-CLUSTER://n1:7000", redisstore.KindCluster, true, []string{"n1:7000"}},
	} {
		t.Run(tc.url, func(t *testing.T) {
			u, err := redisstore.ParseURL(tc.url)
			if err != nil {
				t.Fatal(err)
			}
			if u.Kind() != tc.kind || u.TLS() != tc.tls || !slices.Equal(u.Addrs(), tc.addrs) {
				t.Errorf("read as %s tls=%v %v, want %s tls=%v %v", u.Kind(), u.TLS(), u.Addrs(), tc.kind, tc.tls, tc.addrs)
			}
			for _, shown := range []string{u.Redacted(), u.String(), redisstore.Redact(tc.url)} {
				if strings.Contains(shown, "pw-") {
					t.Errorf("shown as %q: a password is still there", shown)
				}
				for _, a := range tc.addrs[1:] {
					if !strings.Contains(shown, a) {
						t.Errorf("shown as %q: the server %s is gone", shown, a)
					}
				}
			}
			if got := redisstore.TLSOf(u); got != tc.tls {
				t.Errorf("the client built for it speaks TLS: %v, want %v", got, tc.tls)
			}
		})
	}
}

// TestAPasswordApartGoesToTheDataNodesOfEveryForm: the password given
// apart (a file, the environment) is the data nodes', in every form; one in
// the URL besides is refused; a Sentinel's own password stays its own.
func TestAPasswordApartGoesToTheDataNodesOfEveryForm(t *testing.T) {
	for _, raw := range []string{"rediss://h:6380/0", "rediss-sentinel://a:26379/0?master=m&sentinel_password=sp", "rediss-cluster://n1:7000,n2:7001"} {
		u, err := redisstore.ParseURL(raw)
		if err != nil {
			t.Fatal(err)
		}
		if u.HasPassword() {
			t.Errorf("%s: has a password", raw)
		}
		if got, err := redisstore.ClientPassword(raw, "apart"); err != nil || got != "apart" {
			t.Errorf("%s: the client authenticates with %q (%v), want the password given apart", raw, got, err)
		}
		withOwn := strings.Replace(raw, "://", "://:own@", 1)
		if _, err := redisstore.ClientPassword(withOwn, "apart"); !errors.Is(err, state.ErrInvalid) || strings.Contains(err.Error(), "own") || strings.Contains(err.Error(), "apart") {
			t.Errorf("%s with a password apart: %v, want ErrInvalid showing neither", withOwn, err)
		}
	}
}

// TestEveryFormSpeaksTLS: a rediss URL of each form reaches a real Redis
// that speaks TLS alone (no plain port): one node, the master a Sentinel
// over TLS names, a cluster whose nodes talk TLS; the store works on each,
// and the probe of who may read it speaks TLS to the data node too. The
// servers' certificate is the test's own, so the URLs say skip_verify: this
// shows TLS spoken on every connection, not the system roots' verdict.
func TestEveryFormSpeaksTLS(t *testing.T) {
	files := redisserver.MakeTLS(t)
	ctx := tctx(t)
	use := func(t *testing.T, url string) {
		t.Helper()
		s := open(t, url, redisstore.Options{})
		must(s.Admit(ctx, state.AdmitRequest{RunID: "tls", Actor: "t"}))(t)
		res := must(s.Guard(ctx, guardReq("tls", "k")))(t)
		if !res.Admitted {
			t.Fatalf("guard over TLS: %+v", res)
		}
		x := must(s.Exposure(ctx))(t)
		if x.Auth != redisstore.AuthOpen {
			t.Errorf("the probe over TLS: %+v, want it to reach the data node and find it open", x)
		}
	}
	t.Run("node", func(t *testing.T) {
		srv := redisserver.Start(t, redisserver.Options{TLS: files})
		if _, err := redisstore.Open(ctx, "redis://"+srv.Addr()+"/0", redisstore.Options{Logger: quiet(t)}); !errors.Is(err, state.ErrUnavailable) {
			t.Fatalf("plain redis:// to a TLS-only server: %v, want it unreachable", err)
		}
		use(t, strings.Replace(srv.URL(), "redis://", "rediss://", 1)+"?skip_verify=true")
	})
	t.Run("sentinel", func(t *testing.T) {
		master := redisserver.Start(t, redisserver.Options{TLS: files})
		host, port, _ := strings.Cut(master.Addr(), ":")
		sentinel := redisserver.Start(t, redisserver.Options{TLS: files, Sentinel: true, Conf: "sentinel monitor stopgate " + host + " " + port + " 1\n"})
		use(t, "rediss-sentinel://"+sentinel.Addr()+"/0?master=stopgate&skip_verify=true")
	})
	t.Run("cluster", func(t *testing.T) {
		bus, err := redisserver.FreePort()
		if err != nil {
			t.Fatal(err)
		}
		node := redisserver.Start(t, redisserver.Options{TLS: files, Args: []string{"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-port", strconv.Itoa(bus)}})
		admin := redis.NewClient(&redis.Options{Addr: node.Addr(), TLSConfig: &tls.Config{RootCAs: files.Pool, ServerName: "127.0.0.1"}, MaxRetries: -1})
		defer admin.Close()
		if err := admin.Do(ctx, "CLUSTER", "ADDSLOTSRANGE", "0", "16383").Err(); err != nil {
			t.Fatalf("cluster addslotsrange over TLS: %v", err)
		}
		for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			if info, err := admin.ClusterInfo(ctx).Result(); err == nil && strings.Contains(info, "cluster_state:ok") {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("the TLS cluster did not become ok")
			}
		}
		use(t, "rediss-cluster://"+node.Addr()+"?skip_verify=true")
	})
}
