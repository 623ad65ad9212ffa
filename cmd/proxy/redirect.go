package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"strconv"

	"github.com/stopgate/stopgate/redirect"
)

// redirectOpts are the flags of stopgate redirect.
type redirectOpts struct {
	uid  int64
	port int
	controlFlags
}

func (c *cli) redirectFlags() (*flag.FlagSet, *redirectOpts) {
	fs := flag.NewFlagSet("redirect", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	o := &redirectOpts{}
	fs.Int64Var(&o.uid, "uid", -1, "the user whose TCP connections are redirected (required)")
	fs.IntVar(&o.port, "port", 0, "install: the transparent listener's port (default: asked of --control, GET /v1/endpoints)")
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
	if o.uid < 0 || o.uid > 1<<32-2 {
		return usagef("redirect", "--uid is required: the user id to redirect (0 to %d)", int64(1<<32-2))
	}
	uid := uint32(o.uid)
	if pos[0] == "remove" {
		if o.port != 0 {
			return usagef("redirect", "--port is for install only")
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
	port := o.port
	if port == 0 {
		if port, err = c.transparentPort(ctx, o); err != nil {
			return err
		}
	}
	if err := redirect.Install(ctx, redirect.Rules{UID: uid, Port: uint16(port)}); err != nil {
		return err
	}
	fmt.Fprintf(c.stdout, "redirected uid %d: every TCP connection it opens goes to port %d, its other traffic but DNS is refused (chains %s)\n", uid, port, redirect.ChainName(uid))
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
