package bench

import (
	"fmt"
	"io"
	"math"
	"strings"
	"time"
	"unicode/utf8"
)

// table is one Markdown table, its columns padded so it also reads as
// plain text.
type table struct {
	title  string
	header []string
	// left is how many leading columns hold text (left-aligned); the
	// others hold numbers (right-aligned). Zero means one.
	left  int
	rows  [][]string
	notes []string
}

func (t *table) add(cells ...string) { t.rows = append(t.rows, cells) }

func (t *table) print(w io.Writer) {
	if t.title != "" {
		fmt.Fprintf(w, "### %s\n\n", t.title)
	}
	width := make([]int, len(t.header))
	for i, h := range t.header {
		width[i] = utf8.RuneCountInString(h)
	}
	for _, r := range t.rows {
		for i, c := range r {
			if i < len(width) {
				width[i] = max(width[i], utf8.RuneCountInString(c))
			}
		}
	}
	left := max(t.left, 1)
	line := func(cells []string) {
		var b strings.Builder
		b.WriteString("|")
		for i := range width {
			c := ""
			if i < len(cells) {
				c = cells[i]
			}
			pad := strings.Repeat(" ", width[i]-utf8.RuneCountInString(c))
			if i < left {
				b.WriteString(" " + c + pad + " |")
			} else {
				b.WriteString(" " + pad + c + " |")
			}
		}
		fmt.Fprintln(w, b.String())
	}
	line(t.header)
	sep := make([]string, len(width))
	for i := range width {
		if i < left {
			sep[i] = strings.Repeat("-", width[i])
		} else {
			sep[i] = strings.Repeat("-", width[i]-1) + ":"
		}
	}
	fmt.Fprintln(w, "|"+strings.Join(func() []string {
		out := make([]string, len(sep))
		for i, s := range sep {
			out[i] = " " + s + " "
		}
		return out
	}(), "|")+"|")
	for _, r := range t.rows {
		line(r)
	}
	for _, n := range t.notes {
		fmt.Fprintln(w, "\n"+n)
	}
	fmt.Fprintln(w)
}

// thousands prints n rounded, with a space between groups of three digits.
func thousands(x float64) string {
	n := int64(math.Round(x))
	neg := n < 0
	if neg {
		n = -n
	}
	s := fmt.Sprint(n)
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(' ')
		}
		b.WriteRune(c)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}

// rateCell is a median rate with its spread over repeats.
func rateCell(s spread) string {
	if s.N == 0 {
		return "—"
	}
	if s.N == 1 {
		return thousands(s.Median)
	}
	return fmt.Sprintf("%s (%s–%s)", thousands(s.Median), thousands(s.Min), thousands(s.Max))
}

// ratioCell is a median ratio with its spread.
func ratioCell(s spread) string {
	if s.N == 0 {
		return "—"
	}
	if s.N == 1 {
		return fmt.Sprintf("%.2f", s.Median)
	}
	return fmt.Sprintf("%.2f (%.2f–%.2f)", s.Median, s.Min, s.Max)
}

// dur prints a latency in µs below a millisecond, else in ms.
func dur(d time.Duration) string {
	switch {
	case d <= 0:
		return "0"
	case d < time.Millisecond:
		return fmt.Sprintf("%d µs", d.Microseconds())
	case d < 100*time.Millisecond:
		return fmt.Sprintf("%.2f ms", float64(d)/float64(time.Millisecond))
	default:
		return fmt.Sprintf("%.0f ms", float64(d)/float64(time.Millisecond))
	}
}

// signedDur is a latency difference.
func signedDur(d time.Duration) string {
	if d < 0 {
		return "−" + dur(-d)
	}
	return "+" + dur(d)
}

// micros prints a CPU time per request.
func micros(us float64) string {
	if us >= 100 {
		return fmt.Sprintf("%.0f", us)
	}
	return fmt.Sprintf("%.1f", us)
}

// bytesCell prints a byte count.
func bytesCell(b float64) string {
	switch {
	case math.Abs(b) >= 10<<20:
		return fmt.Sprintf("%.0f MiB", b/(1<<20))
	case math.Abs(b) >= 10<<10:
		return fmt.Sprintf("%.0f KiB", b/(1<<10))
	}
	return fmt.Sprintf("%.0f B", b)
}
