package redisstore

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/stopgate/stopgate/state"
)

// An intent, as the scripts store it (lua/prelude.lua): two fields of the
// run's hash, i:KEY (what the guard recorded once) and s:KEY (what moves):
//
//	i:KEY  "boundary created ord observed" then, a line each: method,
//	       target, digest
//	s:KEY  "state attempts refusals code lease updated not_before" then, a
//	       line each: owner, reason, source, note
//
// A text with a newline or a backslash in it is escaped (\n, \\); times
// are Unix ms; an empty not_before is "-". The observed version and
// not_before stay decimal text because Lua numbers are doubles and could not
// carry every int64 a caller may send. Runs written before layout 2 keep
// JSON records in a hash of their own (legacyRecord) until a step of this
// layout moves them.

// decodeIntent reads a stored intent; ord is its place in the run's
// creation order.
func decodeIntent(runID, key, imm, mut string) (state.Intent, int64, error) {
	bad := func(what string) (state.Intent, int64, error) {
		return state.Intent{}, 0, fmt.Errorf("intent %s of run %s: %s", key, runID, what)
	}
	var il, f [4]string
	if !cut(imm, '\n', il[:]) || !cut(il[0], ' ', f[:]) {
		return bad("field i: is not \"boundary created ord observed\" and three lines")
	}
	num := func(s string) int64 { n, _ := strconv.ParseInt(s, 10, 64); return n }
	in := state.Intent{RunID: runID, Key: key, Boundary: state.Boundary(f[0]), CreatedAt: msTime(num(f[1])),
		ObservedVersion: num(f[3]), Method: unescape(il[1]), Target: unescape(il[2]), BodyDigest: unescape(il[3])}
	ord := num(f[2])

	var ml [5]string
	var g [7]string
	if !cut(mut, '\n', ml[:]) || !cut(ml[0], ' ', g[:]) {
		return bad("field s: is not \"state attempts refusals code lease updated not_before\" and four lines")
	}
	in.State = state.IntentState(g[0])
	in.Attempts, in.Refusals, in.StatusCode = int(num(g[1])), int(num(g[2])), int(num(g[3]))
	if ms := num(g[4]); ms != 0 {
		in.LeaseExpires = msTime(ms)
	}
	in.UpdatedAt = msTime(num(g[5]))
	if g[6] != "-" {
		in.NotBefore = msTime(num(g[6]))
	}
	in.LeaseOwner, in.Reason, in.Source, in.Note = unescape(ml[1]), unescape(ml[2]), unescape(ml[3]), unescape(ml[4])
	return in, ord, nil
}

// admittedIntent is the record a guard on the batch's common path wrote
// (lua/batch.lua: a new effect admitted IN_FLIGHT, leased to its owner),
// put together from the request it was sent for, its key and the step's
// time: the answer carries nothing else of it.
func admittedIntent(req state.GuardRequest, key string, at int64) state.Intent {
	return state.Intent{RunID: req.RunID, Key: key, Boundary: req.Boundary, CreatedAt: msTime(at),
		ObservedVersion: req.ObservedVersion, Method: req.Method, Target: req.Target, BodyDigest: req.BodyDigest,
		State: state.IntentInFlight, Attempts: 1, LeaseOwner: req.LeaseOwner,
		LeaseExpires: msTime(at + ms(req.LeaseTTL)), UpdatedAt: msTime(at)}
}

// cut splits s at each sep into parts, and reports whether it had exactly
// len(parts) of them. Unlike strings.Split it allocates nothing: a record
// is decoded for every guard and outcome.
func cut(s string, sep byte, parts []string) bool {
	last := len(parts) - 1
	for i := range last {
		j := strings.IndexByte(s, sep)
		if j < 0 {
			return false
		}
		parts[i], s = s[:j], s[j+1:]
	}
	parts[last] = s
	return strings.IndexByte(s, sep) < 0
}

// escape escapes a text as the scripts do (esc in lua/prelude.lua): a
// newline is \n, a backslash \\. A guard's method, target and digest go to
// the scripts so, the lines of its record as they are stored.
func escape(s string) string {
	if !strings.ContainsAny(s, "\n\\") {
		return s
	}
	var b strings.Builder
	b.Grow(len(s) + 8)
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '\n':
			b.WriteString(`\n`)
		case '\\':
			b.WriteString(`\\`)
		default:
			b.WriteByte(s[i])
		}
	}
	return b.String()
}

