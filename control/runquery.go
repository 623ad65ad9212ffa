package control

import (
	"cmp"
	"fmt"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/stopgate/stopgate/state"
)

// RunQuery narrows and orders GET /v1/runs (and the console's list of
// runs): which runs, in what order, how many.
type RunQuery struct {
	// Status keeps the runs of one status ("" all).
	Status state.Status
	// Prefix keeps the runs whose id starts with it.
	Prefix string
	// Since and Until keep the runs last updated within them (zero: open).
	Since, Until time.Time
	// Sort is the order: SortByID (the default), SortByUpdated or
	// SortByCreated (those two newest first).
	Sort string
	// Limit keeps the first Limit runs of that order (0: all); the answer
	// says how many more matched.
	Limit int
}

// The orders of a RunQuery.
const (
	SortByID      = "id"
	SortByUpdated = "updated"
	SortByCreated = "created"
)

// MaxRunLimit bounds a RunQuery's Limit.
const MaxRunLimit = 10000

// Values is q as the query string of GET /v1/runs.
func (q RunQuery) Values() url.Values {
	v := url.Values{}
	set := func(k, s string) {
		if s != "" {
			v.Set(k, s)
		}
	}
	set("status", string(q.Status))
	set("prefix", q.Prefix)
	if !q.Since.IsZero() {
		v.Set("since", q.Since.UTC().Format(time.RFC3339Nano))
	}
	if !q.Until.IsZero() {
		v.Set("until", q.Until.UTC().Format(time.RFC3339Nano))
	}
	set("sort", q.Sort)
	if q.Limit > 0 {
		v.Set("limit", strconv.Itoa(q.Limit))
	}
	return v
}

// ParseRunQuery reads a RunQuery from a query string: status, prefix,
// since and until (RFC 3339, or a duration back from now: 90m, 24h),
// sort (id, updated, created) and limit. The error names the parameter.
func ParseRunQuery(v url.Values, now time.Time) (RunQuery, error) {
	var q RunQuery
	bad := func(format string, args ...any) (RunQuery, error) {
		return RunQuery{}, fmt.Errorf("%w: %s", state.ErrInvalid, fmt.Sprintf(format, args...))
	}
	if s := v.Get("status"); s != "" {
		st, err := state.ParseStatus(s)
		if err != nil {
			return bad("status %q: want ACTIVE, CANCELLING, CANCELLED, COMPLETED or UNKNOWN", s)
		}
		q.Status = st
	}
	q.Prefix = v.Get("prefix")
	if len(q.Prefix) > state.MaxRunIDLen {
		return bad("prefix is longer than a run id can be (%d bytes)", state.MaxRunIDLen)
	}
	for _, p := range []struct {
		name string
		into *time.Time
	}{{"since", &q.Since}, {"until", &q.Until}} {
		s := strings.TrimSpace(v.Get(p.name))
		if s == "" {
			continue
		}
		t, err := ParseWhen(s, now)
		if err != nil {
			return bad("%s: %v", p.name, err)
		}
		*p.into = t
	}
	if !q.Since.IsZero() && !q.Until.IsZero() && q.Until.Before(q.Since) {
		return bad("until %s is before since %s", q.Until.Format(time.RFC3339), q.Since.Format(time.RFC3339))
	}
	switch q.Sort = v.Get("sort"); q.Sort {
	case "", SortByID, SortByUpdated, SortByCreated:
	default:
		return bad("sort %q: want id, updated or created", q.Sort)
	}
	if s := v.Get("limit"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > MaxRunLimit {
			return bad("limit %q: want a number from 1 to %d", s, MaxRunLimit)
		}
		q.Limit = n
	}
	return q, nil
}

// ParseWhen reads a time as RFC 3339 (2026-12-01T10:00:00Z) or as a
// duration back from now (90m, 24h).
func ParseWhen(s string, now time.Time) (time.Time, error) {
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	if d, err := time.ParseDuration(s); err == nil && d >= 0 {
		return now.Add(-d), nil
	}
	return time.Time{}, fmt.Errorf("%q is neither an RFC 3339 time (2026-12-01T10:00:00Z) nor a duration back from now (90m, 24h)", s)
}

// Apply keeps the runs q matches, in q's order, at most q.Limit of them;
// more is how many matched beyond the limit.
func (q RunQuery) Apply(runs []state.Run) (out []state.Run, more int) {
	out = make([]state.Run, 0, len(runs))
	for _, r := range runs {
		switch {
		case q.Status != "" && r.Status != q.Status,
			!strings.HasPrefix(r.ID, q.Prefix),
			!q.Since.IsZero() && r.UpdatedAt.Before(q.Since),
			!q.Until.IsZero() && r.UpdatedAt.After(q.Until):
			continue
		}
		out = append(out, r)
	}
	switch q.Sort {
	case SortByUpdated:
		slices.SortStableFunc(out, func(a, b state.Run) int { return cmp.Or(b.UpdatedAt.Compare(a.UpdatedAt), cmp.Compare(a.ID, b.ID)) })
	case SortByCreated:
		slices.SortStableFunc(out, func(a, b state.Run) int { return cmp.Or(b.CreatedAt.Compare(a.CreatedAt), cmp.Compare(a.ID, b.ID)) })
	default:
		slices.SortStableFunc(out, func(a, b state.Run) int { return cmp.Compare(a.ID, b.ID) })
	}
	if q.Limit > 0 && len(out) > q.Limit {
		more = len(out) - q.Limit
		out = out[:q.Limit]
	}
	return out, more
}
