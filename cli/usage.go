package cli

import (
	"fmt"
	"strings"

	"github.com/stopgate/stopgate/control"
)

// verb is one verb of the command line as its usage tells it: `stopgate
// help` lists the synopses and summaries, `stopgate help VERB` prints the
// synopsis and the details, and docs/cli.md's synopsis is checked against
// these (docs_test.go), so that the help and the docs cannot drift apart.
type verb struct {
	name string
	// synopsis is how the verb is written, after "stopgate ".
	synopsis string
	// summary is its line in `stopgate help`.
	summary string
	// details are the paragraphs of `stopgate help VERB` after the synopsis.
	details string
}

// verbs are the verbs in the order `stopgate help` lists them.
var verbs = []verb{
	{"serve", "serve [flags]", "run the egress proxy and the control API", `Serves the egress proxy on --proxy-addr, the browser guard on --browser-addr and the control
API on --control-addr over the store (--store, or the embedded store in --data-dir). Every flag
can also be set as STOPGATE_<FLAG> (e.g. STOPGATE_CONTROL_ADDR); a flag on the command line wins.

The control API needs a bearer token. On the first start serve writes into --data-dir the
operator token (` + control.OperatorTokenFile + `), a read-only token (` + control.ReadTokenFile + `) and the secret that signs
run tokens (` + control.RunTokenSecretFile + `), each 0600 and never overwritten, unless they are given
(--control-token-file, --read-token-file, --run-token-secret-file). --control-auth=none opens
the control API to whoever reaches it.
`},
	{"admit", "admit RUN [--reason R] [--label NAME=VALUE]... [budget flags] [--json]", "create RUN ACTIVE at cancel_version 1", `Creates RUN ACTIVE at cancel_version 1; an ACTIVE run is left as it is.
A run that was cancelled or completed is refused (exit 1). The budget flags (--max-effects and
the other --max-... flags, --cancel-on-unknown-usage, --budget-drain) give it a budget on top of
the policy's; --label chooses the policy's budget rule.
`},
	{"cancel", "cancel RUN [--reason R] [--drain D] [--wait] [--tombstone] [--json]", "stop RUN: no new work; in-flight work drains for D", `Moves RUN to CANCELLING: nothing new of it starts, from now on, anywhere.
In-flight work may finish until the drain deadline (D, default the server's).
A run never seen gets a CANCELLED tombstone so it can never start; since that is most often a
mistyped id, cancel then says so on stderr and exits 4, unless --tombstone says it was meant.
With --wait, waits until RUN leaves CANCELLING (at most the drain deadline plus 10s)
and exits 0 when CANCELLED, 3 when UNKNOWN, 1 when still CANCELLING.
`},
	{"complete", "complete RUN [--version N] [--reason R] [--json]", "mark RUN finished normally", `Moves RUN from ACTIVE to COMPLETED, only if it is still at cancel_version N
(default: the version it has now).
`},
	{"status", "status RUN [--json]", "show RUN's row and intent counts", `Shows RUN's row: status, cancel_version, reasons, times and intent counts.
`},
	{"runs", "runs [--status S] [--prefix P] [--since T] [--sort id|updated|created] [--limit N] [--json]", "list runs", `Lists runs, ordered by id (or newest updated or created first); S is ACTIVE, CANCELLING,
CANCELLED, COMPLETED or UNKNOWN; P an id prefix; T a time (RFC 3339) or a duration back from now
(90m): runs updated since then. With --limit N, the first N, and how many more matched.
`},
	{"audit", "audit RUN [--json]", "every effect and every transition of RUN", `Shows every intent (effect) of RUN and every transition of its audit log.
`},
	{"resolve", "resolve RUN KEY --applied|--not-applied [--note N] [--source S] [--json]", "record what happened to an UNKNOWN effect", `Records what you found out about an UNKNOWN effect of RUN (its intent KEY, as listed by
'stopgate audit RUN' or 'stopgate cancel RUN --wait'): it happened (--applied) or it
did not (--not-applied). Once every UNKNOWN effect of a cancelled run is resolved, the
run becomes CANCELLED. The note, the source and who you are (operator (cli:$USER): the scope
your token proves, and the name you give) go to the audit log.
`},
	{"ca", "ca", "print the MITM CA certificate (PEM) workers must trust", `Prints the egress proxy's MITM CA certificate (PEM) exactly as served, and nothing
else: stopgate ca > ca.pem, then make workers trust ca.pem.
`},
	{"claim", "claim RUN STEP [--version N] [--worker W] [--lease D] [--json]", "claim a queued step, guarded like every effect", `Claims queued step STEP of RUN through the guard (intent claim:STEP), leased to W for D.
Refused (exit 1) when RUN is not ACTIVE or not at cancel_version N, or STEP is claimed.
For operators and scripts; workers call POST /v1/runs/RUN/claims.
`},
	{"retry", "retry RUN STEP ATTEMPT --at TIME [--version N] [--json]", "schedule a retry; a cancel revokes it", `Schedules attempt ATTEMPT of STEP of RUN for TIME (RFC 3339) through the guard
(intent retry:STEP:ATTEMPT, SCHEDULED). A cancel of RUN revokes it until then.
`},
	{"browser", "browser --run RUN [--version N] [--json]", "start RUN's guarded headless browser in serve; print its ws:// URL", `Asks stopgate serve to start RUN's guarded headless Chromium (or finds the one it has) and
prints the websocket URL to connect a CDP client to (Puppeteer, Playwright, chromedp)
alone on the first line, then returns: the browser lives in stopgate serve until RUN is over
(CANCELLED, COMPLETED or UNKNOWN) and serve's --browser-linger has passed, or serve stops.
Asked again while it runs, it prints the same URL (recorded as an attach). Every action the
client sends is checked against cancel_version N and recorded; after a cancel it is refused.
`},
	{"token", "token RUN [--ttl D] [--json]", "print a run token: RUN's worker's credential (proxy password, API bearer)", `Prints a signed run token for RUN at its current cancel_version, alone on one line, good for
D (default 24h): the one credential of RUN's worker. It is the worker's proxy password
(HTTPS_PROXY=http://RUN:TOKEN@host:port) or X-Run-Token header, and its bearer token on the
control API, where it may claim, schedule retries, guard effects and report outcomes for RUN
only, and never cancel, complete, resolve, admit or mint. Needs the operator token; refused
(exit 1) unless RUN is ACTIVE.
`},
	{"exec", "exec --run RUN [--version N] [--no-isolate | --isolate --uid UID] [--admit [budget flags] [--label NAME=VALUE]...] [--proxy HOST:PORT] [--dns ADDR[:PORT]]... [--cancel-signal SIG] -- CMD [ARGS...]",
		"run an unmodified agent in a sandbox behind the guard", `Runs CMD with its effects guarded and recorded under RUN, as you, and exits with CMD's status
(128+N when a signal N killed it); the signals stopgate receives are passed on to CMD.

By default CMD runs in a sandbox of its own (user, network, PID and mount namespaces; no root
needed): every TCP connection it opens, to any address, loopback included, is carried to the
egress proxy under RUN, whatever it does with proxy variables; DNS goes only to the resolvers
named (--dns, default /etc/resolv.conf's); nothing else leaves. A worker's run token
(stopgate token RUN) is all exec needs.

When RUN's cancel commits, exec writes it into $STOPGATE_CANCEL_FILE and sends CMD's processes
--cancel-signal (default TERM); at the drain deadline it kills them. Both are in the audit.
A run never admitted is refused unless --admit, which admits it with admit's budget flags and
--label; a run admitted before keeps the budget it was admitted with (stderr says so).

--no-isolate: only the proxy variables (both cases) and the CA variables; recorded in the
run's audit, and stderr lists the clients that go around them.
--isolate --uid UID (root): CMD runs as UID behind the kernel redirect to serve's
--transparent-addr, as before the sandbox existed.
`},
	{"redirect", "redirect install|remove --uid UID [--port P] [--dns ADDR[:PORT]]...", "send every TCP connection of UID to the transparent listener", `install sends every TCP connection UID opens, in this network namespace, to the
transparent listener's port P (default: asked of --control) and refuses its other
traffic but DNS to the resolvers named (default /etc/resolv.conf's), with iptables and
ip6tables (root or CAP_NET_ADMIN). Installing again replaces the rules; remove takes them
away (and is a no-op when there are none). --port and --dns are install's alone.
`},
	{"store", "store acknowledge-reset --reason R [--json]", "admit runs again on a Redis store that lost writes (after re-cancelling)", `A Redis store that finds it lost writes it had acknowledged (FLUSHALL or FLUSHDB, a
restart without persistence, an older copy restored, a run's row evicted or deleted) is
marked reset: every instance refuses every admission and every guarded effect (503) and
answers /readyz 503, until an operator acknowledges the reset. First cancel again the
runs the store may have lost (a cancel of a run it no longer has writes its tombstone),
then acknowledge, saying what was done: R goes to the store's marker and to the log of
the instance that takes it. The other instances admit again within their marker check.
`},
	{"help", "help [VERB]", "this text, or a verb's flags", ""},
}

