package redisstore_test

import (
	"bytes"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/redisstore"
)

// cutter is a TCP relay in front of redis-server that, when armed, lets the
// next script call through and throws its reply away, closing the
// connection: the script ran, and the client never hears of it. That is the
// failure a client retry turns into a second run of the script.
type cutter struct {
	ln     net.Listener
	mu     sync.Mutex
	target string
	armed  atomic.Bool
	cut    atomic.Int32
}

func newCutter(t testing.TB) *cutter {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c := &cutter{ln: ln}
	t.Cleanup(func() { _ = ln.Close() })
	go c.serve()
	return c
}

func (c *cutter) addr() string { return c.ln.Addr().String() }
func (c *cutter) port() int    { return c.ln.Addr().(*net.TCPAddr).Port }

func (c *cutter) forwardTo(addr string) {
	c.mu.Lock()
	c.target = addr
	c.mu.Unlock()
}

func (c *cutter) serve() {
	for {
		client, err := c.ln.Accept()
		if err != nil {
			return
		}
		go c.relay(client)
	}
}

func (c *cutter) relay(client net.Conn) {
	c.mu.Lock()
	target := c.target
	c.mu.Unlock()
	server, err := net.DialTimeout("tcp", target, time.Second)
	if err != nil {
		_ = client.Close()
		return
	}
	closeBoth := func() { _ = client.Close(); _ = server.Close() }
	var dropReply atomic.Bool
	go func() {
		buf := make([]byte, 64<<10)
		for {
			n, err := client.Read(buf)
			if n > 0 {
				// Marked before the bytes reach the server, so its reply is
				// surely the one dropped.
				if isProgramCall(buf[:n]) && c.armed.CompareAndSwap(true, false) {
					dropReply.Store(true)
				}
				if _, err := server.Write(buf[:n]); err != nil {
					closeBoth()
					return
				}
			}
			if err != nil {
				closeBoth()
				return
			}
		}
	}()
	buf := make([]byte, 64<<10)
	for {
		n, err := server.Read(buf)
		if n > 0 {
			if dropReply.Load() {
				c.cut.Add(1)
				closeBoth()
				return
			}
			if _, err := client.Write(buf[:n]); err != nil {
				closeBoth()
				return
			}
		}
		if err != nil {
			closeBoth()
			return
		}
	}
}

// checkLostReply loses the reply of an admitted guard and checks that the
// script ran exactly once: the caller gets ErrUnavailable (and dispatches
// nothing), and the record shows one admission, no second attempt and no
// refusal of the caller's own key.
func checkLostReply(t *testing.T, s *redisstore.Store, c *cutter) {
	ctx := tctx(t)
	must(s.Admit(ctx, state.AdmitRequest{RunID: "lost-reply", Actor: "test"}))(t)
	// Warm up: the script is loaded, so the armed call is EVALSHA that runs.
	must(s.Guard(ctx, guardReq("lost-reply", "warm")))(t)

	c.armed.Store(true)
	_, err := s.Guard(ctx, guardReq("lost-reply", "lost"))
	c.armed.Store(false)
	if c.cut.Load() != 1 {
		t.Fatalf("the relay cut %d replies, want 1 (guard said %v)", c.cut.Load(), err)
	}
	if !errors.Is(err, state.ErrUnavailable) {
		t.Fatalf("guard whose reply was lost: got %v, want ErrUnavailable", err)
	}
	in := must(s.Intent(ctx, "lost-reply", "lost"))(t)
	if in.State != state.IntentInFlight || in.Attempts != 1 || in.Refusals != 0 {
		t.Fatalf("intent after the lost reply: %+v, want IN_FLIGHT after exactly one attempt", in)
	}
	var about []string
	for _, e := range must(s.Events(ctx, "lost-reply"))(t) {
		if e.Intent == "lost" {
			about = append(about, e.Kind+"/"+e.Reason)
		}
	}
	if len(about) != 1 || about[0] != state.EventIntentAdmitted+"/" {
		t.Fatalf("events of the intent whose reply was lost: %v, want one admission: the script ran again", about)
	}
}

func TestLostReplyIsNotRetried(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{})
	c := newCutter(t)
	c.forwardTo(srv.Addr())
	s := open(t, "redis://"+c.addr()+"/0", redisstore.Options{})
	checkLostReply(t, s, c)
}

// isProgramCall reports whether a command the client sent runs a program:
// a function (FCALL) or a script (EVALSHA).
func isProgramCall(b []byte) bool {
	b = bytes.ToLower(b)
	return bytes.Contains(b, []byte("fcall")) || bytes.Contains(b, []byte("evalsha"))
}
