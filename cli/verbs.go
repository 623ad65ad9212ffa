package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/control/client"
	"github.com/stopgate/stopgate/state"
)

// DefaultControlURL is where the client verbs look for the control API.
const DefaultControlURL = "http://127.0.0.1:8081"

// verbOpts holds the flags of every client verb; each verb defines the
// ones it takes.
type verbOpts struct {
	control   string
	token     string
	tokenFile string
	dataDir   string
	json      bool
	reason    string
	drain     *time.Duration
	wait      bool
	tombstone bool
	// runs
	prefix, since, sort string
	limit               int
	version             int64
	status              string
	// resolve
	applied, notApplied bool
	note, source        string
	// claim and retry
	worker string
	lease  *time.Duration
	at     string
	// browser
	run string
	// token
	ttl *time.Duration
	// admit
	admission
}

func (c *cli) verbFlags(verb string) (*flag.FlagSet, *verbOpts) {
	fs := flag.NewFlagSet(verb, flag.ContinueOnError)
	fs.SetOutput(io.Discard) // errors are reported once, by run
	fs.Usage = func() {}     // -h is answered by run, other errors name the flag
	o := &verbOpts{}
	// Defaults come from the environment after parsing, so -h never
	// prints a token.
	fs.StringVar(&o.control, "control", "", "control API URL (default $STOPGATE_CONTROL, else "+DefaultControlURL+")")
	fs.StringVar(&o.token, "token", "", "bearer `token` for the control API (visible in ps: prefer $STOPGATE_CONTROL_TOKEN or --token-file); default: see --data-dir")
	fs.StringVar(&o.tokenFile, "token-file", "", "`file` holding the bearer token (default $STOPGATE_CONTROL_TOKEN_FILE)")
	fs.StringVar(&o.dataDir, "data-dir", "", "serve's data `directory`, where the operator token is read when no token is given (default $STOPGATE_DATA_DIR, else "+control.DefaultDataDir+" when --control is on this machine)")
	if verb != "ca" { // ca prints the PEM, nothing else
		fs.BoolVar(&o.json, "json", false, "print the API's JSON object instead of text")
	}
	switch verb {
	case "admit":
		fs.StringVar(&o.reason, "reason", "", "why, for the audit log")
		o.admission.define(fs)
	case "cancel":
		fs.StringVar(&o.reason, "reason", "", "why, for the audit log")
		fs.Func("drain", "`duration` in-flight work may finish, e.g. 30s or 30 (default: the server's --drain-timeout)", func(s string) error {
			d, err := control.ParseDuration(s)
			if err != nil {
				return err
			}
			if err := state.CheckDrainTimeout(d); err != nil {
				return errors.New(state.Why(err))
			}
			o.drain = &d
			return nil
		})
		fs.BoolVar(&o.wait, "wait", false, "wait until the run leaves CANCELLING, then summarize")
		fs.BoolVar(&o.tombstone, "tombstone", false, "RUN may be an id never seen: its CANCELLED tombstone is meant (without it, that exits 4)")
	case "store":
		fs.StringVar(&o.reason, "reason", "", "what was done about the runs the store lost (required), for the store's marker and the log")
	case "complete":
		fs.Int64Var(&o.version, "version", 0, "the cancel_version to complete at (default: the run's current one)")
		fs.StringVar(&o.reason, "reason", "", "why, for the audit log")
	case "runs":
		fs.StringVar(&o.status, "status", "", "only runs with this status: ACTIVE, CANCELLING, CANCELLED, COMPLETED, UNKNOWN")
		fs.StringVar(&o.prefix, "prefix", "", "only runs whose id starts with this")
		fs.StringVar(&o.since, "since", "", "only runs updated since this `time`: RFC 3339 (2026-12-01T10:00:00Z) or a duration back from now (90m, 24h)")
		fs.StringVar(&o.sort, "sort", "", "`order`: id (default), updated or created (those two newest first)")
		fs.IntVar(&o.limit, "limit", 0, "at most this many runs (0: all); the output says how many more matched")
	case "resolve":
		fs.BoolVar(&o.applied, "applied", false, "the effect happened")
		fs.BoolVar(&o.notApplied, "not-applied", false, "the effect did not happen")
		fs.StringVar(&o.note, "note", "", "what you found, and where, for the audit log")
		fs.StringVar(&o.source, "source", "", "where the answer came from (default operator)")
	case "token":
		ttlFlag(fs, &o.ttl, "ttl", "`duration` the token is good for, e.g. 24h or 86400 (default 24h)")
	case "claim":
		fs.Int64Var(&o.version, "version", 0, "the cancel_version the worker observed (default: none, the run must be ACTIVE)")
		fs.StringVar(&o.worker, "worker", "", "who holds the claim's lease (default: cli:$USER)")
		ttlFlag(fs, &o.lease, "lease", "`duration` of the claim's lease, e.g. 10m or 600 (default: the server's, 10m)")
	case "browser":
		fs.StringVar(&o.run, "run", "", "the run the browser belongs to (required)")
		fs.Int64Var(&o.version, "version", 0, "the cancel_version the agent observed, checked by every action (default: the run's at the launch)")
	case "retry":
		fs.Int64Var(&o.version, "version", 0, "the cancel_version observed (default: none, the run must be ACTIVE)")
		fs.StringVar(&o.at, "at", "", "RFC 3339 `time` the retry may start, e.g. 2026-01-02T10:00:00Z (required)")
	}
	return fs, o
}