// unescape undoes the scripts' escaping of a text: \n is a newline, \\ a
// backslash.
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+1 < len(s) {
			i++
			if s[i] == 'n' {
				b.WriteByte('\n')
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// eventsOf reads one entry of a run's audit stream, its fields in order
// (name, value, name, value, ...): fields e, each holding events of three
// lines, "kind version from to intent" then actor and reason (escaped,
// lua/prelude.lua, event_line), one after the other: the general rules
// write an event a field, a batch the events of a run's common steps in
// one. The events of one entry share its time. An entry written before
// layout 2 is one event with a field each, and its time in 'at'.
func eventsOf(runID, id string, fields []string) []state.Event {
	ms, _, _ := strings.Cut(id, "-")
	at, _ := strconv.ParseInt(ms, 10, 64)
	var out []state.Event
	old := map[string]string{}
	for i := 0; i+1 < len(fields); i += 2 {
		name, e := fields[i], fields[i+1]
		if name != "e" {
			old[name] = e
			continue
		}
		for more := true; more; {
			var lines [3]string
			for k := range lines {
				lines[k], e, more = strings.Cut(e, "\n")
				if !more {
					break
				}
			}
			f := strings.SplitN(lines[0], " ", 5)
			for len(f) < 5 {
				f = append(f, "")
			}
			v, _ := strconv.ParseInt(f[1], 10, 64)
			out = append(out, state.Event{At: msTime(at), RunID: runID, Kind: f[0], Version: v, From: f[2], To: f[3], Intent: f[4],
				Actor: unescape(lines[1]), Reason: unescape(lines[2])})
		}
	}
	if out != nil {
		return out
	}
	if t, err := strconv.ParseInt(old["at"], 10, 64); err == nil {
		at = t
	}
	v, _ := strconv.ParseInt(old["v"], 10, 64)
	return []state.Event{{At: msTime(at), RunID: runID, Actor: old["actor"], Kind: old["kind"], Reason: old["reason"],
		From: old["from"], To: old["to"], Intent: old["intent"], Version: v}}
}

// legacyRecord is an intent as layout 1 stored it: JSON.
type legacyRecord struct {
	Boundary        string `json:"boundary"`
	State           string `json:"state"`
	Method          string `json:"method"`
	Target          string `json:"target"`
	BodyDigest      string `json:"body_digest"`
	StatusCode      int    `json:"status_code"`
	Attempts        int    `json:"attempts"`
	Refusals        int    `json:"refusals"`
	ObservedVersion string `json:"observed_version"`
	Reason          string `json:"reason"`
	Source          string `json:"source"`
	Note            string `json:"note"`
	LeaseOwner      string `json:"lease_owner"`
	LeaseExpires    int64  `json:"lease_expires"`
	NotBefore       string `json:"not_before"`
	CreatedAt       int64  `json:"created_at"`
	UpdatedAt       int64  `json:"updated_at"`
	Ord             int64  `json:"ord"`
}

func decodeLegacy(runID, key, raw string) (state.Intent, int64, error) {
	var r legacyRecord
	if err := json.Unmarshal([]byte(raw), &r); err != nil {
		return state.Intent{}, 0, fmt.Errorf("intent %s of run %s: %w", key, runID, err)
	}
	in := state.Intent{
		RunID: runID, Key: key, Boundary: state.Boundary(r.Boundary), State: state.IntentState(r.State),
		Method: r.Method, Target: r.Target, BodyDigest: r.BodyDigest, StatusCode: r.StatusCode,
		Attempts: r.Attempts, Refusals: r.Refusals, Reason: r.Reason, Source: r.Source, Note: r.Note,
		LeaseOwner: r.LeaseOwner, CreatedAt: msTime(r.CreatedAt), UpdatedAt: msTime(r.UpdatedAt),
	}
	in.ObservedVersion, _ = strconv.ParseInt(r.ObservedVersion, 10, 64)
	if r.LeaseExpires != 0 {
		in.LeaseExpires = msTime(r.LeaseExpires)
	}
	if ms, err := strconv.ParseInt(r.NotBefore, 10, 64); err == nil {
		in.NotBefore = msTime(ms)
	}
	return in, r.Ord, nil
}

func msTime(ms int64) time.Time { return time.UnixMilli(ms).UTC() }

// The record's two fields as stored, made from an intent: what decodeIntent
// reads back. imm's creation ordinal goes between immHead and immTail,
// where the program that writes a new record puts the run's next one.
func immHead(in state.Intent) string {
	var b strings.Builder
	b.Grow(len(in.Boundary) + 16)
	writeImmHead(&b, in)
	return b.String()
}

func writeImmHead(b *strings.Builder, in state.Intent) {
	b.WriteString(string(in.Boundary))
	b.WriteByte(' ')
	writeInt(b, in.CreatedAt.UnixMilli())
	b.WriteByte(' ')
}

func immTail(in state.Intent) string {
	var b strings.Builder
	b.Grow(24 + len(in.Method) + len(in.Target) + len(in.BodyDigest))
	writeImmTail(&b, in)
	return b.String()
}

func writeImmTail(b *strings.Builder, in state.Intent) {
	b.WriteByte(' ')
	writeInt(b, in.ObservedVersion)
	b.WriteByte('\n')
	writeEscaped(b, in.Method)
	b.WriteByte('\n')
	writeEscaped(b, in.Target)
	b.WriteByte('\n')
	writeEscaped(b, in.BodyDigest)
}

func immText(in state.Intent, ord int64) string {
	var b strings.Builder
	b.Grow(48 + len(in.Boundary) + len(in.Method) + len(in.Target) + len(in.BodyDigest))
	writeImmHead(&b, in)
	writeInt(&b, ord)
	writeImmTail(&b, in)
	return b.String()
}

// mutHead is the start of s:KEY that names the record's state, attempt and
// refusals: what an expectation of them checks.
func mutHead(st state.IntentState, attempts, refusals int) string {
	var b strings.Builder
	b.Grow(len(st) + 12)
	writeMutHead(&b, st, attempts, refusals)
	return b.String()
}

func writeMutHead(b *strings.Builder, st state.IntentState, attempts, refusals int) {
	b.WriteString(string(st))
	b.WriteByte(' ')
	writeInt(b, int64(attempts))
	b.WriteByte(' ')
	writeInt(b, int64(refusals))
	b.WriteByte(' ')
}

func mutText(in state.Intent) string {
	var lease int64
	if !in.LeaseExpires.IsZero() {
		lease = in.LeaseExpires.UnixMilli()
	}
	var b strings.Builder
	b.Grow(80 + len(in.LeaseOwner) + len(in.Reason) + len(in.Source) + len(in.Note))
	writeMutHead(&b, in.State, in.Attempts, in.Refusals)
	writeInt(&b, int64(in.StatusCode))
	b.WriteByte(' ')
	writeInt(&b, lease)
	b.WriteByte(' ')
	writeInt(&b, in.UpdatedAt.UnixMilli())
	b.WriteByte(' ')
	if in.NotBefore.IsZero() {
		b.WriteByte('-')
	} else {
		writeInt(&b, in.NotBefore.UnixMilli())
	}
	for _, f := range [...]string{in.LeaseOwner, in.Reason, in.Source, in.Note} {
		b.WriteByte('\n')
		writeEscaped(&b, f)
	}
	return b.String()
}

// eventLine is one event of the audit stream: its kind, version, from, to
// and intent, then its actor and its reason, each on a line.
func eventLine(e state.Event) string {
	var b strings.Builder
	b.Grow(32 + len(e.Kind) + len(e.From) + len(e.To) + len(e.Intent) + len(e.Actor) + len(e.Reason))
	b.WriteString(e.Kind)
	b.WriteByte(' ')
	writeInt(&b, e.Version)
	for _, f := range [...]string{e.From, e.To, e.Intent} {
		b.WriteByte(' ')
		b.WriteString(f)
	}
	b.WriteByte('\n')
	writeEscaped(&b, e.Actor)
	b.WriteByte('\n')
	writeEscaped(&b, e.Reason)
	return b.String()
}

// writeInt writes n in decimal without a string of its own.
func writeInt(b *strings.Builder, n int64) {
	var buf [20]byte
	b.Write(strconv.AppendInt(buf[:0], n, 10))
}

func writeEscaped(b *strings.Builder, s string) {
	if !strings.ContainsAny(s, "\n\\") {
		b.WriteString(s)
		return
	}
	b.WriteString(escape(s))
}

// countField is the row's field counting intents in st.
func countField(st state.IntentState) string {
	switch st {
	case state.IntentInFlight:
		return "n:IN_FLIGHT"
	case state.IntentScheduled:
		return "n:SCHEDULED"
	case state.IntentResponded:
		return "n:RESPONDED"
	case state.IntentNotSent:
		return "n:NOT_SENT"
	case state.IntentUnknown:
		return "n:UNKNOWN"
	case state.IntentCancelledBeforeDispatch:
		return "n:CANCELLED_BEFORE_DISPATCH"
	case state.IntentRevoked:
		return "n:REVOKED"
	case state.IntentApplied:
		return "n:APPLIED"
	case state.IntentNotApplied:
		return "n:NOT_APPLIED"
	}
	return "n:" + string(st)
}
