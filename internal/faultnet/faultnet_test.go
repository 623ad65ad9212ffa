package faultnet_test

import (
	"bufio"
	"io"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/faultnet"
)

// lineServer answers each line with "ok <line>" and counts the lines it
// acted on, so a test can tell a lost reply from a lost request.
func lineServer(t *testing.T) (string, *atomic.Int64) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	var acted atomic.Int64
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				sc := bufio.NewScanner(c)
				for sc.Scan() {
					acted.Add(1)
					if _, err := io.WriteString(c, "ok "+sc.Text()+"\n"); err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String(), &acted
}

func relay(t *testing.T, target string) *faultnet.Relay {
	t.Helper()
	r, err := faultnet.Listen(target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	return r
}

func dial(t *testing.T, addr string) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	return c, bufio.NewReader(c)
}

func ask(t *testing.T, c net.Conn, rd *bufio.Reader, line string) (string, error) {
	t.Helper()
	if _, err := io.WriteString(c, line+"\n"); err != nil {
		return "", err
	}
	s, err := rd.ReadString('\n')
	return strings.TrimSpace(s), err
}

func TestRelayPassesBytesUntilToldOtherwise(t *testing.T) {
	addr, acted := lineServer(t)
	r := relay(t, addr)
	c, rd := dial(t, r.Addr())
	for _, line := range []string{"a", "b"} {
		if got, err := ask(t, c, rd, line); err != nil || got != "ok "+line {
			t.Fatalf("through the relay: %q, %v", got, err)
		}
	}
	if acted.Load() != 2 {
		t.Fatalf("server acted on %d lines, want 2", acted.Load())
	}
}

func TestDropNextReplyLetsTheRequestActAndLosesTheAnswer(t *testing.T) {
	addr, acted := lineServer(t)
	r := relay(t, addr)
	c, rd := dial(t, r.Addr())
	fired := r.DropNextReply("CHARGE", "42")
	if got, err := ask(t, c, rd, "charge 41"); err != nil || got != "ok charge 41" {
		t.Fatalf("a request that does not match: %q, %v", got, err)
	}
	if _, err := ask(t, c, rd, "charge 42"); err == nil {
		t.Fatal("the reply to the matching request arrived")
	}
	select {
	case <-fired:
	case <-time.After(5 * time.Second):
		t.Fatal("the rule did not report firing")
	}
	if acted.Load() != 2 || r.LostReplies() != 1 {
		t.Fatalf("server acted on %d, relay lost %d replies; want 2 and 1", acted.Load(), r.LostReplies())
	}
	// One shot: the next connection is relayed whole.
	c2, rd2 := dial(t, r.Addr())
	if got, err := ask(t, c2, rd2, "charge 42"); err != nil || got != "ok charge 42" {
		t.Fatalf("after the rule fired: %q, %v", got, err)
	}
}

func TestSilenceKeepsTheConnectionOpenAndMute(t *testing.T) {
	addr, acted := lineServer(t)
	r := relay(t, addr)
	sub, subRd := dial(t, r.Addr())
	other, otherRd := dial(t, r.Addr())
	if _, err := ask(t, sub, subRd, "subscribe cancels"); err != nil {
		t.Fatal(err)
	}
	r.Silence("subscribe")
	_ = sub.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if got, err := ask(t, sub, subRd, "ping"); err == nil {
		t.Fatalf("a silent connection answered %q", got)
	} else if ne, ok := err.(net.Error); !ok || !ne.Timeout() {
		t.Fatalf("a silent connection must stay open, got %v", err)
	}
	if got, err := ask(t, other, otherRd, "ping"); err != nil || got != "ok ping" {
		t.Fatalf("another connection: %q, %v", got, err)
	}
	if acted.Load() != 3 || r.SilencedBytes() == 0 {
		t.Fatalf("server acted on %d lines (want 3), relay discarded %d bytes", acted.Load(), r.SilencedBytes())
	}
}

func TestPartitionAndCutAll(t *testing.T) {
	addr, acted := lineServer(t)
	r := relay(t, addr)
	c, rd := dial(t, r.Addr())
	r.Partition()
	_ = c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if _, err := ask(t, c, rd, "lost"); err == nil {
		t.Fatal("an answer crossed a partition")
	}
	if acted.Load() != 0 {
		t.Fatalf("the request crossed a partition: server acted on %d", acted.Load())
	}
	r.Heal()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if got, err := ask(t, c, rd, "after"); err != nil || got != "ok after" {
		t.Fatalf("after healing: %q, %v", got, err)
	}
	r.CutAll()
	if _, err := ask(t, c, rd, "cut"); err == nil {
		t.Fatal("a cut connection still answered")
	}
}
