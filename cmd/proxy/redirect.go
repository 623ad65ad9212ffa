package main

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

// redirectOpts are the flags of stopgate redirect.
type redirectOpts struct {
	uid  int64
	port int
	dns  []string
	controlFlags
}

func (c *cli) redirectFlags() (*flag.FlagSet, *redirectOpts) {
	fs := flag.NewFlagSet("redirect", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	o := &redirectOpts{}
	fs.Int64Var(&o.uid, "uid", -1, "the user whose TCP connections are redirected (required)")
	fs.IntVar(&o.port, "port", 0, "install: the transparent listener's port (default: asked of --control, GET /v1/endpoints)")
	fs.Var(listValue{&o.dns}, "dns", "install: `ADDR[:PORT]` of a resolver the uid may send DNS to (repeatable; default: the nameservers of /etc/resolv.conf); no other UDP leaves")
	o.controlFlags.define(fs, ", to learn the port")
	return fs, o
}

// redirectVerb installs or removes the kernel redirect of one uid in the
// current network namespace: the rules live in package redirect; this
// parses the command line and says what was done.
func (c *cli) redirectVerb(ctx context.Context, args []string) error {
	fs, o := c.redirectFlags()
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return flagError("redirect", err)
	}
	if len(pos) != 1 || (pos[0] != "install" && pos[0] != "remove") {
		return usagef("redirect", "want install or remove, got %q", pos)
	}
	if o.uid == -1 {
		return usagef("redirect", "--uid is required: the user id to redirect")
	}
	if why := redirect.CheckUID(o.uid); why != "" {
		return usagef("redirect", "--%s", why)
	}
	uid := uint32(o.uid)
	if pos[0] == "remove" {
		if o.port != 0 || len(o.dns) > 0 {
			return usagef("redirect", "--port and --dns are for install only")
		}
		if err := redirect.Remove(ctx, uid); err != nil {
			return err
		}
		fmt.Fprintf(c.stdout, "removed the redirect of uid %d (chains %s, iptables and ip6tables)\n", uid, redirect.ChainName(uid))
		return nil
	}
	if o.port < 0 || o.port > 65535 {
		return usagef("redirect", "--port %d: want 1 to 65535", o.port)
	}
	dns, err := resolvers(o.dns)
	if err != nil {
		return usagef("redirect", "--dns: %v", err)
	}
	port := o.port
	if port == 0 {
		if port, err = c.transparentPort(ctx, o); err != nil {
			return err
		}
	}
	if err := redirect.Install(ctx, redirect.Rules{UID: uid, Port: uint16(port), DNS: dns}); err != nil {
		return err
	}
	fmt.Fprintf(c.stdout, "redirected uid %d: every TCP connection it opens goes to port %d, its other traffic is refused but DNS to %s (chains %s)\n", uid, port, addrList(dns), redirect.ChainName(uid))
	return nil
}

// transparentPort asks the control API where the transparent listener is.
func (c *cli) transparentPort(ctx context.Context, o *redirectOpts) (int, error) {
	cl, err := c.controlClient("redirect", o.controlFlags)
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

// resolvers are the resolvers --dns names, else those of /etc/resolv.conf.
func resolvers(flags []string) ([]netip.AddrPort, error) {
	if len(flags) == 0 {
		return redirect.Resolvers(redirect.ResolvConf)
	}
	out := make([]netip.AddrPort, 0, len(flags))
	for _, f := range flags {
		ap, err := redirect.ParseResolver(f)
		if err != nil {
			return nil, err
		}
		out = append(out, ap)
	}
	return out, nil
}

func addrList(as []netip.AddrPort) string {
	s := make([]string, len(as))
	for i, a := range as {
		s[i] = a.String()
	}
	return strings.Join(s, ", ")
}
