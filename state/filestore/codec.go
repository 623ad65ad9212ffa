package filestore

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"time"

	"github.com/stopgate/stopgate/state"
)

// Records are stored in a compact binary form: a version byte, then each
// field in a fixed order, numbers as varints, texts length-prefixed, times
// as Unix ms (0 for none). Every step decodes the row and the intent it
// touches and encodes what it changes, so this is on every effect's path;
// JSON cost a fifth of a guard's CPU. Records written by format 1 (JSON,
// first byte '{') are still read.
const codecV1 = 1

// countStates fixes the order of a row's intent counts.
var countStates = state.IntentStates

var errCorrupt = errors.New("record cut short or of an unknown form")

type enc []byte

func (e *enc) uint(n uint64) { *e = binary.AppendUvarint(*e, n) }
func (e *enc) int(n int64)   { *e = binary.AppendVarint(*e, n) }
func (e *enc) text(s string) { e.uint(uint64(len(s))); *e = append(*e, s...) }
func (e *enc) time(t time.Time) {
	if t.IsZero() {
		e.int(0)
		return
	}
	e.int(t.UnixMilli())
}

type dec struct {
	b   []byte
	err error
}

func (d *dec) uint() uint64 {
	n, k := binary.Uvarint(d.b)
	if k <= 0 {
		d.fail()
		return 0
	}
	d.b = d.b[k:]
	return n
}

func (d *dec) int() int64 {
	n, k := binary.Varint(d.b)
	if k <= 0 {
		d.fail()
		return 0
	}
	d.b = d.b[k:]
	return n
}

func (d *dec) text() string { return string(d.bytes()) }

// bytes is the next text as it is stored, without a copy.
func (d *dec) bytes() []byte {
	n := d.uint()
	if d.err != nil || n > uint64(len(d.b)) {
		d.fail()
		return nil
	}
	b := d.b[:n]
	d.b = d.b[n:]
	return b
}

// name is the next text when it is one of a few known names (states,
// boundaries), which it returns without allocating a copy of.
func name[T ~string](d *dec, known []T) T {
	b := d.bytes()
	for _, k := range known {
		if string(k) == string(b) {
			return k
		}
	}
	return T(b)
}

// method is the next text, a request method: the common ones are
// returned without allocating a copy.
func (d *dec) method() string {
	b := d.bytes()
	switch string(b) {
	case "GET":
		return "GET"
	case "POST":
		return "POST"
	case "PUT":
		return "PUT"
	case "PATCH":
		return "PATCH"
	case "DELETE":
		return "DELETE"
	case "HEAD":
		return "HEAD"
	case "CONNECT":
		return "CONNECT"
	}
	return string(b)
}

func (d *dec) time() time.Time {
	ms := d.int()
	if ms == 0 {
		return time.Time{}
	}
	return time.UnixMilli(ms).UTC()
}

func (d *dec) fail() {
	if d.err == nil {
		d.err = errCorrupt
	}
	d.b = nil
}

func isJSON(raw []byte) bool { return len(raw) > 0 && raw[0] == '{' }

func encodeRow(r rowRecord) []byte {
	e := make(enc, 0, 64+len(r.Reason)+len(r.StatusReason))
	e = append(e, codecV1)
	e.text(string(r.Status))
	e.int(r.CancelVersion)
	e.text(r.Reason)
	e.text(r.StatusReason)
	e.time(r.CreatedAt)
	e.time(r.UpdatedAt)
	e.time(r.CancelledAt)
	e.time(r.DrainDeadline)
	e.time(r.PrunedAt)
	e.int(r.Retention)
	for _, st := range countStates {
		e.uint(uint64(r.Intents[st]))
	}
	// The budget and the usage come last: a row written before them ends
	// here, and reads as a run without either.
	e.text(r.Budget.Text())
	e.uint(uint64(len(r.Usage)))
	for name, n := range r.Usage {
		e.text(name)
		e.int(n)
	}
	return e
}

