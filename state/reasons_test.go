package state_test

import (
	"os"
	"strings"
	"testing"

	"github.com/stopgate/stopgate/state"
)

// TestReasonsAreTheDocumentedWords pins the reasons every edge records and
// every reader (the audit, the console, the chart, the metrics) reads to
// the words the docs give them. Code says state.Reason*; this is the one
// place their spelling is written out, against the page that promises it.
func TestReasonsAreTheDocumentedWords(t *testing.T) {
	page := func(name string) string {
		b, err := os.ReadFile("../docs/" + name)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	machine, metrics := page("state-machine.md"), page("metrics.md")
	for reason, want := range map[string]struct{ word, doc string }{
		state.ReasonAutoAdmit:                      {"auto-admit", machine},
		state.ReasonDrained:                        {"drained", machine},
		state.ReasonUnresolved:                     {"unresolved_intents", machine},
		state.ReasonDrainTimeout:                   {"drain_timeout", machine},
		state.ReasonReconciled:                     {"reconciled", machine},
		state.ReasonLeaseExpired:                   {"lease_expired", machine},
		state.ReasonRunCancelled:                   {"run_cancelled", machine},
		state.ReasonLateResponse:                   {"late_response", machine},
		state.ReasonShutdown:                       {"stopgate_shutdown", metrics},
		state.ReasonRunOver(state.StatusCancelled): {"run_CANCELLED", metrics},
	} {
		if reason != want.word {
			t.Errorf("reason %q: the docs and every record say %q", reason, want.word)
		}
		if !strings.Contains(want.doc, "`"+want.word+"`") {
			t.Errorf("reason %q is in no page that promises it", want.word)
		}
	}
	for reason, cut := range map[string]bool{
		"policy: run_cancelled: safe request":    true,
		state.ReasonDrainTimeout:                 true,
		state.ReasonRunOver(state.StatusUnknown): true,
		state.ReasonShutdown:                     true,
		state.ReasonLeaseExpired:                 false,
		"operator pressed stop":                  false,
	} {
		if got := state.CutBy(reason); got != cut {
			t.Errorf("CutBy(%q) = %v, want %v", reason, got, cut)
		}
	}
}
