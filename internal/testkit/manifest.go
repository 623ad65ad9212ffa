package testkit

import (
	"bytes"
	"os"
	"testing"

	"go.yaml.in/yaml/v3"
)

// ObjectHead is what every Kubernetes object begins with, for a test that
// decodes a shipped manifest into a struct of its own (embedded inline).
type ObjectHead struct {
	APIVersion string `yaml:"apiVersion"`
	Kind       string `yaml:"kind"`
	Metadata   struct {
		Name      string            `yaml:"name"`
		Namespace string            `yaml:"namespace"`
		Labels    map[string]string `yaml:"labels"`
	} `yaml:"metadata"`
}

// DecodeStrict decodes the YAML file at path into into, refusing a field
// into does not name: a misspelt field of a manifest is an error, never a
// default.
func DecodeStrict(t testing.TB, path string, into any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(into); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}
