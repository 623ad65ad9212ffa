// Package cli is stopgate's command line: its verbs, their flags, their
// usage (usage.go, the one text `stopgate help` prints and docs/cli.md is
// checked against), the exit codes, and the text the client verbs print of
// the control API's answers.
//
// The client verbs call the control API through control/client; serve is
// package serve's, exec package agentexec's, redirect package redirect's:
// for those this package reads the command line and says what was done. It
// never decides a run's state nor guards an effect, opens no listener and
// reads no store: what it knows of a run is what the control API answers.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/control/client"
	"github.com/stopgate/stopgate/serve"
)

// Exit codes, documented in docs/cli.md.
const (
	ExitOK      = 0
	ExitError   = 1 // the API refused, the store or the network failed
	ExitUsage   = 2 // bad verb, flag or argument
	ExitUnknown = 3 // cancel --wait: the run ended UNKNOWN
	// ExitTombstone: cancel wrote the tombstone of a run never seen (a
	// mistyped id, most often), without --tombstone.
	ExitTombstone = 4
)

// Env is what one invocation reads and writes: its streams, and its
// environment (os.Getenv, or a test's map).
type Env struct {
	Stdin          io.Reader
	Stdout, Stderr io.Writer
	Getenv         func(string) string
}

// Run runs one command line (the arguments after the program's name) until
// it is done or ctx ends, and returns its exit code.
func Run(ctx context.Context, args []string, env Env) int {
	c := newCLI(env.Stdout, env.Stderr, env.Getenv)
	if env.Stdin != nil {
		c.stdin = env.Stdin
	}
	return c.run(ctx, args)
}

// cli is one invocation: where it writes and what environment it reads,
// so tests can run it in-process.
type cli struct {
	stdin          io.Reader
	stdout, stderr io.Writer
	getenv         func(string) string
	// pollEvery is how often cancel --wait reads the row, and waitSlack how
	// long it waits past the drain deadline for the sweeper.
	pollEvery time.Duration
	waitSlack time.Duration
	// tokenFrom says where the client verb's bearer token came from
	// (empty: none was found), for the hint on a 401; token is that token.
	tokenFrom string
	token     string
}

func newCLI(stdout, stderr io.Writer, getenv func(string) string) *cli {
	return &cli{stdin: os.Stdin, stdout: stdout, stderr: stderr, getenv: getenv, pollEvery: 250 * time.Millisecond, waitSlack: 10 * time.Second}
}

// usageError is a mistake in the command line: exit 2 with a hint.
type usageError struct {
	verb string
	msg  string
}

func (e *usageError) Error() string { return e.msg }

func usagef(verb, format string, args ...any) error {
	return &usageError{verb: verb, msg: fmt.Sprintf(format, args...)}
}

// exitCodeError carries an exit code other than 1 for an outcome that is
// not a failure of the command itself (cancel --wait ending UNKNOWN).
type exitCodeError struct {
	code int
	msg  string
}

func (e *exitCodeError) Error() string { return e.msg }

func (c *cli) run(ctx context.Context, args []string) int {
	if len(args) == 0 {
		fmt.Fprint(c.stderr, mainUsage())
		return ExitUsage
	}
	verb, rest := args[0], args[1:]
	err := c.dispatch(ctx, verb, rest)
	var ue *usageError
	var ee *exitCodeError
	switch {
	case err == nil:
		return ExitOK
	case errors.Is(err, flag.ErrHelp):
		_ = c.help([]string{verb})
		return ExitOK
	case errors.As(err, &ue):
		if ue.verb == "" {
			fmt.Fprintf(c.stderr, "stopgate: %s\nRun 'stopgate help' for usage.\n", ue.msg)
		} else {
			fmt.Fprintf(c.stderr, "stopgate %s: %s\nRun 'stopgate help %s' for usage.\n", ue.verb, ue.msg, ue.verb)
		}
		return ExitUsage
	case errors.As(err, &ee):
		if ee.msg != "" {
			fmt.Fprintf(c.stderr, "stopgate %s: %s\n", verb, ee.msg)
		}
		return ee.code
	default:
		fmt.Fprintf(c.stderr, "stopgate %s: %v\n", verb, err)
		if hint := c.authHint(err); hint != "" {
			fmt.Fprintf(c.stderr, "%s\n", hint)
		}
		return ExitError
	}
}