func decodeRow(id string, raw []byte) (rowRecord, error) {
	var r rowRecord
	if isJSON(raw) {
		err := json.Unmarshal(raw, &r)
		return r, err
	}
	if len(raw) == 0 || raw[0] != codecV1 {
		return r, errCorrupt
	}
	d := dec{b: raw[1:]}
	r.ID = id
	r.Status = state.Status(d.text())
	r.CancelVersion = d.int()
	r.Reason = d.text()
	r.StatusReason = d.text()
	r.CreatedAt = d.time()
	r.UpdatedAt = d.time()
	r.CancelledAt = d.time()
	r.DrainDeadline = d.time()
	r.PrunedAt = d.time()
	r.Retention = d.int()
	r.Intents = make(map[state.IntentState]int, 4)
	for _, st := range countStates {
		if n := d.uint(); n != 0 {
			r.Intents[st] = int(n)
		}
	}
	if d.err != nil || len(d.b) == 0 {
		return r, d.err
	}
	if text := d.text(); text != "" && d.err == nil {
		b, err := state.ParseBudgetText(text)
		if err != nil {
			return r, err
		}
		r.Budget = b
	}
	if n := d.uint(); n > 0 && d.err == nil {
		r.Usage = make(state.Usage, n)
		for range n {
			name := d.text()
			r.Usage[name] = d.int()
		}
	}
	return r, d.err
}

func encodeIntent(rec *intentRecord) []byte {
	in := &rec.Intent
	e := make(enc, 0, 96+len(in.Target)+len(in.Reason)+len(in.Method)+len(in.LeaseOwner))
	e = append(e, codecV1)
	e.uint(rec.Seq)
	e.text(string(in.Boundary))
	e.text(string(in.State))
	e.text(in.Method)
	e.text(in.Target)
	e.text(in.BodyDigest)
	e.int(int64(in.StatusCode))
	e.int(int64(in.Attempts))
	e.int(int64(in.Refusals))
	e.int(in.ObservedVersion)
	e.text(in.Reason)
	e.text(in.Source)
	e.text(in.Note)
	e.text(in.LeaseOwner)
	e.time(in.LeaseExpires)
	e.time(in.NotBefore)
	e.time(in.CreatedAt)
	e.time(in.UpdatedAt)
	return e
}

func decodeIntent(runID, key string, raw []byte) (intentRecord, error) {
	var rec intentRecord
	if isJSON(raw) {
		err := json.Unmarshal(raw, &rec)
		return rec, err
	}
	if len(raw) == 0 || raw[0] != codecV1 {
		return rec, errCorrupt
	}
	d := dec{b: raw[1:]}
	in := &rec.Intent
	in.RunID, in.Key = runID, key
	rec.Seq = d.uint()
	in.Boundary = name(&d, state.Boundaries)
	in.State = name(&d, state.IntentStates)
	in.Method = d.method()
	in.Target = d.text()
	in.BodyDigest = d.text()
	in.StatusCode = int(d.int())
	in.Attempts = int(d.int())
	in.Refusals = int(d.int())
	in.ObservedVersion = d.int()
	in.Reason = d.text()
	in.Source = d.text()
	in.Note = d.text()
	in.LeaseOwner = d.text()
	in.LeaseExpires = d.time()
	in.NotBefore = d.time()
	in.CreatedAt = d.time()
	in.UpdatedAt = d.time()
	return rec, d.err
}

func encodeEvent(ev state.Event) []byte {
	e := make(enc, 0, 48+len(ev.Actor)+len(ev.Reason)+len(ev.Intent))
	e = append(e, codecV1)
	e.time(ev.At)
	e.text(ev.Actor)
	e.text(ev.Kind)
	e.text(ev.Reason)
	e.text(ev.From)
	e.text(ev.To)
	e.text(ev.Intent)
	e.int(ev.Version)
	return e
}

func decodeEvent(runID string, raw []byte) (state.Event, error) {
	var ev state.Event
	if isJSON(raw) {
		err := json.Unmarshal(raw, &ev)
		return ev, err
	}
	if len(raw) == 0 || raw[0] != codecV1 {
		return ev, errCorrupt
	}
	d := dec{b: raw[1:]}
	ev.RunID = runID
	ev.At = d.time()
	ev.Actor = d.text()
	ev.Kind = d.text()
	ev.Reason = d.text()
	ev.From = d.text()
	ev.To = d.text()
	ev.Intent = d.text()
	ev.Version = d.int()
	return ev, d.err
}
