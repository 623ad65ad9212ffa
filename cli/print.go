package cli

import (
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/state"
)

// The human output of the client verbs. Programs use --json instead; this
// text may change.

// timeLayout is RFC 3339 with milliseconds, the precision the stores keep.
const timeLayout = "2006-01-02T15:04:05.000Z07:00"

func fmtTime(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format(timeLayout)
}

// fmtCount prints a number the record leaves unset (zero) as "-".
func fmtCount[N int | int64](n N) string {
	if n == 0 {
		return "-"
	}
	return fmt.Sprint(n)
}

// safe makes text from the record printable on a terminal: reasons, notes
// and targets come from agents and operators, and an escape sequence in one
// must not drive the terminal of whoever reads the audit.
func safe(s string) string {
	if s == "" {
		return "-"
	}
	if !strings.ContainsFunc(s, func(r rune) bool { return !unicode.IsPrint(r) }) {
		return s
	}
	q := fmt.Sprintf("%q", s)
	return q[1 : len(q)-1]
}

// clip shortens long targets in tables; --json has them whole.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n-3] + "..."
}

func newTable(w io.Writer) *tabwriter.Writer {
	return tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
}

func counts(m map[state.IntentState]int) string {
	var parts []string
	for _, st := range state.IntentStates {
		if n := m[st]; n != 0 {
			parts = append(parts, fmt.Sprintf("%s=%d", st, n))
		}
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, " ")
}

func printCancel(w io.Writer, res control.CancelResponse) {
	run := res.Run
	switch {
	case !res.Changed:
		fmt.Fprintf(w, "%s was already %s at cancel_version %d; nothing changed\n", safe(run.ID), run.Status, run.CancelVersion)
	case run.Status == state.StatusCancelled:
		fmt.Fprintf(w, "%s was never admitted: recorded CANCELLED at cancel_version %d, so it can never start\n", safe(run.ID), run.CancelVersion)
	default:
		fmt.Fprintf(w, "%s is %s at cancel_version %d: nothing new of it starts; in-flight work may finish until %s\n",
			safe(run.ID), run.Status, run.CancelVersion, fmtTime(run.DrainDeadline))
	}
}

// printFinal summarizes how a cancelled run ended, for cancel --wait.
func printFinal(w io.Writer, run state.Run) {
	fmt.Fprintf(w, "%s is %s", safe(run.ID), run.Status)
	if run.StatusReason != "" {
		fmt.Fprintf(w, " (%s)", safe(run.StatusReason))
	}
	fmt.Fprintf(w, " at cancel_version %d\nintents: %s\n", run.CancelVersion, counts(run.Intents))
}

// printUnknown lists the effects nobody can prove happened or not, and how
// to record what the operator finds out.
func printUnknown(w io.Writer, runID string, intents []state.Intent) {
	var unknown []state.Intent
	for _, in := range intents {
		if in.State == state.IntentUnknown {
			unknown = append(unknown, in)
		}
	}
	if len(unknown) == 0 {
		return
	}
	fmt.Fprintf(w, "\nThese effects may or may not have happened:\n")
	tw := newTable(w)
	fmt.Fprintln(tw, "  KEY\tMETHOD\tTARGET\tREASON")
	for _, in := range unknown {
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\n", safe(in.Key), safe(in.Method), clip(safe(in.Target), 60), safe(in.Reason))
	}
	_ = tw.Flush()
	fmt.Fprintf(w, "\nCheck each with its provider, then record what you found:\n")
	for _, in := range unknown {
		fmt.Fprintf(w, "  stopgate resolve %s %s --applied|--not-applied [--note N]\n", safe(runID), safe(in.Key))
	}
}

func printRun(w io.Writer, run state.Run) {
	tw := newTable(w)
	row := func(k, v string) { fmt.Fprintf(tw, "%s\t%s\n", k, v) }
	row("run", safe(run.ID))
	row("status", string(run.Status))
	row("cancel_version", fmt.Sprint(run.CancelVersion))
	if run.Reason != "" {
		row("reason", safe(run.Reason))
	}
	if run.StatusReason != "" {
		row("status_reason", safe(run.StatusReason))
	}
	row("created", fmtTime(run.CreatedAt))
	row("updated", fmtTime(run.UpdatedAt))
	if !run.CancelledAt.IsZero() {
		row("cancelled", fmtTime(run.CancelledAt))
	}
	if !run.DrainDeadline.IsZero() {
		row("drain_deadline", fmtTime(run.DrainDeadline))
	}
	row("intents", counts(run.Intents))
	if run.Budget.Limited() {
		// The wall time runs until the run stops taking effects.
		elapsed := time.Since(run.CreatedAt)
		switch {
		case run.Status == state.StatusActive:
		case !run.CancelledAt.IsZero():
			elapsed = run.CancelledAt.Sub(run.CreatedAt)
		default:
			elapsed = run.UpdatedAt.Sub(run.CreatedAt)
		}
		for _, l := range run.Budget.Uses(run.Usage, elapsed) {
			row(l.Limit, l.String())
		}
		if run.Budget.CancelOnUnknownUsage {
			row(state.LimitUnknownUsage, "cancels the run")
		}
	}
	u := run.Usage
	row("effects", fmt.Sprint(u[state.CounterEffects]))
	if u[state.CounterLLMCalls] > 0 || u[state.CounterUnknownUsage] > 0 {
		row("tokens", fmt.Sprintf("%d in, %d out (%d LLM answers read, %d unknown)", u[state.CounterInputTokens], u[state.CounterOutputTokens],
			u[state.CounterLLMCalls], u[state.CounterUnknownUsage]))
		spend := "$" + state.FormatUSD(u[state.CounterSpend])
		if n := u[state.CounterUnpriced]; n > 0 {
			spend += fmt.Sprintf(" (+ %d answers of models without a price)", n)
		}
		row("spend", spend)
		for _, model := range slices.Sorted(maps.Keys(u.Models())) {
			m := u.Models()[model]
			row("  "+safe(model), fmt.Sprintf("%d in, %d out, %d answers", m.InputTokens, m.OutputTokens, m.Calls))
		}
	}
	_ = tw.Flush()
}

