package redisstore

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/stopgate/stopgate/state"
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

// TestParseCommonReadsTheBatchsOneStringAnswers: a step on the batch's
// common path answers one string, a guard's one line (its key and time),
// an outcome's its head line then the record's two fields; anything else
// is an error that quotes it, never a half-read record.
func TestParseCommonReadsTheBatchsOneStringAnswers(t *testing.T) {
	const imm, mut = "http 1 2 0\nGET\nhttps://a.example/x\n", "IN_FLIGHT 1 0 0 9 1 -\nowner\n\n\n"
	for _, tc := range []struct {
		in             string
		key, status, v string
		at             int64 // a guard's time
		wantErr        bool
	}{
		{in: "admitted ACTIVE 3 k.2 1764552972579", key: "k.2", status: "ACTIVE", v: "3", at: 1764552972579},
		{in: "recorded k\n" + imm + "\n" + mut, key: "k"},
		{in: "admitted ACTIVE 3 1764552972579", wantErr: true},       // no key
		{in: "admitted ACTIVE 3 k.2", wantErr: true},                 // no time
		{in: "admitted ACTIVE 3 k.2 soon", wantErr: true},            // a time that is not one
		{in: "admitted ACTIVE 3 k.2 1764552972579 x", wantErr: true}, // more than a guard's
		{in: "recorded k extra\n" + imm + "\n" + mut, wantErr: true}, // more than a key
		{in: "refused k\n" + imm + "\n" + mut, wantErr: true},        // not a common step
		{in: "recorded k\nhttp 1 2 0\nGET", wantErr: true},           // the record cut short
		{in: "recorded k", wantErr: true},                            // no record
		{in: "recorded"},                                             // an outcome nobody waits for
		{in: "", wantErr: true},
	} {
		r, err := parseCommon(tc.in)
		if tc.wantErr {
			if err == nil {
				t.Errorf("%q: read as %+v; want an error", tc.in, r)
			}
			continue
		}
		if err != nil {
			t.Errorf("%q: %v", tc.in, err)
			continue
		}
		if r.result != "ok" || !r.changed {
			t.Errorf("%q: read as %+v; want ok and changed", tc.in, r)
		}
		if tc.at != 0 {
			if r.admitted.key != tc.key || r.admitted.at != tc.at || r.intent != nil {
				t.Errorf("%q: read as %+v, admission %+v", tc.in, r, r.admitted)
			}
			if r.row["status"] != tc.status || r.row["v"] != tc.v {
				t.Errorf("%q: row %v; want status %q, version %q", tc.in, r.row, tc.status, tc.v)
			}
			continue
		}
		if tc.key == "" {
			// An outcome nobody waits for: ok, and nothing else.
			if r.intent != nil || r.admitted.key != "" || r.row != nil {
				t.Errorf("%q: read as %+v; want no record", tc.in, r)
			}
			continue
		}
		if r.intent == nil || r.intent.key != tc.key || r.intent.imm != imm || r.intent.mut != mut || r.row != nil || r.admitted.key != "" {
			t.Errorf("%q: read as %+v, record %+v", tc.in, r, r.intent)
		}
	}
}

// escape is the scripts' esc: what it makes, unescape reads back, and a
// text without a newline or a backslash is sent as it is.
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

// A guard's flags and boundary go out as constants; each must be the text
// the programs read: explicit key, auto-admit, allow cancelling, a
// character each in that order, and the boundary's own name.
func TestGuardArgumentsSpellFlagsAndBoundary(t *testing.T) {
	for _, e := range []bool{false, true} {
		for _, a := range []bool{false, true} {
			for _, c := range []bool{false, true} {
				req := state.GuardRequest{ExplicitKey: e, AutoAdmit: a, AllowCancelling: c}
				if got, want := guardFlags(req), flag(e)+flag(a)+flag(c); got != want {
					t.Errorf("explicit %v, auto %v, cancelling %v: flags %v; want %q", e, a, c, got, want)
				}
			}
		}
	}
	for _, b := range []state.Boundary{state.BoundaryHTTP, state.BoundaryTunnel, state.BoundaryClaim, state.BoundaryRetry,
		state.BoundaryBrowser, state.BoundaryDelivery, state.BoundaryCustom, "not-one-of-ours"} {
		if got := boundaryArg(b); got != string(b) {
			t.Errorf("boundary %q sent as %v", b, got)
		}
	}
}
