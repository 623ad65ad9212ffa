//go:build !linux

package evidence_test

import (
	"testing"

	"github.com/stopgate/stopgate/internal/evidence"
)

func caseTransparentInFlight(*testing.T, int, *[]evidence.Round) {
	panic(skipCase("transparent mode needs Linux (iptables REDIRECT, SO_ORIGINAL_DST, network namespaces)"))
}
