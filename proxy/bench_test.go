package proxy_test

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/redisserver"
)

// BenchmarkPOST measures one small POST to a loopback upstream: directly,
// and through stopgate on each store, side by side in one run so that the
// ratios mean something on a shared, noisy machine. Through stopgate a
// request costs the guard (one atomic store step) and the outcome record
// (a second one) on top of the proxy hop.
func BenchmarkPOST(b *testing.B) {
	up := newUpstream(b, false, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	direct := &http.Client{Transport: &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 64}, Timeout: 10 * time.Second}
	cases := []struct {
		name   string
		client func(b *testing.B) *http.Client
	}{
		{"direct", func(*testing.B) *http.Client { return direct }},
		{"stopgate-embedded", func(b *testing.B) *http.Client {
			e := newEnv(b, envOptions{})
			e.admit("bench")
			return e.client("bench", 1)
		}},
		{"stopgate-redis", func(b *testing.B) *http.Client {
			srv := redisserver.Start(b, redisserver.Options{})
			e := newEnv(b, envOptions{store: newRedisStore(b, srv, 2*time.Second)})
			e.admit("bench")
			return e.client("bench", 1)
		}},
		{"stopgate-redis-aof-always", func(b *testing.B) *http.Client {
			srv := redisserver.Start(b, redisserver.Options{AppendFsyncAlways: true})
			e := newEnv(b, envOptions{store: newRedisStore(b, srv, 2*time.Second)})
			e.admit("bench")
			return e.client("bench", 1)
		}},
	}
	for _, tc := range cases {
		b.Run(tc.name, func(b *testing.B) {
			c := tc.client(b)
			b.ResetTimer()
			i := 0
			for b.Loop() {
				i++
				resp, err := c.Post(up.URL+"/effect", "text/plain", strings.NewReader(fmt.Sprint(i)))
				if err != nil {
					b.Fatal(err)
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					b.Fatalf("status %d", resp.StatusCode)
				}
			}
		})
	}
}
