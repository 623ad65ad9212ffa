package agentexec

import (
	"syscall"
	"testing"
)

func TestParseSignal(t *testing.T) {
	for in, want := range map[string]syscall.Signal{"TERM": syscall.SIGTERM, "sigint": syscall.SIGINT, "SIGHUP": syscall.SIGHUP, "9": syscall.SIGKILL, "none": 0} {
		if got, err := ParseSignal(in); err != nil || got != want {
			t.Errorf("ParseSignal(%q) = %v %v, want %v", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "TERMINATE", "0", "99"} {
		if _, err := ParseSignal(bad); err == nil {
			t.Errorf("ParseSignal(%q) accepted", bad)
		}
	}
}

func TestOnlyADNSQueryIsCarried(t *testing.T) {
	query := []byte{0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0, 5, 'a', 'g', 'e', 'n', 't', 4, 't', 'e', 's', 't', 0, 0, 1, 0, 1}
	answer := append([]byte{}, query...)
	answer[2] = 0x81
	for name, tc := range map[string]struct {
		b    []byte
		want bool
	}{
		"a query":        {query, true},
		"an answer":      {answer, false},
		"garbage":        {make([]byte, 1024), false},
		"a short header": {query[:5], false},
	} {
		if got := isQuery(tc.b); got != tc.want {
			t.Errorf("%s: isQuery = %v", name, got)
		}
	}
}