// controlFlags are the flags of a verb that is not a client verb itself
// (exec, redirect) but asks the control API something: the client verbs'
// --control and --token, handed to them to find the API and its token the
// same way.
type controlFlags struct {
	control, token, tokenFile, dataDir string
}

func (f *controlFlags) define(fs *flag.FlagSet, why string) {
	fs.StringVar(&f.control, "control", "", "control API URL"+why+" (default $STOPGATE_CONTROL, else "+DefaultControlURL+")")
	fs.StringVar(&f.token, "token", "", "bearer token for the control API (visible in ps: prefer $STOPGATE_CONTROL_TOKEN or --token-file; default: as every client verb finds it)")
	fs.StringVar(&f.tokenFile, "token-file", "", "`file` holding the bearer token (default $STOPGATE_CONTROL_TOKEN_FILE)")
	fs.StringVar(&f.dataDir, "data-dir", "", "serve's data `directory`, where the operator token is read when no token is given")
}

// controlClient is the control API's client as the client verbs would build it
// from these flags.
func (c *cli) controlClient(verb string, f controlFlags) (*client.Client, error) {
	args := []string{}
	if f.control != "" {
		args = append(args, "--control", f.control)
	}
	for flag, v := range map[string]string{"--token": f.token, "--token-file": f.tokenFile, "--data-dir": f.dataDir} {
		if v != "" {
			args = append(args, flag, v)
		}
	}
	cl, _, _, err := c.parseVerb(verb, args)
	return cl, err
}

