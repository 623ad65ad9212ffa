package proxy_test

import (
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/bench/baseline"
	"github.com/stopgate/stopgate/internal/redisserver"
)

// benchStoreTimeout bounds the Redis store's steps and the ledger's calls
// alike, as stopgate serve's one --store-timeout does: under two bounds
// every guard would carry a second deadline (a timer, a context) that a
// deployed proxy does not make.
const benchStoreTimeout = 2 * time.Second

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
			e := newEnv(b, envOptions{store: newRedisStore(b, srv, benchStoreTimeout), storeTimeout: benchStoreTimeout})
			e.admit("bench")
			return e.client("bench", 1)
		}},
		{"stopgate-redis-aof-always", func(b *testing.B) *http.Client {
			srv := redisserver.Start(b, redisserver.Options{AppendFsyncAlways: true})
			e := newEnv(b, envOptions{store: newRedisStore(b, srv, benchStoreTimeout), storeTimeout: benchStoreTimeout})
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

// BenchmarkGET64 is the bench's busiest case in one process: 64 keep-alive
// connections of small GETs through plain goproxy and through stopgate on
// each store. It is there to be profiled (-cpuprofile; the client and the
// upstream share the profile, so focus on the proxy: -focus 'proxy\.') and
// for its allocations (-benchmem, the whole process: what stopgate adds is
// its figure less plain goproxy's), not for its times: make bench measures
// the proxies as processes of their own.
func BenchmarkGET64(b *testing.B) {
	up := newUpstream(b, false, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	for _, tc := range []struct {
		name   string
		client func(b *testing.B) *http.Client
	}{
		{"plain-goproxy", plainGoproxyClient},
		{"stopgate-embedded", func(b *testing.B) *http.Client { return benchClient(b, envOptions{}) }},
		{"stopgate-redis", func(b *testing.B) *http.Client {
			srv := redisserver.Start(b, redisserver.Options{})
			return benchClient(b, envOptions{store: newRedisStore(b, srv, benchStoreTimeout), storeTimeout: benchStoreTimeout})
		}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			c := tc.client(b)
			c.Transport.(*http.Transport).MaxIdleConnsPerHost = 64
			var n atomic.Int64
			b.SetParallelism(32)
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					resp, err := c.Get(fmt.Sprintf("%s/read?i=%d", up.URL, n.Add(1)))
					if err != nil {
						b.Error(err)
						return
					}
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode != 200 {
						b.Errorf("status %d", resp.StatusCode)
						return
					}
				}
			})
		})
	}
}

// benchClient is a client of run "bench" through stopgate on opts' store.
func benchClient(b *testing.B, opts envOptions) *http.Client {
	e := newEnv(b, opts)
	e.admit("bench")
	return e.client("bench", 1)
}

// plainGoproxyClient is a client through the benchmarks' baseline goproxy
// (package baseline): stopgate's upstream transport, no guard, no
// interception (the requests are plain HTTP).
func plainGoproxyClient(b *testing.B) *http.Client {
	gp := baseline.Goproxy(nil, log.New(io.Discard, "", 0))
	srv := httptest.NewServer(gp)
	b.Cleanup(srv.Close)
	u, _ := url.Parse(srv.URL)
	// The credentials stopgate's clients send, which goproxy strips.
	u.User = url.UserPassword("bench", "1")
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{Proxy: http.ProxyURL(u)}}
}
