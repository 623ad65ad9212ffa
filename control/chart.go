package control

import (
	"fmt"
	"strings"
	"time"

	"github.com/stopgate/stopgate/state"
)

// The console's picture of a run: each effect a bar on one time axis, from
// its admission to its outcome, coloured by the state it is in now, with
// the cancel, the drain deadline and every cut marked. Drawn on the server
// as inline SVG, like the rest of the console: no script.

// chart is what the template draws.
type chart struct {
	Width, Height int
	// PlotX and PlotW are the time axis's place; Top and Bottom its rows';
	// MarkY and MarkTextY the marks' line top and label, AxisY the ticks'.
	PlotX, PlotW, Top, Bottom   int
	MarkY, MarkTextY, AxisY     int
	LabelX, BandX, BandW, PlotR int
	Start                       time.Time
	Rows                        []chartRow
	Marks                       []chartMark
	Ticks                       []chartTick
	// Omitted counts the effects not drawn (past maxChartRows).
	Omitted int
}

// chartRow is one effect.
type chartRow struct {
	Y, LabelY, BarY int
	Label, Key      string
	State           state.IntentState
	// Class colours the bar by state (b-responded, ...).
	Class string
	// X1, X2 are the bar's ends, W its width; Point draws a refusal (no
	// duration) at X1, PointY.
	X1, X2, W float64
	PointY    int
	Point     bool
	// Open: still in flight, the bar reaches now.
	Open bool
	// Cuts are where stopgate cut it.
	Cuts  []float64
	Title string
}

// chartMark is a vertical line across every row: the cancel, the drain
// deadline.
type chartMark struct {
	X           float64
	Class, Text string
	TextX       float64
	Anchor      string
}

// chartTick is a label of the time axis.
type chartTick struct {
	X    float64
	Text string
}

// Geometry of the chart, in SVG units (its viewBox).
const (
	chartWidth   = 1180
	chartLabelW  = 330
	chartRowH    = 24
	chartTop     = 34
	chartAxisH   = 30
	maxChartRows = 80
)