// parseVerb parses a client verb's command line, checks it has exactly the
// positional arguments named (RUN for most verbs), and returns a client.
func (c *cli) parseVerb(verb string, args []string, names ...string) (*client.Client, *verbOpts, []string, error) {
	fs, o := c.verbFlags(verb)
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return nil, nil, nil, flagError(verb, err)
	}
	switch {
	case len(pos) == len(names):
	case len(names) == 0:
		return nil, nil, nil, usagef(verb, "takes no arguments, got %q", pos)
	case len(pos) < len(names):
		return nil, nil, nil, usagef(verb, "missing %s", strings.Join(names[len(pos):], " "))
	case len(names) == 1:
		return nil, nil, nil, usagef(verb, "want one %s, got %d arguments %q", names[0], len(pos), pos)
	default:
		return nil, nil, nil, usagef(verb, "want %s, got %d arguments %q", strings.Join(names, " "), len(pos), pos)
	}
	for i, name := range names {
		// Ids that go into a URL path are checked here too, so that one
		// the API would refuse is a usage error (exit 2).
		var err error
		switch name {
		case "RUN":
			err = state.ValidateRunID(pos[i])
		case "KEY":
			err = state.ValidateKey(pos[i])
		}
		if err != nil {
			return nil, nil, nil, usagef(verb, "%s", state.Why(err))
		}
	}
	if o.version < 0 {
		return nil, nil, nil, usagef(verb, "--version %d: want a cancel_version of 1 or more", o.version)
	}
	if o.control == "" {
		o.control = c.getenv("STOPGATE_CONTROL")
	}
	if o.control == "" {
		o.control = DefaultControlURL
	}
	token, from, err := c.findToken(o)
	if err != nil {
		return nil, nil, nil, err
	}
	c.tokenFrom, c.token = from, token
	cl, err := client.New(o.control, client.Options{Token: token, Actor: c.actor()})
	if err != nil {
		return nil, nil, nil, usagef(verb, "--control (or STOPGATE_CONTROL): %v", err)
	}
	return cl, o, pos, nil
}

// findToken finds the bearer token, first found wins: --token,
// --token-file, $STOPGATE_CONTROL_TOKEN, $STOPGATE_CONTROL_TOKEN_FILE,
// $STOPGATE_TOKEN (the name of older releases), then the operator token
// serve wrote into its data directory (--data-dir, $STOPGATE_DATA_DIR, or
// ./stopgate-data). The default directory is read only when --control is
// on this machine, so that a local token is never sent to another host
// unless asked. from says where the token came from, for the messages.
func (c *cli) findToken(o *verbOpts) (token, from string, err error) {
	if o.token != "" {
		return o.token, "--token", nil
	}
	readFile := func(path, name string) (string, string, error) {
		t, _, err := control.ReadSecretFile(path)
		if err != nil {
			return "", "", usagef("", "%s: %v", name, err)
		}
		return t, name + " " + path, nil
	}
	if o.tokenFile != "" {
		return readFile(o.tokenFile, "--token-file")
	}
	for _, name := range []string{"STOPGATE_CONTROL_TOKEN", "STOPGATE_TOKEN"} {
		if t := c.getenv(name); t != "" {
			return t, "$" + name, nil
		}
		if name == "STOPGATE_CONTROL_TOKEN" {
			if p := c.getenv("STOPGATE_CONTROL_TOKEN_FILE"); p != "" {
				return readFile(p, "$STOPGATE_CONTROL_TOKEN_FILE")
			}
		}
	}
	dir, explicit := o.dataDir, true
	if dir == "" {
		dir = c.getenv("STOPGATE_DATA_DIR")
	}
	if dir == "" {
		dir, explicit = control.DefaultDataDir, false
		if !localURL(o.control) {
			return "", "", nil
		}
	}
	path := filepath.Join(dir, control.OperatorTokenFile)
	t, _, err := control.ReadSecretFile(path)
	switch {
	case err == nil:
		return t, path, nil
	case errors.Is(err, fs.ErrNotExist) && !explicit:
		// No token here: the server's 401 says what to do.
		return "", "", nil
	case errors.Is(err, fs.ErrPermission):
		return "", "", fmt.Errorf("the operator token %s: %w (run as the user that runs stopgate serve, or pass STOPGATE_CONTROL_TOKEN)", path, err)
	}
	return "", "", fmt.Errorf("the operator token: %w", err)
}

