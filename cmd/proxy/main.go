// Command stopgate serves the egress proxy, the browser guard and the
// control API, and is the CLI on that API: admit, cancel, complete, status,
// runs, audit, resolve, ca, claim, retry, browser.
//
// This package holds flags and wiring only: the API is package control, its
// client control/client, the state package state and its stores.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/stopgate/stopgate/agentexec"
	"github.com/stopgate/stopgate/browserguard"
	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/control/client"
)

const execUsage = `Usage: stopgate exec --run RUN [--no-isolate | --isolate --uid UID] [--admit] [--cancel-signal SIG] -- CMD [ARGS...]

Runs CMD with its effects guarded and recorded under RUN, as you, and exits with CMD's status
(128+N when a signal N killed it); the signals stopgate receives are passed on to CMD.

By default CMD runs in a sandbox of its own (user, network, PID and mount namespaces; no root
needed): every TCP connection it opens, to any address, loopback included, is carried to the
egress proxy under RUN, whatever it does with proxy variables; DNS goes only to the resolvers
named (--dns, default /etc/resolv.conf's); nothing else leaves. A worker's run token
(stopgate token RUN) is all exec needs.

When RUN's cancel commits, exec writes it into $STOPGATE_CANCEL_FILE and sends CMD's processes
--cancel-signal (default TERM); at the drain deadline it kills them. Both are in the audit.
A run never admitted is refused unless --admit.

--no-isolate: only the proxy variables (both cases) and the CA variables; recorded in the
run's audit, and stderr lists the clients that go around them.
--isolate --uid UID (root): CMD runs as UID behind the kernel redirect to serve's
--transparent-addr, as before the sandbox existed.
`

const redirectUsage = `Usage: stopgate redirect install --uid UID [--port P] [--dns ADDR[:PORT]]...
       stopgate redirect remove --uid UID

install sends every TCP connection UID opens, in this network namespace, to the
transparent listener's port P (default: asked of --control) and refuses its other
traffic but DNS to the resolvers named (default /etc/resolv.conf's), with iptables and ip6tables (root or CAP_NET_ADMIN). Installing again
replaces the rules; remove takes them away (and is a no-op when there are none).
`

// Exit codes, documented in docs/cli.md.
const (
	exitOK      = 0
	exitError   = 1 // the API refused, the store or the network failed
	exitUsage   = 2 // bad verb, flag or argument
	exitUnknown = 3 // cancel --wait: the run ended UNKNOWN
	// exitTombstone: cancel wrote the tombstone of a run never seen (a
	// mistyped id, most often), without --tombstone.
	exitTombstone = 4
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == agentexec.InitVerb {
		// The first process of exec's sandbox: no verb of the CLI.
		os.Exit(agentexec.Init(os.Args[2:]))
	}
	// A browser's sandbox helper is this binary: it becomes Chromium here.
	browserguard.SandboxMain()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := newCLI(os.Stdout, os.Stderr, os.Getenv).run(ctx, os.Args[1:])
	stop()
	os.Exit(code)
}

// cli is one invocation: where it writes and what environment it reads,
// so tests can run it in-process.
type cli struct {
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
	return &cli{stdout: stdout, stderr: stderr, getenv: getenv, pollEvery: 250 * time.Millisecond, waitSlack: 10 * time.Second}
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
		fmt.Fprint(c.stderr, mainUsage)
		return exitUsage
	}
	verb, rest := args[0], args[1:]
	err := c.dispatch(ctx, verb, rest)
	var ue *usageError
	var ee *exitCodeError
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, flag.ErrHelp):
		_ = c.help([]string{verb})
		return exitOK
	case errors.As(err, &ue):
		if ue.verb == "" {
			fmt.Fprintf(c.stderr, "stopgate: %s\nRun 'stopgate help' for usage.\n", ue.msg)
		} else {
			fmt.Fprintf(c.stderr, "stopgate %s: %s\nRun 'stopgate help %s' for usage.\n", ue.verb, ue.msg, ue.verb)
		}
		return exitUsage
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
		return exitError
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