// runChart draws run's intents from its events; now is the right end of a
// run that is still live.
func runChart(run state.Run, intents []state.Intent, events []state.Event, now time.Time) *chart {
	if len(intents) == 0 && run.CancelledAt.IsZero() {
		return nil
	}
	type span struct {
		from, to time.Time
		cuts     []time.Time
		refused  bool
	}
	spans := map[string]*span{}
	get := func(key string) *span {
		s, ok := spans[key]
		if !ok {
			s = &span{}
			spans[key] = s
		}
		return s
	}
	start, end := run.CreatedAt, run.UpdatedAt
	for _, e := range events {
		if start.IsZero() || e.At.Before(start) {
			start = e.At
		}
		if e.At.After(end) {
			end = e.At
		}
		if e.Intent == "" {
			continue
		}
		s := get(e.Intent)
		switch e.Kind {
		case state.EventIntentAdmitted:
			if s.from.IsZero() {
				s.from = e.At
			}
		case state.EventIntentRefused:
			if s.from.IsZero() {
				s.from, s.refused = e.At, true
			}
		case state.EventIntentOutcome, state.EventIntentExpired, state.EventIntentRevoked:
			s.to = e.At
			if state.CutBy(e.Reason) {
				s.cuts = append(s.cuts, e.At)
			}
		case state.EventIntentResolved:
			if s.to.IsZero() {
				s.to = e.At
			}
		case state.EventIntentCut:
			s.cuts = append(s.cuts, e.At)
		}
	}
	live := run.Status == state.StatusActive || run.Status == state.StatusCancelling
	if live && now.After(end) {
		end = now
	}
	if !run.DrainDeadline.IsZero() && run.DrainDeadline.After(end) {
		end = run.DrainDeadline
	}
	if !end.After(start) {
		end = start.Add(time.Second)
	}
	// A margin each side, so that the first and last marks stand clear.
	pad := end.Sub(start) / 25
	start, end = start.Add(-pad), end.Add(pad)
	c := &chart{Width: chartWidth, PlotX: chartLabelW + 10, PlotW: chartWidth - chartLabelW - 30, Top: chartTop, Start: start}
	x := func(t time.Time) float64 {
		return float64(c.PlotX) + float64(c.PlotW)*float64(t.Sub(start))/float64(end.Sub(start))
	}
	rows := intents
	if len(rows) > maxChartRows {
		c.Omitted = len(rows) - maxChartRows
		rows = rows[:maxChartRows]
	}
	for i, in := range rows {
		s := get(in.Key)
		if s.from.IsZero() {
			s.from = in.CreatedAt
		}
		open := s.to.IsZero() && (in.State == state.IntentInFlight || in.State == state.IntentScheduled)
		to := s.to
		for _, c := range s.cuts {
			// An answer cut on its way back (a stream) lasted until its cut.
			if c.After(to) && !to.IsZero() {
				to = c
			}
		}
		switch {
		case open:
			to = end.Add(-pad)
		case to.IsZero():
			to = in.UpdatedAt
		}
		y := c.Top + i*chartRowH
		r := chartRow{
			Y: y, LabelY: y + 16, BarY: y + 5, Key: in.Key, State: in.State,
			Class: "b-" + strings.ToLower(string(in.State)), Label: clipLabel(strings.TrimSpace(in.Method+" "+in.Target), 52),
			X1: x(s.from), X2: x(to), Point: s.refused || in.State == state.IntentCancelledBeforeDispatch, Open: open,
		}
		if r.Label == "" {
			r.Label = clipLabel(in.Key, 52)
		}
		if r.X2-r.X1 < 3 {
			r.X2 = r.X1 + 3
		}
		r.W, r.PointY = r.X2-r.X1, y+12
		for _, t := range s.cuts {
			r.Cuts = append(r.Cuts, x(t))
		}
		r.Title = fmt.Sprintf("%s %s — %s, %s", in.Method, in.Target, in.State, fmtSpan(s.from, to, open))
		c.Rows = append(c.Rows, r)
	}
	c.Bottom = c.Top + len(c.Rows)*chartRowH
	c.Height = c.Bottom + chartAxisH
	c.MarkY, c.MarkTextY, c.AxisY = c.Top-14, c.Top-18, c.Bottom+20
	c.LabelX, c.BandX, c.BandW, c.PlotR = 8, 0, chartWidth, c.PlotX+c.PlotW
	if !run.CancelledAt.IsZero() {
		c.Marks = append(c.Marks, chartMark{X: x(run.CancelledAt), Class: "m-cancel", Text: "cancel " + run.CancelledAt.UTC().Format("15:04:05.000")})
	}
	if !run.DrainDeadline.IsZero() {
		c.Marks = append(c.Marks, chartMark{X: x(run.DrainDeadline), Class: "m-deadline", Text: "drain deadline " + run.DrainDeadline.UTC().Format("15:04:05.000")})
	}
	for i := range c.Marks {
		m := &c.Marks[i]
		// The label goes to the side of the line with room for it.
		m.TextX, m.Anchor = m.X+4, "start"
		if m.X > float64(c.PlotX+c.PlotW)-150 {
			m.TextX, m.Anchor = m.X-4, "end"
		}
	}
	if len(c.Marks) == 2 && c.Marks[1].X-c.Marks[0].X < 180 && c.Marks[0].Anchor == "start" {
		// Close together: the cancel's label left of its line.
		c.Marks[0].TextX, c.Marks[0].Anchor = c.Marks[0].X-4, "end"
	}
	step := tickStep(end.Sub(start))
	for t := start.Truncate(step).Add(step); t.Before(end); t = t.Add(step) {
		c.Ticks = append(c.Ticks, chartTick{X: x(t), Text: t.UTC().Format(tickFormat(step))})
	}
	return c
}

// tickStep is the step of at most about eight ticks over d.
func tickStep(d time.Duration) time.Duration {
	for _, s := range []time.Duration{
		10 * time.Millisecond, 25 * time.Millisecond, 50 * time.Millisecond, 100 * time.Millisecond, 250 * time.Millisecond, 500 * time.Millisecond,
		time.Second, 2 * time.Second, 5 * time.Second, 10 * time.Second, 15 * time.Second, 30 * time.Second,
		time.Minute, 2 * time.Minute, 5 * time.Minute, 10 * time.Minute, 15 * time.Minute, 30 * time.Minute,
		time.Hour, 2 * time.Hour, 6 * time.Hour, 12 * time.Hour, 24 * time.Hour,
	} {
		if d/s <= 8 {
			return s
		}
	}
	return 7 * 24 * time.Hour
}

func tickFormat(step time.Duration) string {
	switch {
	case step < time.Second:
		return "15:04:05.000"
	case step < 24*time.Hour:
		return "15:04:05"
	}
	return "Jan 2"
}

func fmtSpan(from, to time.Time, open bool) string {
	if open {
		return "in flight since " + from.UTC().Format("15:04:05.000")
	}
	return fmt.Sprintf("%s → %s (%s)", from.UTC().Format("15:04:05.000"), to.UTC().Format("15:04:05.000"), to.Sub(from).Round(time.Millisecond))
}

func clipLabel(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n-1] + "…"
}