// summaryColumn is where `stopgate help` starts a verb's summary; a longer
// synopsis has its summary on the next line.
const summaryColumn = 47

const usageHeader = `stopgate: durable cancellation of AI-agent runs, enforced where effects leave the machine.

Usage:
`

const usageFooter = `
Client verbs talk to --control (default ` + DefaultControlURL + `, or $STOPGATE_CONTROL) with a
bearer token: --token, --token-file, $STOPGATE_CONTROL_TOKEN, else the operator token serve
wrote on its first start into its data directory (--data-dir, $STOPGATE_DATA_DIR, or
` + control.DefaultDataDir + ` when --control is on this machine). Flags may come before or after RUN.
Exit status: 0 ok, 1 error, 2 usage, 3 cancel --wait ended UNKNOWN, 4 cancel wrote the tombstone of a
run never seen (without --tombstone).
`

// mainUsage is `stopgate help`: every verb's synopsis and summary.
func mainUsage() string {
	var b strings.Builder
	b.WriteString(usageHeader)
	for _, v := range verbs {
		line := "  stopgate " + v.synopsis
		if len(line) < summaryColumn {
			fmt.Fprintf(&b, "%-*s%s\n", summaryColumn, line, v.summary)
		} else {
			fmt.Fprintf(&b, "%s\n%*s%s\n", line, summaryColumn, "", v.summary)
		}
	}
	b.WriteString(usageFooter)
	return b.String()
}

// verbUsage is `stopgate help VERB` but the flags.
func verbUsage(name string) (string, bool) {
	for _, v := range verbs {
		if v.name == name {
			text := "Usage: stopgate " + v.synopsis + "\n"
			if v.details != "" {
				text += "\n" + v.details
			}
			return text, true
		}
	}
	return "", false
}
