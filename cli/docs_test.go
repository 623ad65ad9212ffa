package cli

import (
	"context"
	"flag"
	"io"
	"os"
	"regexp"
	"strings"
	"testing"
)

// The usage in usage.go is the one source of how each verb is written:
// `stopgate help` prints it, and docs/cli.md is held to it here.

func cliDocs(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("../docs/cli.md")
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestDocsSynopsisIsTheUsage: docs/cli.md opens with every verb's synopsis,
// in the order and the words `stopgate help` gives them.
func TestDocsSynopsisIsTheUsage(t *testing.T) {
	page := cliDocs(t)
	block := regexp.MustCompile("(?s)```\n(stopgate .*?)\n```").FindStringSubmatch(page)
	if block == nil {
		t.Fatal("docs/cli.md has no synopsis block (``` then stopgate VERB lines)")
	}
	var want []string
	for _, v := range verbs {
		want = append(want, "stopgate "+v.synopsis)
	}
	got := strings.Split(block[1], "\n")
	for i := range max(len(got), len(want)) {
		var g, w string
		if i < len(got) {
			g = got[i]
		}
		if i < len(want) {
			w = want[i]
		}
		if g != w {
			t.Errorf("docs/cli.md synopsis line %d:\n  docs:  %s\n  usage: %s", i+1, g, w)
		}
	}
}

// TestEveryVerbFlagIsDocumented: each flag of each verb is named in
// docs/cli.md (serve's rows are serve's TestEveryServeFlagIsDocumented).
func TestEveryVerbFlagIsDocumented(t *testing.T) {
	page := cliDocs(t)
	c := newCLI(io.Discard, io.Discard, env(nil))
	for _, v := range verbs {
		fs := c.flagSet(v.name)
		if fs == nil || v.name == "serve" {
			continue
		}
		fs.VisitAll(func(f *flag.Flag) {
			if !regexp.MustCompile(`--` + regexp.QuoteMeta(f.Name) + `([^a-z-]|$)`).MatchString(page) {
				t.Errorf("docs/cli.md does not name --%s of %s", f.Name, v.name)
			}
		})
	}
}

// TestEveryVerbInTheUsageRuns: each verb the usage lists is one the CLI
// runs, and its -h prints its usage: the list and the dispatch agree.
func TestEveryVerbInTheUsageRuns(t *testing.T) {
	for _, v := range verbs {
		if v.name == "help" {
			continue
		}
		var out strings.Builder
		c := newCLI(&out, io.Discard, env(nil))
		if code := c.run(context.Background(), []string{v.name, "-h"}); code != ExitOK || !strings.HasPrefix(out.String(), "Usage: stopgate "+v.synopsis+"\n") {
			t.Errorf("stopgate %s -h: exit %d\n%s", v.name, code, out.String())
		}
	}
	var out strings.Builder
	if code := newCLI(&out, io.Discard, env(nil)).run(context.Background(), []string{"help"}); code != ExitOK {
		t.Fatalf("stopgate help: exit %d", code)
	}
	for _, v := range verbs {
		if !strings.Contains(out.String(), "  stopgate "+v.synopsis) || !strings.Contains(out.String(), v.summary) {
			t.Errorf("stopgate help lacks %s's synopsis or summary:\n%s", v.name, out.String())
		}
	}
}
