package main

import (
	"context"
	"fmt"
	"io"
	"strings"

	"github.com/stopgate/stopgate/control"
)

const storeUsage = `Usage: stopgate store acknowledge-reset --reason R [--json]

A Redis store that finds it lost writes it had acknowledged (FLUSHALL or FLUSHDB, a
restart without persistence, an older copy restored, a run's row evicted or deleted) is
marked reset: every instance refuses every admission and every guarded effect (503) and
answers /readyz 503, until an operator acknowledges the reset. First cancel again the
runs the store may have lost (a cancel of a run it no longer has writes its tombstone),
then acknowledge, saying what was done: R goes to the store's marker and to the log of
the instance that takes it. The other instances admit again within their marker check.
`

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
