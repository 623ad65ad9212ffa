package filestore

import (
	"encoding/binary"
	"maps"

	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/machine"
)

// The embedded store decides nothing: each step reads its run in the
// write transaction (txView), hands it to the rules of package machine,
// and applies the mutation they answer in the same transaction, where
// what the rules read cannot have changed.

// txView is one run as a rule reads it inside a write transaction. It
// keeps the records it decoded, whose places in the creation order
// (Seq) the mutation's writes keep.
type txView struct {
	t    *txn
	id   string
	r    *runTx // nil for a run never seen
	recs map[string]*intentRecord
}

func (t *txn) view(id string) (*txView, error) {
	r, found, err := t.run(id)
	if err != nil {
		return nil, err
	}
	if !found {
		r = nil
	}
	return &txView{t: t, id: id, r: r}, nil
}

func (v *txView) Row() (state.Run, bool, error) {
	if v.r == nil {
		return state.Run{}, false, nil
	}
	row := v.r.row
	row.Intents = maps.Clone(row.Intents)
	return row, true, nil
}

func (v *txView) Intent(key string) (state.Intent, bool, error) {
	if v.r == nil {
		return state.Intent{}, false, nil
	}
	rec, found, err := v.r.intent(key)
	if err != nil || !found {
		return state.Intent{}, false, err
	}
	v.keep(rec)
	return rec.Intent, true, nil
}

func (v *txView) Taken(key string) (bool, error) {
	if v.r == nil {
		return false, nil
	}
	return v.r.get(v.r.b.Bucket([]byte(bucketIntents)), []byte(key)) != nil, nil
}

func (v *txView) keep(rec *intentRecord) {
	if v.recs == nil {
		v.recs = map[string]*intentRecord{}
	}
	v.recs[rec.Key] = rec
}

func (v *txView) Derived(base string) (int64, error) {
	if v.r == nil {
		return 0, nil
	}
	raw := v.r.get(v.r.b.Bucket([]byte(bucketSeq)), []byte(base))
	if raw == nil {
		return 0, nil
	}
	if len(raw) != 8 {
		return 0, storeErr("run %s: derived key counter for %s is %d bytes", v.id, base, len(raw))
	}
	return int64(binary.BigEndian.Uint64(raw)), nil
}

func (v *txView) pending(want state.IntentState) ([]state.Intent, error) {
	if v.r == nil {
		return nil, nil
	}
	var out []state.Intent
	err := v.r.eachPending(want, func(rec *intentRecord) error {
		v.keep(rec)
		out = append(out, rec.Intent)
		return nil
	})
	return out, err
}

func (v *txView) InFlight() ([]state.Intent, error)  { return v.pending(state.IntentInFlight) }
func (v *txView) Scheduled() ([]state.Intent, error) { return v.pending(state.IntentScheduled) }

// apply writes a rule's mutation into the transaction the view was read
// in; its expectations hold by construction.
func (v *txView) apply(m *machine.Mutation) error {
	if m == nil {
		return nil
	}
	t := v.t
	if m.Create {
		r, err := t.createRun(v.id, m.Row.Status, m.Row.CancelVersion)
		if err != nil {
			return err
		}
		v.r = r
	}
	r := v.r
	if m.Create || m.RowChanged {
		h := m.Row
		r.row.Status, r.row.CancelVersion, r.row.Reason, r.row.StatusReason = h.Status, h.CancelVersion, h.Reason, h.StatusReason
		r.row.CreatedAt, r.row.UpdatedAt, r.row.CancelledAt, r.row.DrainDeadline = h.CreatedAt, h.UpdatedAt, h.CancelledAt, h.DrainDeadline
		r.dirty = true
	}
	m.Counts.Each(r.count)
	for _, w := range m.Intents {
		rec := &intentRecord{Intent: w.Rec}
		if !w.New() {
			if old := v.recs[w.Rec.Key]; old != nil {
				rec.Seq = old.Seq
			} else if old, found, err := r.intent(w.Rec.Key); err != nil {
				return err
			} else if found {
				rec.Seq = old.Seq
			}
		}
		if err := r.putIntent(rec, w.From); err != nil {
			return err
		}
		v.keep(rec)
	}
	for _, d := range m.Derived {
		if err := t.put(r.b.Bucket([]byte(bucketSeq)), []byte(d.Base), u64(uint64(d.N))); err != nil {
			return err
		}
	}
	for _, e := range m.Events {
		if err := r.event(e); err != nil {
			return err
		}
	}
	if err := t.tally(m.Tally); err != nil {
		return err
	}
	if r.row.Final() {
		// Whatever is recorded against a final run (a refusal, a note, a
		// pruned run's new record) leaves with it at retention.
		if err := r.keepForRetention(); err != nil {
			return err
		}
	}
	return r.save()
}

// tally adds a step's changes to the totals, in its transaction.
func (t *txn) tally(deltas []machine.TallyDelta) error {
	if len(deltas) == 0 {
		return nil
	}
	b := t.tx.Bucket([]byte(bucketTotals))
	for _, d := range deltas {
		var n int64
		if raw := b.Get([]byte(d.Name)); raw != nil {
			if len(raw) != 8 {
				return storeErr("total %s is %d bytes", d.Name, len(raw))
			}
			n = int64(binary.BigEndian.Uint64(raw))
		}
		if err := t.put(b, []byte(d.Name), u64(uint64(n+d.N))); err != nil {
			return err
		}
	}
	return nil
}
