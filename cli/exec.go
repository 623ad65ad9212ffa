package cli

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"os"

	"github.com/stopgate/stopgate/agentexec"
	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/redirect"
	"github.com/stopgate/stopgate/state"
)

// DefaultIsolateUID is the user exec --isolate --uid runs CMD as by default: nobody.
const DefaultIsolateUID = 65534

// execOpts are the flags of stopgate exec.
type execOpts struct {
	run          string
	version      int64
	noIsolate    bool
	isolate      bool
	uid          int64
	uidSet       bool
	admit        bool
	proxy        string
	dns          []netip.AddrPort
	cancelSignal string
	admission
	controlFlags
}

func (c *cli) execFlags() (*flag.FlagSet, *execOpts) {
	fs := flag.NewFlagSet("exec", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	o := &execOpts{}
	fs.StringVar(&o.run, "run", "", "the run CMD's effects belong to (required)")
	fs.Int64Var(&o.version, "version", 0, "the cancel_version CMD observes (default: the run's now)")
	fs.BoolVar(&o.noIsolate, "no-isolate", false, "no sandbox: only the proxy and CA environment (recorded in the run's audit; clients that ignore it go around the guard)")
	fs.BoolVar(&o.isolate, "isolate", false, "with --uid (root): run CMD as that uid behind the kernel redirect to serve's --transparent-addr, instead of the sandbox")
	fs.Func("uid", "with --isolate (root): the `user` CMD runs as, nothing else may run as it (default 65534)", func(s string) error {
		_, err := fmt.Sscan(s, &o.uid)
		o.uidSet = true
		return err
	})
	fs.BoolVar(&o.admit, "admit", false, "admit RUN if it was never seen (operator token); without it such a run is refused, so a mistyped id is not a new run")
	o.admission.define(fs)
	fs.StringVar(&o.proxy, "proxy", "", "the egress proxy's `host:port` (default $STOPGATE_PROXY, else asked of --control when the token may, else "+agentexec.DefaultProxy+")")
	fs.Var(resolversFlag{&o.dns}, "dns", "`ADDR[:PORT]` of a resolver CMD's DNS is carried to (repeatable; default: the nameservers of /etc/resolv.conf); no other UDP leaves")
	fs.StringVar(&o.cancelSignal, "cancel-signal", "TERM", "the `signal` CMD's processes get when the run's cancel commits, or none")
	o.controlFlags.define(fs, "")
	return fs, o
}

// execVerb runs CMD behind the guard (package agentexec); this parses the
// command line and wires the control API's client in.
func (c *cli) execVerb(ctx context.Context, args []string) error {
	fs, o := c.execFlags()
	// Flags end at CMD: its own flags are its own.
	if err := fs.Parse(args); err != nil {
		return flagError("exec", err)
	}
	argv := fs.Args()
	switch {
	case o.run == "":
		return usagef("exec", "--run is required: the run CMD's effects belong to")
	case len(argv) == 0:
		return usagef("exec", "missing CMD: stopgate exec --run RUN [--no-isolate | --isolate --uid UID] -- CMD [ARGS...]")
	case o.version < 0:
		return usagef("exec", "--version %d: want a cancel_version of 1 or more", o.version)
	case o.uidSet && redirect.CheckUID(o.uid) != "":
		return usagef("exec", "--%s", redirect.CheckUID(o.uid))
	case o.noIsolate && (o.isolate || o.uidSet):
		return usagef("exec", "--no-isolate and --isolate/--uid: pick one")
	case o.uidSet && !o.isolate:
		return usagef("exec", "--uid is for --isolate (the kernel redirect, as root); the default sandbox runs CMD as you")
	case o.admission.given() && !o.admit:
		return usagef("exec", "the budget flags and --label are for --admit: they are what a run exec admits is admitted with (a run admitted before keeps its own budget)")
	case o.uidSet && o.uid == 0:
		return usagef("exec", "--uid 0: root is never redirected away from its own rules; pick an unprivileged uid")
	}
	if err := state.ValidateRunID(o.run); err != nil {
		return usagef("exec", "--run: %s", state.Why(err))
	}
	sig, err := agentexec.ParseSignal(o.cancelSignal)
	if err != nil {
		return usagef("exec", "--cancel-signal %v", err)
	}
	cl, err := c.controlClient("exec", o.controlFlags)
	if err != nil {
		return err
	}
	mode, uid := agentexec.Isolated, uint32(DefaultIsolateUID)
	switch {
	case o.noIsolate:
		mode = agentexec.Unisolated
	case o.isolate && o.uidSet:
		mode, uid = agentexec.KernelRedirect, uint32(o.uid)
	case o.isolate && os.Geteuid() == 0:
		// --isolate as root keeps meaning the kernel redirect of nobody.
		mode = agentexec.KernelRedirect
	}
	var admit *control.AdmitRequest
	if o.admit {
		req := o.request(o.run, "stopgate exec --admit")
		admit = &req
	}
	err = agentexec.Run(ctx, agentexec.Options{
		Client: cl, Token: c.token, Run: o.run, Version: o.version, Argv: argv, Mode: mode, UID: uid,
		Admit: admit, Proxy: cmp.Or(o.proxy, c.getenv("STOPGATE_PROXY")), DNS: o.dns, CancelSignal: sig,
		Stdin: c.stdin, Stdout: c.stdout, Stderr: c.stderr,
	})
	var ee *agentexec.ExitError
	if errors.As(err, &ee) {
		return &exitCodeError{code: ee.Code}
	}
	return err
}