func printRuns(w io.Writer, runs []state.Run) {
	if len(runs) == 0 {
		fmt.Fprintln(w, "no runs")
		return
	}
	tw := newTable(w)
	fmt.Fprintln(tw, "RUN\tSTATUS\tVERSION\tUPDATED\tINTENTS\tREASON")
	for _, r := range runs {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\n", safe(r.ID), r.Status, r.CancelVersion, fmtTime(r.UpdatedAt), counts(r.Intents), safe(r.Reason))
	}
	_ = tw.Flush()
}

func printAudit(w io.Writer, a control.Audit) {
	printRun(w, a.Run)
	fmt.Fprintf(w, "\nIntents (%d):\n", len(a.Intents))
	if len(a.Intents) > 0 {
		tw := newTable(w)
		fmt.Fprintln(tw, "TIME\tMETHOD\tTARGET\tKEY\tSTATE\tCODE\tATTEMPTS")
		for _, in := range a.Intents {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%d\n",
				fmtTime(in.CreatedAt), safe(in.Method), clip(safe(in.Target), 60), safe(in.Key), in.State, fmtCount(in.StatusCode), in.Attempts)
		}
		_ = tw.Flush()
	}
	fmt.Fprintf(w, "\nEvents (%d):\n", len(a.Events))
	if len(a.Events) > 0 {
		tw := newTable(w)
		fmt.Fprintln(tw, "TIME\tACTOR\tKIND\tCHANGE\tINTENT\tVERSION\tREASON")
		for _, e := range a.Events {
			change := "-"
			if e.From != "" || e.To != "" {
				change = safe(e.From) + " -> " + safe(e.To)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n",
				fmtTime(e.At), safe(e.Actor), safe(e.Kind), change, safe(e.Intent), fmtCount(e.Version), safe(e.Reason))
		}
		_ = tw.Flush()
	}
}

// printIntent shows one intent as aligned key value lines; fields it does
// not have are left out.
func printIntent(w io.Writer, in state.Intent) {
	tw := newTable(w)
	row := func(k, v string) { fmt.Fprintf(tw, "%s\t%s\n", k, v) }
	opt := func(k, v string) {
		if v != "" {
			row(k, safe(v))
		}
	}
	row("run", safe(in.RunID))
	row("key", safe(in.Key))
	row("boundary", string(in.Boundary))
	row("state", string(in.State))
	opt("method", in.Method)
	opt("target", in.Target)
	if in.StatusCode != 0 {
		row("status_code", fmt.Sprint(in.StatusCode))
	}
	row("attempts", fmt.Sprint(in.Attempts))
	if in.Refusals != 0 {
		row("refusals", fmt.Sprint(in.Refusals))
	}
	opt("reason", in.Reason)
	opt("source", in.Source)
	opt("note", in.Note)
	opt("lease_owner", in.LeaseOwner)
	if !in.LeaseExpires.IsZero() {
		row("lease_expires", fmtTime(in.LeaseExpires))
	}
	if !in.NotBefore.IsZero() {
		row("not_before", fmtTime(in.NotBefore))
	}
	row("created", fmtTime(in.CreatedAt))
	row("updated", fmtTime(in.UpdatedAt))
	_ = tw.Flush()
}

// budgetLine is a budget in one line, its limits as the policy spells them.
func budgetLine(b state.Budget) string {
	var parts []string
	for _, u := range b.Uses(nil, 0) {
		parts = append(parts, u.Limit+" "+b.Of(u.Limit))
	}
	if b.CancelOnUnknownUsage {
		parts = append(parts, "cancel_on_unknown_usage")
	}
	if b.DrainTimeout > 0 {
		parts = append(parts, "drain "+b.DrainTimeout.String())
	}
	return strings.Join(parts, ", ")
}
