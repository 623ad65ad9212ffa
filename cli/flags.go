package cli

import (
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"strings"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/redirect"
)

// parseInterspersed parses flags anywhere among args, as operators type
// them ("cancel r1 --reason x" as well as "cancel --reason x r1"), and
// returns the positional arguments in order. Everything after a bare "--"
// is positional.
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		consumed := len(args) - len(rest)
		if consumed > 0 && args[consumed-1] == "--" && !isFlagValue(fs, args, consumed-1) {
			return append(pos, rest...), nil
		}
		// The flag package stops at the first positional: keep it and go on.
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

// isFlagValue reports whether args[i] was consumed as the value of the
// flag before it ("--reason --"), rather than being the terminator.
func isFlagValue(fs *flag.FlagSet, args []string, i int) bool {
	if i == 0 {
		return false
	}
	prev := args[i-1]
	if !strings.HasPrefix(prev, "-") || strings.Contains(prev, "=") {
		return false
	}
	f := fs.Lookup(strings.TrimLeft(prev, "-"))
	if f == nil {
		return false
	}
	if b, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && b.IsBoolFlag() {
		return false
	}
	return true
}

// flagError turns the flag package's error into a usage error of verb,
// leaving -h (flag.ErrHelp) as it is.
func flagError(verb string, err error) error {
	if errors.Is(err, flag.ErrHelp) {
		return err
	}
	return usagef(verb, "%v", err)
}

// ttlFlag defines a flag taking a positive duration as the API's TTL
// fields read one (a Go duration or seconds). Left unset, *dst stays nil:
// the server's default.
func ttlFlag(fs *flag.FlagSet, dst **time.Duration, name, usage string) {
	fs.Func(name, usage, func(s string) error {
		d, err := control.ParseTTL(s)
		if err != nil {
			return err
		}
		if d <= 0 {
			return fmt.Errorf("%s %s is not positive", name, d)
		}
		*dst = &d
		return nil
	})
}

// resolversFlag is a repeatable --dns, each resolver read as it is given
// so that a bad one is refused naming the flag. None given leaves the list
// nil: /etc/resolv.conf's, read by whoever uses them.
type resolversFlag struct{ list *[]netip.AddrPort }

func (f resolversFlag) String() string {
	if f.list == nil {
		return ""
	}
	return addrList(*f.list)
}

func (f resolversFlag) Set(s string) error {
	ap, err := redirect.ParseResolver(s)
	if err != nil {
		return err
	}
	*f.list = append(*f.list, ap)
	return nil
}