// authHint says, after a 401, which token was sent and where the right one
// is, since "unauthorized" alone does not tell an operator what to fix.
func (c *cli) authHint(err error) string {
	var ae *client.APIError
	if !errors.As(err, &ae) || ae.StatusCode != http.StatusUnauthorized {
		return ""
	}
	if c.tokenFrom == "" {
		return "No token was sent: none was given (--token, --token-file, $STOPGATE_CONTROL_TOKEN) and none was found in " + control.DefaultDataDir + "/" + control.OperatorTokenFile +
			". Run the CLI where stopgate serve keeps its data, or set --data-dir / $STOPGATE_DATA_DIR to serve's --data-dir."
	}
	return "The token from " + c.tokenFrom + " was refused: is it this server's? (its operator token is " + control.OperatorTokenFile + " in its --data-dir)"
}

func (c *cli) dispatch(ctx context.Context, verb string, args []string) error {
	switch verb {
	case "serve":
		return c.serve(ctx, args)
	case "admit":
		return c.admit(ctx, args)
	case "cancel":
		return c.cancel(ctx, args)
	case "complete":
		return c.complete(ctx, args)
	case "status":
		return c.status(ctx, args)
	case "runs":
		return c.runs(ctx, args)
	case "audit":
		return c.audit(ctx, args)
	case "resolve":
		return c.resolve(ctx, args)
	case "ca":
		return c.ca(ctx, args)
	case "claim":
		return c.claim(ctx, args)
	case "retry":
		return c.retry(ctx, args)
	case "browser":
		return c.browser(ctx, args)
	case "token":
		return c.runToken(ctx, args)
	case "exec":
		return c.execVerb(ctx, args)
	case "redirect":
		return c.redirectVerb(ctx, args)
	case "store":
		return c.storeVerb(ctx, args)
	case "help", "-h", "-help", "--help":
		return c.help(args)
	}
	return usagef("", "unknown verb %q", verb)
}

// serve is package serve's; a mistake in what it was told is a usage
// error like any verb's.
func (c *cli) serve(ctx context.Context, args []string) error {
	err := serve.Main(ctx, args, c.getenv, c.stderr)
	if ce := (*serve.ConfigError)(nil); errors.As(err, &ce) {
		return &usageError{verb: "serve", msg: ce.Error()}
	}
	return err
}

func (c *cli) help(args []string) error {
	if len(args) == 0 {
		fmt.Fprint(c.stdout, mainUsage())
		return nil
	}
	if len(args) > 1 {
		return usagef("help", "want at most one verb, got %d arguments", len(args))
	}
	text, ok := verbUsage(args[0])
	if !ok {
		return usagef("help", "unknown verb %q", args[0])
	}
	fmt.Fprint(c.stdout, text)
	if fs := c.flagSet(args[0]); fs != nil {
		fmt.Fprintln(c.stdout, "\nFlags:")
		fs.SetOutput(c.stdout)
		fs.PrintDefaults()
	}
	return nil
}

// flagSet returns the flags of a verb, for help; nil for a verb without.
func (c *cli) flagSet(verb string) *flag.FlagSet {
	switch verb {
	case "serve":
		return serve.Flags()
	case "admit", "cancel", "complete", "status", "runs", "audit", "resolve", "ca", "claim", "retry", "browser", "token", "store":
		fs, _ := c.verbFlags(verb)
		return fs
	case "exec":
		fs, _ := c.execFlags()
		return fs
	case "redirect":
		fs, _ := redirectFlags()
		return fs
	}
	return nil
}