func (c *cli) help(args []string) error {
	if len(args) == 0 {
		fmt.Fprint(c.stdout, mainUsage)
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
		fs, _ := newServeFlags()
		return fs
	case "admit", "cancel", "complete", "status", "runs", "audit", "resolve", "ca", "claim", "retry", "browser", "token", "store":
		fs, _ := c.verbFlags(verb)
		return fs
	case "exec":
		fs, _ := c.execFlags()
		return fs
	case "redirect":
		fs, _ := c.redirectFlags()
		return fs
	}
	return nil
}

const mainUsage = `stopgate: durable cancellation of AI-agent runs, enforced where effects leave the machine.

Usage:
  stopgate serve [flags]                       run the egress proxy and the control API
  stopgate admit RUN                           create RUN ACTIVE at cancel_version 1
  stopgate cancel RUN [--reason R] [--drain D] [--wait] [--tombstone]
                                               stop RUN: no new work; in-flight work drains for D
  stopgate complete RUN [--version N]          mark RUN finished normally
  stopgate status RUN [--json]                 show RUN's row and intent counts
  stopgate runs [--status S] [--prefix P] [--since T] [--sort id|updated|created] [--limit N] [--json]
                                               list runs
  stopgate audit RUN [--json]                  every effect and every transition of RUN
  stopgate resolve RUN KEY --applied|--not-applied [--note N] [--source S]
                                               record what happened to an UNKNOWN effect
  stopgate ca                                  print the MITM CA certificate (PEM) workers must trust
  stopgate claim RUN STEP [--version N] [--worker W] [--lease D]
                                               claim a queued step, guarded like every effect
  stopgate retry RUN STEP ATTEMPT --at TIME [--version N]
                                               schedule a retry; a cancel revokes it
  stopgate browser --run RUN [--version N]     start RUN's guarded headless browser in serve; print its ws:// URL
  stopgate token RUN [--ttl D]                 print a run token: RUN's worker's credential (proxy password, API bearer)
  stopgate exec --run RUN [--no-isolate | --isolate --uid UID] -- CMD [ARGS...]
                                               run an unmodified agent in a sandbox behind the guard
  stopgate redirect install|remove --uid UID [--port P]
                                               send every TCP connection of UID to the transparent listener
  stopgate store acknowledge-reset --reason R  admit runs again on a Redis store that lost writes (after re-cancelling)
  stopgate help [VERB]                         this text, or a verb's flags

Client verbs talk to --control (default http://127.0.0.1:8081, or $STOPGATE_CONTROL) with a
bearer token: --token, --token-file, $STOPGATE_CONTROL_TOKEN, else the operator token serve
wrote on its first start into its data directory (--data-dir, $STOPGATE_DATA_DIR, or
./stopgate-data when --control is on this machine). Flags may come before or after RUN.
Exit status: 0 ok, 1 error, 2 usage, 3 cancel --wait ended UNKNOWN, 4 cancel wrote the tombstone of a
run never seen (without --tombstone).
`