// localURL reports whether the control URL names this machine.
func localURL(raw string) bool {
	u, err := url.Parse(raw)
	if err != nil {
		return false
	}
	host := u.Hostname()
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// actor names the operator in the audit log: cli:$USER, or the OS's name
// for this process's user when $USER is unset (cron, systemd, a container),
// or its uid when the OS has no name for it.
func (c *cli) actor() string {
	name := c.getenv("USER")
	if name == "" {
		if u, err := user.Current(); err == nil && u.Username != "" {
			name = u.Username
		} else {
			name = "uid-" + strconv.Itoa(os.Getuid())
		}
	}
	user := name
	a := []byte("cli:")
	for i := 0; i < len(user) && len(a) < control.MaxActorLen; i++ {
		if b := user[i]; b >= 0x21 && b <= 0x7e {
			a = append(a, b)
		}
	}
	return string(a)
}

// printJSON writes the API's object as it came, one per line.
func (c *cli) printJSON(body []byte) {
	fmt.Fprintf(c.stdout, "%s\n", body)
}

// show prints what the API answered: with --json its body as it came, else
// the human form.
func show[T any](c *cli, o *verbOpts, reply client.Reply[T], err error, human func(io.Writer, T)) error {
	if err != nil {
		return err
	}
	if o.json {
		c.printJSON(reply.Body)
		return nil
	}
	human(c.stdout, reply.Value)
	return nil
}

// admission is what a new run is admitted with beyond its id: the budget
// flags and the labels that choose the policy's budget rule. admit and
// exec --admit take the same flags.
type admission struct {
	budget control.BudgetRequest
	labels map[string]string
}

// define adds the budget flags and --label to fs.
func (a *admission) define(fs *flag.FlagSet) {
	b := &a.budget
	for _, l := range []struct {
		name, what string
		into       *int64
	}{
		{"max-effects", "effects the run may make (each dispatch through any boundary)", &b.MaxEffects},
		{"max-effects-per-destination", "effects to any one destination (host)", &b.MaxEffectsPerDestination},
		{"max-request-bytes", "request body bytes, summed", &b.MaxRequestBytes},
		{"max-response-bytes", "answer body bytes, summed", &b.MaxResponseBytes},
		{"max-input-tokens", "LLM input tokens", &b.MaxInputTokens},
		{"max-output-tokens", "LLM output tokens", &b.MaxOutputTokens},
		{"max-tokens", "LLM input and output tokens together", &b.MaxTokens},
	} {
		fs.Func(l.name, "`N` "+l.what+"; past it the run is cancelled (budget:"+strings.ReplaceAll(l.name, "-", "_")+")", func(s string) error {
			n, err := strconv.ParseInt(s, 10, 64)
			if err != nil || n < 1 {
				return fmt.Errorf("%q is not a whole number of 1 or more", s)
			}
			*l.into = n
			return nil
		})
	}
	fs.Func("max-wall-time", "`duration` from admission after which no effect is admitted and the run is cancelled, e.g. 2h", func(s string) error {
		d, err := time.ParseDuration(s)
		if err != nil || d <= 0 {
			return fmt.Errorf("%q is not a positive duration like 2h", s)
		}
		b.MaxWallTime = d.String()
		return nil
	})
	fs.Func("max-spend-usd", "`USD` the run's LLM usage may cost by the policy's price table, e.g. 5 or 0.25", func(s string) error {
		if _, err := state.ParseUSD(s); err != nil {
			return err
		}
		b.MaxSpendUSD = json.Number(s)
		return nil
	})
	fs.BoolVar(&b.CancelOnUnknownUsage, "cancel-on-unknown-usage", false, "cancel the run at the first LLM answer whose usage cannot be read")
	fs.Func("budget-drain", "`duration` a run its budget cancels drains (default: the policy's, else the server's --drain-timeout)", func(s string) error {
		d, err := control.ParseDuration(s)
		if err != nil || d < 0 {
			return fmt.Errorf("%q is not a duration like 30s", s)
		}
		b.DrainTimeout = d.String()
		return nil
	})
	fs.Func("label", "`name=value` that chooses the policy's budget rule (repeatable; not stored)", func(s string) error {
		k, v, ok := strings.Cut(s, "=")
		if !ok || k == "" {
			return fmt.Errorf("%q is not name=value", s)
		}
		if a.labels == nil {
			a.labels = map[string]string{}
		}
		a.labels[k] = v
		return nil
	})
}

// given reports whether any budget flag or label was given.
func (a *admission) given() bool {
	return a.budget != (control.BudgetRequest{}) || len(a.labels) > 0
}

// request is the admission of runID with reason.
func (a *admission) request(runID, reason string) control.AdmitRequest {
	req := control.AdmitRequest{RunID: runID, Reason: reason, Labels: a.labels}
	if a.budget != (control.BudgetRequest{}) {
		req.Budget = &a.budget
	}
	return req
}

func (c *cli) admit(ctx context.Context, args []string) error {
	cl, o, pos, err := c.parseVerb("admit", args, "RUN")
	if err != nil {
		return err
	}
	reply, err := cl.AdmitWith(ctx, o.request(pos[0], o.reason))
	return show(c, o, reply, err, func(w io.Writer, run state.Run) {
		if reply.StatusCode == http.StatusCreated {
			fmt.Fprintf(w, "admitted %s: %s at cancel_version %d\n", safe(run.ID), run.Status, run.CancelVersion)
		} else {
			fmt.Fprintf(w, "%s was already %s at cancel_version %d (an admission changes nothing of it, its budget included)\n", safe(run.ID), run.Status, run.CancelVersion)
		}
		if run.Budget.Limited() {
			fmt.Fprintf(w, "budget: %s\n", budgetLine(run.Budget))
		}
	})
}

func (c *cli) cancel(ctx context.Context, args []string) error {
	cl, o, pos, err := c.parseVerb("cancel", args, "RUN")
	if err != nil {
		return err
	}
	reply, err := cl.Cancel(ctx, pos[0], client.CancelOptions{Reason: o.reason, Drain: o.drain})
	if err != nil {
		return err
	}
	if reply.Value.Tombstone && !o.tombstone {
		// The contract's tombstone is written (the id can never start);
		// a script that mistyped the id learns it did not stop its run.
		if o.json {
			c.printJSON(reply.Body)
		} else {
			printCancel(c.stdout, reply.Value)
		}
		return &exitCodeError{code: ExitTombstone, msg: fmt.Sprintf(
			"%s was never admitted: no run of that id was stopped; its CANCELLED tombstone is written, so it can never start. "+
				"If you meant another run, check its id (stopgate runs --prefix …); pass --tombstone when cancelling an id never seen is meant", safe(pos[0]))}
	}
	if !o.wait {
		if o.json {
			c.printJSON(reply.Body)
		} else {
			printCancel(c.stdout, reply.Value)
		}
		return nil
	}
	if !o.json {
		printCancel(c.stdout, reply.Value)
	}
	return c.waitCancel(ctx, cl, o, reply.Value.Run)
}

// waitCancel polls the row until it leaves CANCELLING, bounded by the
// drain deadline plus waitSlack, then says how the run ended.
func (c *cli) waitCancel(ctx context.Context, cl *client.Client, o *verbOpts, run state.Run) error {
	bound := c.waitSlack
	if !run.DrainDeadline.IsZero() {
		bound += max(time.Until(run.DrainDeadline), 0)
	}
	waitCtx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	reply, err := cl.WaitSettled(waitCtx, run.ID, c.pollEvery)
	if err != nil {
		return err
	}
	if o.json {
		c.printJSON(reply.Body)
	}
	final := reply.Value
	switch final.Status {
	case state.StatusCancelled:
		if !o.json {
			printFinal(c.stdout, final)
		}
		return nil
	case state.StatusUnknown:
		if !o.json {
			printFinal(c.stdout, final)
			intents, err := cl.Intents(ctx, final.ID)
			if err != nil {
				return &exitCodeError{code: ExitUnknown, msg: fmt.Sprintf("listing the UNKNOWN intents: %v", err)}
			}
			printUnknown(c.stdout, final.ID, intents.Value.Intents)
		}
		return &exitCodeError{code: ExitUnknown}
	case state.StatusCancelling:
		return fmt.Errorf("%s is still CANCELLING after waiting %s (drain deadline %s plus %s); is the sweeper of stopgate serve running?",
			safe(final.ID), bound.Round(100*time.Millisecond), fmtTime(final.DrainDeadline), c.waitSlack)
	default:
		// Nothing else can follow a cancel; say what the row says.
		return fmt.Errorf("%s is %s at cancel_version %d", safe(final.ID), final.Status, final.CancelVersion)
	}
}

func (c *cli) complete(ctx context.Context, args []string) error {
	cl, o, pos, err := c.parseVerb("complete", args, "RUN")
	if err != nil {
		return err
	}
	version := o.version
	if version == 0 {
		// Completing at the version just read still refuses a run that is
		// cancelled in between: the store compares it atomically.
		cur, err := cl.Run(ctx, pos[0])
		if err != nil {
			return err
		}
		version = cur.Value.CancelVersion
	}
	reply, err := cl.Complete(ctx, pos[0], version, o.reason)
	return show(c, o, reply, err, func(w io.Writer, run state.Run) {
		fmt.Fprintf(w, "completed %s at cancel_version %d\n", safe(run.ID), run.CancelVersion)
	})
}

func (c *cli) status(ctx context.Context, args []string) error {
	cl, o, pos, err := c.parseVerb("status", args, "RUN")
	if err != nil {
		return err
	}
	reply, err := cl.Run(ctx, pos[0])
	return show(c, o, reply, err, printRun)
}

func (c *cli) runs(ctx context.Context, args []string) error {
	cl, o, _, err := c.parseVerb("runs", args)
	if err != nil {
		return err
	}
	// The API reads the same query; parsed here first, a bad flag is a
	// usage error (exit 2) naming the flag.
	v := url.Values{"status": {o.status}, "prefix": {o.prefix}, "since": {o.since}, "sort": {o.sort}}
	if o.limit != 0 {
		v.Set("limit", strconv.Itoa(o.limit))
	}
	q, err := control.ParseRunQuery(v, time.Now())
	if err != nil {
		return usagef("runs", "--%s", state.Why(err))
	}
	reply, err := cl.RunsWhere(ctx, q)
	return show(c, o, reply, err, func(w io.Writer, list control.RunList) {
		printRuns(w, list.Runs)
		if list.More > 0 {
			fmt.Fprintf(w, "… and %d more (--limit %d)\n", list.More, q.Limit)
		}
	})
}

func (c *cli) audit(ctx context.Context, args []string) error {
	cl, o, pos, err := c.parseVerb("audit", args, "RUN")
	if err != nil {
		return err
	}
	reply, err := cl.Audit(ctx, pos[0])
	return show(c, o, reply, err, printAudit)
}

func (c *cli) resolve(ctx context.Context, args []string) error {
	cl, o, pos, err := c.parseVerb("resolve", args, "RUN", "KEY")
	if err != nil {
		return err
	}
	if o.applied == o.notApplied {
		return usagef("resolve", "give exactly one of --applied and --not-applied")
	}
	outcome := control.OutcomeNotApplied
	if o.applied {
		outcome = control.OutcomeApplied
	}
	reply, err := cl.Resolve(ctx, pos[0], pos[1], control.ResolveRequest{Outcome: outcome, Source: o.source, Note: o.note})
	return show(c, o, reply, err, func(w io.Writer, in state.Intent) {
		fmt.Fprintf(w, "recorded %s of %s as %s (source %s)\n", safe(in.Key), safe(in.RunID), in.State, safe(in.Source))
		printIntent(w, in)
	})
}

// ca prints the MITM CA certificate exactly as served, so that
// "stopgate ca > ca.pem" is the file workers trust.
func (c *cli) ca(ctx context.Context, args []string) error {
	cl, _, _, err := c.parseVerb("ca", args)
	if err != nil {
		return err
	}
	pem, err := cl.CA(ctx)
	if err != nil {
		return err
	}
	_, err = c.stdout.Write(pem)
	return err
}

func (c *cli) claim(ctx context.Context, args []string) error {
	cl, o, pos, err := c.parseVerb("claim", args, "RUN", "STEP")
	if err != nil {
		return err
	}
	req := control.ClaimRequest{StepID: pos[1], CancelVersion: o.version, Worker: o.worker}
	if o.lease != nil {
		ttl := control.TTL(*o.lease)
		req.LeaseTTL = &ttl
	}
	reply, err := cl.Claim(ctx, pos[0], req)
	return show(c, o, reply, err, func(w io.Writer, g control.GuardResponse) {
		in := g.Intent
		fmt.Fprintf(w, "claimed %s of %s: attempt %d, leased to %s until %s\n",
			safe(pos[1]), safe(in.RunID), in.Attempts, safe(in.LeaseOwner), fmtTime(in.LeaseExpires))
		printIntent(w, in)
	})
}

func (c *cli) retry(ctx context.Context, args []string) error {
	cl, o, pos, err := c.parseVerb("retry", args, "RUN", "STEP", "ATTEMPT")
	if err != nil {
		return err
	}
	attempt, err := strconv.Atoi(pos[2])
	if err != nil || attempt < 1 {
		return usagef("retry", "ATTEMPT %q: want a number of 1 or more", pos[2])
	}
	if o.at == "" {
		return usagef("retry", "--at is required: the RFC 3339 time the retry may start")
	}
	at, err := time.Parse(time.RFC3339, o.at)
	if err != nil {
		return usagef("retry", "--at %q: want an RFC 3339 time such as 2026-01-02T10:00:00Z", o.at)
	}
	reply, err := cl.Retry(ctx, pos[0], control.RetryRequest{StepID: pos[1], Attempt: attempt, NotBefore: at.Format(time.RFC3339Nano), CancelVersion: o.version})
	return show(c, o, reply, err, func(w io.Writer, g control.GuardResponse) {
		in := g.Intent
		fmt.Fprintf(w, "scheduled attempt %d of %s of %s at %s; a cancel revokes it until then\n",
			attempt, safe(pos[1]), safe(in.RunID), fmtTime(in.NotBefore))
		printIntent(w, in)
	})
}

// browser asks stopgate serve for the run's guarded browser and prints its
// websocket URL alone on the first line, for an agent to connect to. The
// browser lives in stopgate serve until the run is over: this returns.
func (c *cli) browser(ctx context.Context, args []string) error {
	cl, o, _, err := c.parseVerb("browser", args)
	if err != nil {
		return err
	}
	if o.run == "" {
		return usagef("browser", "--run is required: the run the browser belongs to")
	}
	if err := state.ValidateRunID(o.run); err != nil {
		return usagef("browser", "--run: %s", state.Why(err))
	}
	reply, err := cl.Browser(ctx, o.run, control.BrowserRequest{CancelVersion: o.version})
	return show(c, o, reply, err, func(w io.Writer, b control.BrowserResponse) {
		fmt.Fprintln(w, b.WSURL)
		how := "launched"
		if !b.Created {
			how = "already running (recorded as an attach)"
		}
		fmt.Fprintf(c.stderr, "browser of %s %s in stopgate serve; once the run is over it refuses actions and stops after serve's --browser-linger. Every action is checked against cancel_version %d.\n",
			safe(b.RunID), how, b.CancelVersion)
	})
}

// runToken prints a signed run token alone on one line, so that
// "RUN:$(stopgate token RUN)" is the worker's proxy password.
func (c *cli) runToken(ctx context.Context, args []string) error {
	cl, o, pos, err := c.parseVerb("token", args, "RUN")
	if err != nil {
		return err
	}
	var req control.TokenRequest
	if o.ttl != nil {
		ttl := control.TTL(*o.ttl)
		req.TTL = &ttl
	}
	reply, err := cl.Token(ctx, pos[0], req)
	return show(c, o, reply, err, func(w io.Writer, t control.TokenResponse) { fmt.Fprintln(w, t.Token) })
}
