package cli

import (
	"context"
	"fmt"
	"io"
	"strings"

	"github.com/stopgate/stopgate/control"
)

// storeVerb is stopgate store SUBCOMMAND: the store's own acts.
func (c *cli) storeVerb(ctx context.Context, args []string) error {
	if len(args) == 0 || strings.HasPrefix(args[0], "-") {
		if len(args) > 0 && isHelpFlag(args[0]) {
			return c.help([]string{"store"})
		}
		return usagef("store", "want a subcommand: acknowledge-reset")
	}
	if args[0] != "acknowledge-reset" {
		return usagef("store", "unknown subcommand %q: want acknowledge-reset", args[0])
	}
	cl, o, _, err := c.parseVerb("store", args[1:])
	if err != nil {
		return err
	}
	if o.reason == "" {
		return usagef("store", "acknowledge-reset needs --reason: say what was done about the runs the store lost")
	}
	reply, err := cl.AcknowledgeReset(ctx, o.reason)
	return show(c, o, reply, err, func(w io.Writer, m control.StoreMarker) {
		fmt.Fprintf(w, "acknowledged the store's reset (%s, by %s); runs are admitted again (marker epoch %d)\n",
			safe(m.ResetReason), safe(m.ResetBy), m.Epoch)
	})
}

func isHelpFlag(a string) bool {
	switch a {
	case "-h", "-help", "--help":
		return true
	}
	return false
}
