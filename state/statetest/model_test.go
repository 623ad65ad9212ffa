package statetest

import (
	"testing"

	"github.com/stopgate/stopgate/state"
)

// TestModelConformance: the model passes the suite the stores pass.
func TestModelConformance(t *testing.T) {
	Run(t, func(t *testing.T) state.Store { return NewModel() })
}
