package redisstore

import (
	"slices"
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
