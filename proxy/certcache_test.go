package proxy_test

import (
	"crypto/tls"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stopgate/stopgate/proxy"
)

// minter mints real leaves with a CA and counts the mints per host; a
// host in hold waits until its channel is closed.
type minter struct {
	ca   *proxy.CA
	mu   sync.Mutex
	n    map[string]int
	hold map[string]chan struct{}
}

func newMinter(t *testing.T) *minter {
	ca, err := proxy.LoadOrCreateCA(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return &minter{ca: ca, n: map[string]int{}, hold: map[string]chan struct{}{}}
}

func (m *minter) gen(host string) func() (*tls.Certificate, error) {
	return func() (*tls.Certificate, error) {
		m.mu.Lock()
		m.n[host]++
		wait := m.hold[host]
		m.mu.Unlock()
		if wait != nil {
			<-wait
		}
		return m.ca.Leaf(host)
	}
}

func (m *minter) mints(host string) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.n[host]
}

// TestCertCacheMintsOnceForMissesAtOnceAndOutsideTheLock: misses of one
// host at once share one mint; a mint that takes long holds up no other
// host.
func TestCertCacheMintsOnceForMissesAtOnceAndOutsideTheLock(t *testing.T) {
	m := newMinter(t)
	release := make(chan struct{})
	m.hold["slow.example"] = release
	var c proxy.CertCache
	var wg sync.WaitGroup
	var got [16]*tls.Certificate
	for i := range got {
		wg.Go(func() {
			cert, err := c.Fetch("slow.example", m.gen("slow.example"))
			if err != nil {
				t.Error(err)
			}
			got[i] = cert
		})
	}
	for deadline := time.Now().Add(10 * time.Second); m.mints("slow.example") == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("no fetch of slow.example began minting")
		}
	}
	// While slow.example's mint waits, another host is minted and served.
	other := make(chan error, 1)
	go func() {
		_, err := c.Fetch("fast.example", m.gen("fast.example"))
		other <- err
	}()
	select {
	case err := <-other:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("fast.example waited for slow.example's mint: minting holds the lock")
	}
	close(release)
	wg.Wait()
	if n := m.mints("slow.example"); n != 1 {
		t.Fatalf("%d concurrent misses of one host minted %d leaves, want 1", len(got), n)
	}
	for _, cert := range got {
		if cert != got[0] {
			t.Fatal("misses of one host got different leaves")
		}
	}
}

// TestCertCacheIsBoundedAndLeastRecentlyUsedGoesFirst: past its size the
// leaf used longest ago is dropped, and minted again when asked for.
func TestCertCacheIsBoundedAndLeastRecentlyUsedGoesFirst(t *testing.T) {
	m := newMinter(t)
	c := proxy.CertCache{Size: 2}
	fetch := func(host string) {
		t.Helper()
		if _, err := c.Fetch(host, m.gen(host)); err != nil {
			t.Fatal(err)
		}
	}
	fetch("a")
	fetch("b")
	fetch("a") // a is now the most recently used
	fetch("c") // drops b
	fetch("a")
	fetch("b")
	if m.mints("a") != 1 || m.mints("b") != 2 || m.mints("c") != 1 {
		t.Fatalf("mints a=%d b=%d c=%d, want 1, 2 (dropped for c), 1", m.mints("a"), m.mints("b"), m.mints("c"))
	}
}

// TestCertCacheEntriesExpireWithTheLeaf: a kept leaf is minted anew once
// it is within an hour of its expiry; a failed mint is not kept.
func TestCertCacheEntriesExpireWithTheLeaf(t *testing.T) {
	m := newMinter(t)
	var now atomic.Pointer[time.Time]
	start := time.Now()
	now.Store(&start)
	c := proxy.CertCache{Now: func() time.Time { return *now.Load() }}
	first, err := c.Fetch("h", m.gen("h"))
	if err != nil {
		t.Fatal(err)
	}
	late := first.Leaf.NotAfter.Add(-2 * time.Hour)
	now.Store(&late)
	if again, _ := c.Fetch("h", m.gen("h")); again != first || m.mints("h") != 1 {
		t.Fatalf("a leaf two hours from expiry was minted again (%d mints)", m.mints("h"))
	}
	lapsing := first.Leaf.NotAfter.Add(-time.Minute)
	now.Store(&lapsing)
	if renewed, _ := c.Fetch("h", m.gen("h")); renewed == first || m.mints("h") != 2 {
		t.Fatalf("a leaf a minute from expiry was served again (%d mints)", m.mints("h"))
	}
	boom := errors.New("no entropy")
	fail := func() (*tls.Certificate, error) { return nil, boom }
	if _, err := c.Fetch("bad", fail); !errors.Is(err, boom) {
		t.Fatalf("a failed mint: %v", err)
	}
	if _, err := c.Fetch("bad", m.gen("bad")); err != nil || m.mints("bad") != 1 {
		t.Fatalf("after a failed mint the next fetch minted %d times (%v), want a fresh mint", m.mints("bad"), err)
	}
}
