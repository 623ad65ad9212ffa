// Package evidence is the fault suite behind `make evidence`: it starts real
// stopgate binaries, a real redis-server and local upstreams, injects one
// failure at a time (a process killed with -9, Redis killed or paused,
// replies lost on the wire, the pub/sub connection gone silent, a browser
// action or a redirected connection in flight at the cancel, a disk full),
// repeats each case, and counts three things for every round, each of
// which must be zero:
//
//   - effects leaked: requests the upstream itself counted that nothing
//     authorized (sent after the cancel was acknowledged, sent twice under
//     one key, sent although the client was refused, or never recorded);
//   - cancels lost: acknowledged cancels the run row does not show
//     afterwards (status, version, reason, one cancel event);
//   - records unexplained: what the audit log cannot explain (events out of
//     order or without actor or reason, an intent whose state no event
//     gave it, an effect admitted after the cancel, a run whose status its
//     intents contradict, a record of an effect the client was told was
//     refused).
//
// The cases are the package's tests (evidence_test.go); this file is the
// table they fill and print. The package never reads stopgate's logs to
// count effects: upstreams count what reached them, and the audit comes
// from the control API, as an operator would read it.
package evidence

import (
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"
)

// Round is what one repetition of a case measured.
type Round struct {
	// Requests is how many effects the round attempted (for scale).
	Requests int
	// Leaked, Lost and Unexplained are the three evidence counts.
	Leaked, Lost, Unexplained int
	// Reconciled counts UNKNOWN intents the round had to reconcile (from
	// the upstream's count, as a provider lookup would): the price of a
	// failure in operator work, not a fault.
	Reconciled int
	// Recover is the case's time to recover (what it measures is the
	// case's Recovery text); zero when not measured.
	Recover time.Duration
	// Problems say what was counted, for the test failure.
	Problems []string
}

// Fail counts a problem into one of the three columns (Leaked, Lost or
// Unexplained, given by address).
func (r *Round) Fail(column *int, format string, args ...any) {
	*column++
	r.Problems = append(r.Problems, fmt.Sprintf(format, args...))
}

// Row is one failure of the table.
type Row struct {
	Failure string
	// Recovery says what the time-to-recover column measures.
	Recovery string
	// Skipped, when set, says why the case did not run (never counted as a pass).
	Skipped string
	// Stopped: the case ended on a fatal error before its last round.
	Stopped bool
	Rounds  []Round
}

// Table collects the rows of one suite run; safe for concurrent use.
type Table struct {
	mu   sync.Mutex
	rows []*Row
}

// Add records a case's rounds.
func (t *Table) Add(r Row) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.rows = append(t.rows, &r)
}

// Render prints the table: one line per failure, then what each recovery
// time measures.
func (t *Table) Render(w io.Writer) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "#\tFAILURE\tRUNS\tEFFECTS\tLEAKED\tCANCELS LOST\tUNEXPLAINED\tRECONCILED\tRECOVER median / max\tRESULT")
	for i, r := range t.rows {
		if r.Skipped != "" {
			fmt.Fprintf(tw, "%d\t%s\t-\t-\t-\t-\t-\t-\t-\tNOT RUN\n", i+1, r.Failure)
			continue
		}
		var req, leaked, lost, unexplained, reconciled, problems int
		var times []time.Duration
		for _, rd := range r.Rounds {
			req += rd.Requests
			leaked += rd.Leaked
			lost += rd.Lost
			unexplained += rd.Unexplained
			reconciled += rd.Reconciled
			if rd.Recover > 0 {
				times = append(times, rd.Recover)
			}
			problems += len(rd.Problems)
		}
		result := "ok"
		switch {
		case r.Stopped:
			result = fmt.Sprintf("FAIL (stopped in round %d)", len(r.Rounds))
		case problems > 0:
			result = fmt.Sprintf("FAIL (%d)", problems)
		}
		fmt.Fprintf(tw, "%d\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%s\t%s\n", i+1, r.Failure, len(r.Rounds), req, leaked, lost, unexplained, reconciled, spread(times), result)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "EFFECTS: requests the case attempted. LEAKED, CANCELS LOST, UNEXPLAINED: each must be 0 (counted from the")
	fmt.Fprintln(w, "upstreams' own counters, the run rows and the audit logs). RECONCILED: intents left UNKNOWN by the failure")
	fmt.Fprintln(w, "(a carrier killed, a reply lost) that the case resolved from the upstream's count, as a provider lookup would.")
	fmt.Fprintln(w, "RESULT: FAIL when any count or any expectation of the case did not hold (the test output says which).")
	fmt.Fprintln(w, "RECOVER measures, per case:")
	for i, r := range t.rows {
		switch {
		case r.Skipped != "":
			fmt.Fprintf(w, "  %d. not run: %s\n", i+1, r.Skipped)
		case r.Recovery != "":
			fmt.Fprintf(w, "  %d. %s\n", i+1, r.Recovery)
		}
	}
	return nil
}

// spread is "median / max" of the times, "-" without any.
func spread(ds []time.Duration) string {
	if len(ds) == 0 {
		return "-"
	}
	slices.Sort(ds)
	return fmt.Sprintf("%s / %s", round(ds[len(ds)/2]), round(ds[len(ds)-1]))
}

func round(d time.Duration) string {
	switch {
	case d >= time.Second:
		return d.Round(10 * time.Millisecond).String()
	case d >= time.Millisecond:
		return d.Round(time.Millisecond).String()
	default:
		return d.Round(time.Microsecond).String()
	}
}

// String renders the table to a string.
func (t *Table) String() string {
	var b strings.Builder
	_ = t.Render(&b)
	return b.String()
}
