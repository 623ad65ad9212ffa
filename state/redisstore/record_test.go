package redisstore

import (
	"fmt"
	"slices"
	"strings"
	"testing"
)

// TestCutTakesExactlyTheRecordsParts: a record's line or field list is
// read only when it has exactly the parts its layout names, as
// strings.Split would count them.
func TestCutTakesExactlyTheRecordsParts(t *testing.T) {
	for _, tc := range []struct {
		in   string
		n    int
		want []string
	}{
		{"http 1 2 0", 4, []string{"http", "1", "2", "0"}},
		{"a  b", 3, []string{"a", "", "b"}},
		{" ", 2, []string{"", ""}},
		{"http 1 2", 4, nil},
		{"http 1 2 0 9", 4, nil},
		{"", 1, []string{""}},
	} {
		parts := make([]string, tc.n)
		ok := cut(tc.in, ' ', parts)
		if ok != (tc.want != nil) || ok && !slices.Equal(parts, tc.want) {
			t.Errorf("cut(%q, %d) = %v %q, want %q", tc.in, tc.n, ok, parts, tc.want)
		}
	}
}

// BenchmarkDecodeIntent is the record decode every guard and outcome makes.
func BenchmarkDecodeIntent(b *testing.B) {
	imm := "http 1764500000000 42 3\nPOST\nhttps://api.example/v1/charges\nsha256:0123456789abcdef"
	mut := "RESPONDED 1 0 200 0 1764500000123 -\nworker-1\n\n\n"
	b.ReportAllocs()
	for b.Loop() {
		if _, _, err := decodeIntent("r1", "d-1", imm, mut); err != nil {
			b.Fatal(err)
		}
	}
}

func TestEscapeIsReadBackByUnescape(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"https://api.example/x?q=1", "https://api.example/x?q=1"},
		{"a\nb", `a\nb`},
		{`a\b`, `a\\b`},
		{`\n`, `\\n`},
		{"\\\n", `\\\n`},
		{"", ""},
	} {
		got := escape(tc.in)
		if got != tc.want {
			t.Errorf("escape(%q) = %q; want %q", tc.in, got, tc.want)
		}
		if strings.Contains(got, "\n") {
			t.Errorf("escape(%q) = %q holds a newline", tc.in, got)
		}
		if back := unescape(got); back != tc.in {
			t.Errorf("unescape(escape(%q)) = %q", tc.in, back)
		}
	}
}

// An entry of the audit stream holds events of three lines each, one a
// field (the general rules) or several in one (a batch's common steps),
// and reads back as those events in order, whatever their reasons hold.
func TestEventsOfReadsEveryEventOfAnEntry(t *testing.T) {
	admitted := "intent.admitted 1  IN_FLIGHT k\nproxy:1\n"
	outcome := "intent.outcome 1 IN_FLIGHT RESPONDED j\nproxy:1\nsafe_method: cut \\n short"
	cancel := "run.transition 2 ACTIVE CANCELLING \nop\nstop"
	for _, tc := range []struct {
		name   string
		fields []string
		want   string
	}{
		{"an event a field", []string{"e", admitted, "e", outcome},
			"intent.admitted k proxy:1 ''; intent.outcome j proxy:1 'safe_method: cut \\n short'; "},
		{"a batch's events in one field", []string{"e", admitted + "\n" + outcome + "\n" + admitted},
			"intent.admitted k proxy:1 ''; intent.outcome j proxy:1 'safe_method: cut \\n short'; intent.admitted k proxy:1 ''; "},
		{"both", []string{"e", cancel, "e", outcome + "\n" + admitted},
			"run.transition  op 'stop'; intent.outcome j proxy:1 'safe_method: cut \\n short'; intent.admitted k proxy:1 ''; "},
		{"the layout before, a field each", []string{"kind", "run.admitted", "actor", "t", "reason", "r", "at", "5"},
			"run.admitted  t 'r'; "},
	} {
		var got string
		for _, e := range eventsOf("r", "1764552972579-0", tc.fields) {
			got += fmt.Sprintf("%s %s %s %q; ", e.Kind, e.Intent, e.Actor, e.Reason)
		}
		got = strings.ReplaceAll(got, `"`, "'")
		if got != tc.want {
			t.Errorf("%s:\n got %s\nwant %s", tc.name, got, tc.want)
		}
	}
}
