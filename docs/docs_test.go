// The pages' own test, beside them: docs/ holds no Go but this. What a page
// says of one part is checked beside that part (the CLI's synopsis and flags
// in cli, serve's flags and defaults in serve, deploy/ in its own module).
package docs_test

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestDocsStandAlone: the README and docs/ link only to files of the
// repository that exist (and to headings of its pages that exist), never
// outside it.
func TestDocsStandAlone(t *testing.T) {
	const root = ".."
	pages, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	pages = append(pages, filepath.Join(root, "README.md"), filepath.Join(root, "deploy", "README.md"))
	link := regexp.MustCompile(`\]\(([^)\s]+)\)`)
	for _, page := range pages {
		b, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		name, _ := filepath.Rel(root, page)
		if strings.Contains(string(b), "shared/") {
			t.Errorf("%s mentions shared/, which is not part of the repository", name)
		}
		for _, m := range link.FindAllStringSubmatch(string(b), -1) {
			target := m[1]
			if strings.HasPrefix(target, "http://") || strings.HasPrefix(target, "https://") {
				continue
			}
			file, anchor, _ := strings.Cut(target, "#")
			path := page
			if file != "" {
				path = filepath.Join(filepath.Dir(page), file)
			}
			if rel, err := filepath.Rel(root, path); err != nil || strings.HasPrefix(rel, "..") {
				t.Errorf("%s links outside the repository: %s", name, target)
				continue
			}
			if _, err := os.Stat(path); err != nil {
				t.Errorf("%s links to %s, which does not exist", name, target)
				continue
			}
			if anchor != "" && !hasHeading(t, path, anchor) {
				t.Errorf("%s links to %s: no such heading", name, target)
			}
		}
	}
}

// TestDocsNameOnlyTestsThatExist: a test a page names as its evidence is a
// test of the repository, under that name; a test renamed or moved without
// its page leaves the page pointing at nothing.
func TestDocsNameOnlyTestsThatExist(t *testing.T) {
	const root = ".."
	defined := map[string]bool{}
	definition := regexp.MustCompile(`(?m)^func (Test[A-Za-z0-9_]+)\(`)
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "node_modules" || d.Name() == ".git") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range definition.FindAllStringSubmatch(string(b), -1) {
			defined[m[1]] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	pages, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	pages = append(pages, filepath.Join(root, "README.md"), filepath.Join(root, "deploy", "README.md"))
	named := regexp.MustCompile("`(Test[A-Z][A-Za-z0-9_]*)")
	for _, page := range pages {
		b, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		name, _ := filepath.Rel(root, page)
		for _, m := range named.FindAllStringSubmatch(string(b), -1) {
			if !defined[m[1]] {
				t.Errorf("%s names %s, which no test of the repository defines", name, m[1])
			}
		}
	}
}

// hasHeading reports whether the markdown page has a heading whose
// GitHub anchor is anchor.
func hasHeading(t *testing.T, path, anchor string) bool {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	drop := regexp.MustCompile(`[^a-z0-9 _-]`)
	for _, line := range strings.Split(string(b), "\n") {
		if h, ok := strings.CutPrefix(strings.TrimLeft(line, "#"), " "); ok && strings.HasPrefix(line, "#") {
			if strings.ReplaceAll(drop.ReplaceAllString(strings.ToLower(h), ""), " ", "-") == anchor {
				return true
			}
		}
	}
	return false
}
