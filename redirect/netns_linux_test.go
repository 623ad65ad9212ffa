package redirect_test

import (
	"bytes"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/netns"
	"github.com/stopgate/stopgate/redirect"
)

// uid is the user the tests redirect; nothing else runs as it.
const uid = 61010

// asUID runs a command as uid, bounded.
func asUID(t *testing.T, name string, args ...string) (string, error) {
	t.Helper()
	path, err := exec.LookPath(name)
	if err != nil {
		t.Fatalf("%s is needed (make test-deps installs it): %v", name, err)
	}
	cmd := exec.Command(path, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
	cmd.WaitDelay = time.Second
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	done := make(chan error, 1)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { done <- cmd.Wait() }()
	select {
	case err = <-done:
	case <-time.After(20 * time.Second):
		_ = cmd.Process.Kill()
		err = <-done
	}
	return out.String(), err
}

func iptablesSave(t *testing.T, bin string) string {
	t.Helper()
	out, err := exec.Command(bin + "-save").CombinedOutput()
	if err != nil {
		t.Fatalf("%s-save: %v: %s", bin, err, out)
	}
	return string(out)
}

// served answers every request with "redirected" and counts them.
func served(t *testing.T, addr string) *int {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	n := new(int)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		*n++
		io.WriteString(w, "redirected")
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return n
}

func TestInstallRemoveInANetworkNamespace(t *testing.T) {
	if !netns.Enter(t) {
		return
	}
	ctx := t.Context()
	served(t, "127.0.0.1:15002")
	served(t, "[::1]:15002")
	udp53, err := net.ListenPacket("udp", "127.0.0.1:53")
	if err != nil {
		t.Fatal(err)
	}
	defer udp53.Close()
	udpOther, err := net.ListenPacket("udp", "127.0.0.1:9999")
	if err != nil {
		t.Fatal(err)
	}
	defer udpOther.Close()
	// Port 53 of an address that is not the resolver named: a way out
	// for anything, were port 53 enough.
	udpOther53, err := net.ListenPacket("udp", "127.0.0.2:53")
	if err != nil {
		t.Fatal(err)
	}
	defer udpOther53.Close()
	resolver := []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:53")}

	// Install twice, the second time to another port: idempotent, one jump per table.
	for _, port := range []uint16{15001, 15002} {
		if err := redirect.Install(ctx, redirect.Rules{UID: uid, Port: port, DNS: resolver}); err != nil {
			t.Fatalf("install to %d: %v", port, err)
		}
	}
	if port, ok, err := redirect.Installed(ctx, uid); err != nil || !ok || port != 15002 {
		t.Fatalf("installed: %d %v %v", port, ok, err)
	}
	for _, bin := range []string{"iptables", "ip6tables"} {
		rules := iptablesSave(t, bin)
		if n := strings.Count(rules, "-j STOPGATE-U61010"); n != 2 {
			t.Fatalf("%s: %d jumps, want one in nat and one in filter:\n%s", bin, n, rules)
		}
	}

	// Every TCP connection of the uid reaches the listener, whatever it dialled, IPv4 and IPv6.
	for _, target := range []string{"http://127.0.0.1:9/anything", "http://[::1]:9/anything", "http://127.0.0.1:15001/"} {
		if out, err := asUID(t, "curl", "-sS", "--noproxy", "*", "--max-time", "5", target); err != nil || out != "redirected" {
			t.Errorf("curl %s as uid %d: %v %q", target, uid, err, out)
		}
	}
	// Other traffic is refused, DNS to the resolver named excepted.
	script := `const d=require('dgram').createSocket('udp4');
d.send('dns',53,'127.0.0.1',()=>d.send('other',9999,'127.0.0.1',()=>d.send('x'.repeat(1024),53,'127.0.0.2',(e)=>{console.log(e?'refused '+e.code:'sent');d.close()})))`
	out, err := asUID(t, "node", "-e", script)
	t.Logf("node udp as uid %d: %v %s", uid, err, out)
	buf := make([]byte, 16)
	_ = udp53.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, _, err := udp53.ReadFrom(buf); err != nil || string(buf[:n]) != "dns" {
		t.Errorf("DNS over UDP did not get through: %v %q", err, buf[:n])
	}
	for name, ln := range map[string]net.PacketConn{"another port": udpOther, "port 53 of another address": udpOther53} {
		_ = ln.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		if n, _, err := ln.ReadFrom(buf); err == nil {
			t.Errorf("UDP to %s got through: %q", name, buf[:n])
		}
	}

	// Not root: iptables says so, and we recognise it.
	if out, err := asUID(t, "iptables", "-S"); err == nil || !redirect.NotPermitted(out) {
		t.Errorf("iptables as uid %d: %v %q", uid, err, out)
	}

	// Remove, twice: clean, then a no-op.
	for i := range 2 {
		if err := redirect.Remove(ctx, uid); err != nil {
			t.Fatalf("remove #%d: %v", i+1, err)
		}
	}
	for _, bin := range []string{"iptables", "ip6tables"} {
		if rules := iptablesSave(t, bin); strings.Contains(rules, "STOPGATE") {
			t.Fatalf("%s after remove:\n%s", bin, rules)
		}
	}
	if _, ok, err := redirect.Installed(ctx, uid); ok || err != nil {
		t.Fatalf("installed after remove: %v %v", ok, err)
	}
	// Without the redirect, the uid's connection goes where it was sent.
	if out, err := asUID(t, "curl", "-sS", "--noproxy", "*", "--max-time", "5", "http://127.0.0.1:9/"); err == nil {
		t.Errorf("after remove, curl to a closed port answered %q", out)
	}
}