func verbUsage(verb string) (string, bool) {
	switch verb {
	case "serve":
		return "Usage: stopgate serve [flags]\n\nServes the egress proxy on --proxy-addr, the browser guard on --browser-addr and the control\nAPI on --control-addr over the store (--store, or the embedded store in --data-dir). Every flag\ncan also be set as STOPGATE_<FLAG> (e.g. STOPGATE_CONTROL_ADDR); a flag on the command line wins.\n\nThe control API needs a bearer token. On the first start serve writes into --data-dir the\noperator token (" + control.OperatorTokenFile + "), a read-only token (" + control.ReadTokenFile + ") and the secret that signs\nrun tokens (" + control.RunTokenSecretFile + "), each 0600 and never overwritten, unless they are given\n(--control-token-file, --read-token-file, --run-token-secret-file). --control-auth=none opens\nthe control API to whoever reaches it.\n", true
	case "admit":
		return "Usage: stopgate admit RUN [--json]\n\nCreates RUN ACTIVE at cancel_version 1; an ACTIVE run is left as it is.\nA run that was cancelled or completed is refused (exit 1).\n", true
	case "cancel":
		return "Usage: stopgate cancel RUN [--reason R] [--drain D] [--wait] [--tombstone] [--json]\n\nMoves RUN to CANCELLING: nothing new of it starts, from now on, anywhere.\nIn-flight work may finish until the drain deadline (D, default the server's).\nA run never seen gets a CANCELLED tombstone so it can never start; since that is most often a\nmistyped id, cancel then says so on stderr and exits 4, unless --tombstone says it was meant.\nWith --wait, waits until RUN leaves CANCELLING (at most the drain deadline plus 10s)\nand exits 0 when CANCELLED, 3 when UNKNOWN, 1 when still CANCELLING.\n", true
	case "complete":
		return "Usage: stopgate complete RUN [--version N] [--json]\n\nMoves RUN from ACTIVE to COMPLETED, only if it is still at cancel_version N\n(default: the version it has now).\n", true
	case "status":
		return "Usage: stopgate status RUN [--json]\n\nShows RUN's row: status, cancel_version, reasons, times and intent counts.\n", true
	case "runs":
		return "Usage: stopgate runs [--status S] [--prefix P] [--since T] [--sort id|updated|created] [--limit N] [--json]\n\nLists runs, ordered by id (or newest updated or created first); S is ACTIVE, CANCELLING,\nCANCELLED, COMPLETED or UNKNOWN; P an id prefix; T a time (RFC 3339) or a duration back from now\n(90m): runs updated since then. With --limit N, the first N, and how many more matched.\n", true
	case "audit":
		return "Usage: stopgate audit RUN [--json]\n\nShows every intent (effect) of RUN and every transition of its audit log.\n", true
	case "resolve":
		return "Usage: stopgate resolve RUN KEY --applied|--not-applied [--note N] [--source S] [--json]\n\nRecords what you found out about an UNKNOWN effect of RUN (its intent KEY, as listed by\n'stopgate audit RUN' or 'stopgate cancel RUN --wait'): it happened (--applied) or it\ndid not (--not-applied). Once every UNKNOWN effect of a cancelled run is resolved, the\nrun becomes CANCELLED. The note, the source and who you are (operator (cli:$USER): the scope\nyour token proves, and the name you give) go to the audit log.\n", true
	case "ca":
		return "Usage: stopgate ca\n\nPrints the egress proxy's MITM CA certificate (PEM) exactly as served, and nothing\nelse: stopgate ca > ca.pem, then make workers trust ca.pem.\n", true
	case "claim":
		return "Usage: stopgate claim RUN STEP [--version N] [--worker W] [--lease D] [--json]\n\nClaims queued step STEP of RUN through the guard (intent claim:STEP), leased to W for D.\nRefused (exit 1) when RUN is not ACTIVE or not at cancel_version N, or STEP is claimed.\nFor operators and scripts; workers call POST /v1/runs/RUN/claims.\n", true
	case "retry":
		return "Usage: stopgate retry RUN STEP ATTEMPT --at TIME [--version N] [--json]\n\nSchedules attempt ATTEMPT of STEP of RUN for TIME (RFC 3339) through the guard\n(intent retry:STEP:ATTEMPT, SCHEDULED). A cancel of RUN revokes it until then.\n", true
	case "browser":
		return "Usage: stopgate browser --run RUN [--version N] [--json]\n\nAsks stopgate serve to start RUN's guarded headless Chromium (or finds the one it has) and\nprints the websocket URL to connect a CDP client to (Puppeteer, Playwright, chromedp)\nalone on the first line, then returns: the browser lives in stopgate serve until RUN is over\n(CANCELLED, COMPLETED or UNKNOWN) and serve's --browser-linger has passed, or serve stops.\nAsked again while it runs, it prints the same URL (recorded as an attach). Every action the\nclient sends is checked against cancel_version N and recorded; after a cancel it is refused.\n", true
	case "token":
		return "Usage: stopgate token RUN [--ttl D] [--json]\n\nPrints a signed run token for RUN at its current cancel_version, alone on one line, good for\nD (default 24h): the one credential of RUN's worker. It is the worker's proxy password\n(HTTPS_PROXY=http://RUN:TOKEN@host:port) or X-Run-Token header, and its bearer token on the\ncontrol API, where it may claim, schedule retries, guard effects and report outcomes for RUN\nonly, and never cancel, complete, resolve, admit or mint. Needs the operator token; refused\n(exit 1) unless RUN is ACTIVE.\n", true
	case "exec":
		return execUsage, true
	case "redirect":
		return redirectUsage, true
	case "store":
		return storeUsage, true
	case "help":
		return "Usage: stopgate help [VERB]\n", true
	}
	return "", false
}
