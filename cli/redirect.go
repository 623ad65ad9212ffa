package cli

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"strings"

	"github.com/stopgate/stopgate/redirect"
)

// Redirect is what a `stopgate redirect` command line asks for, checked
// as the verb checks it (an image's manifest is tested with it too).
type Redirect struct {
	// Action is install or remove.
	Action string
	UID    uint32
	// Port is install's transparent listener port; 0 asks --control.
	Port int
	// DNS are install's resolvers; none takes /etc/resolv.conf's.
	DNS []netip.AddrPort

	control controlFlags
}

// redirectFlags defines redirect's flags into o; uid is -1 until given.
func redirectFlags() (*flag.FlagSet, *redirectOpts) {
	fs := flag.NewFlagSet("redirect", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	o := &redirectOpts{}
	fs.Int64Var(&o.uid, "uid", -1, "the user whose TCP connections are redirected (required)")
	fs.IntVar(&o.port, "port", 0, "install: the transparent listener's port (default: asked of --control, GET /v1/endpoints)")
	fs.Var(resolversFlag{&o.dns}, "dns", "install: `ADDR[:PORT]` of a resolver the uid may send DNS to (repeatable; default: the nameservers of /etc/resolv.conf); no other UDP leaves")
	o.controlFlags.define(fs, ", to learn the port")
	return fs, o
}

// redirectOpts are the flags of stopgate redirect.
type redirectOpts struct {
	uid  int64
	port int
	dns  []netip.AddrPort
	controlFlags
}

// ParseRedirect reads the arguments of `stopgate redirect` (those after the
// verb), refusing what the verb refuses, as usage errors.
func ParseRedirect(args []string) (Redirect, error) {
	fs, o := redirectFlags()
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return Redirect{}, flagError("redirect", err)
	}
	if len(pos) != 1 || (pos[0] != "install" && pos[0] != "remove") {
		return Redirect{}, usagef("redirect", "want install or remove, got %q", pos)
	}
	if o.uid == -1 {
		return Redirect{}, usagef("redirect", "--uid is required: the user id to redirect")
	}
	if why := redirect.CheckUID(o.uid); why != "" {
		return Redirect{}, usagef("redirect", "--%s", why)
	}
	if pos[0] == "remove" && (o.port != 0 || len(o.dns) > 0) {
		return Redirect{}, usagef("redirect", "--port and --dns are for install only")
	}
	if o.port < 0 || o.port > 65535 {
		return Redirect{}, usagef("redirect", "--port %d: want 1 to 65535", o.port)
	}
	return Redirect{Action: pos[0], UID: uint32(o.uid), Port: o.port, DNS: o.dns, control: o.controlFlags}, nil
}

// redirectVerb installs or removes the kernel redirect of one uid in the
// current network namespace: the rules live in package redirect; this
// reads the command line and says what was done.
func (c *cli) redirectVerb(ctx context.Context, args []string) error {
	r, err := ParseRedirect(args)
	if err != nil {
		return err
	}
	if r.Action == "remove" {
		if err := redirect.Remove(ctx, r.UID); err != nil {
			return err
		}
		fmt.Fprintf(c.stdout, "removed the redirect of uid %d (chains %s, iptables and ip6tables)\n", r.UID, redirect.ChainName(r.UID))
		return nil
	}
	dns := r.DNS
	if len(dns) == 0 {
		if dns, err = redirect.Resolvers(redirect.ResolvConf); err != nil {
			return usagef("redirect", "--dns: %v", err)
		}
	}
	port := r.Port
	if port == 0 {
		if port, err = c.transparentPort(ctx, r.control); err != nil {
			return err
		}
	}
	if err := redirect.Install(ctx, redirect.Rules{UID: r.UID, Port: uint16(port), DNS: dns}); err != nil {
		return err
	}
	fmt.Fprintf(c.stdout, "redirected uid %d: every TCP connection it opens goes to port %d, its other traffic is refused but DNS to %s (chains %s)\n", r.UID, port, addrList(dns), redirect.ChainName(r.UID))
	return nil
}

// transparentPort asks the control API where the transparent listener is.
func (c *cli) transparentPort(ctx context.Context, f controlFlags) (int, error) {
	cl, err := c.controlClient("redirect", f)
	if err != nil {
		return 0, err
	}
	ep, err := cl.Endpoints(ctx)
	if err != nil {
		return 0, fmt.Errorf("learning the transparent listener's port (or give --port): %w", err)
	}
	if ep.Value.Transparent == "" {
		return 0, fmt.Errorf("stopgate serve has no transparent listener: start it with --transparent-addr (or give --port)")
	}
	_, p, err := net.SplitHostPort(ep.Value.Transparent)
	if err != nil {
		return 0, fmt.Errorf("transparent listener %q: %w", ep.Value.Transparent, err)
	}
	return strconv.Atoi(p)
}

func addrList(as []netip.AddrPort) string {
	s := make([]string, len(as))
	for i, a := range as {
		s[i] = a.String()
	}
	return strings.Join(s, ", ")
}
