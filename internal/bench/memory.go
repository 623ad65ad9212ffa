package bench

import (
	"context"
	"fmt"
	"net/http"
)

// memoryPhase measures what Redis keeps per run and per intent, from the
// outside: INFO memory before and after runs admitted through the control
// API and requests sent through the proxy.
func (e *env) memoryPhase(ctx context.Context, p *mainProcs) (*table, error) {
	r, sg := p.everysec, p.sgEverysec
	t := &table{
		title:  "Redis memory (INFO memory used_memory, before and after)",
		left:   2,
		header: []string{"what was added", "how", "count", "Δ used_memory", "per item"},
	}
	e.cfg.logf("memory: admitting %d runs through the control API", e.cfg.MemRuns)
	before, err := r.usedMemory(ctx)
	if err != nil {
		return nil, err
	}
	err = parallel(ctx, e.cfg.MemRuns, 16, func(ctx context.Context, i int) error {
		code, body, err := sg.control(ctx, http.MethodPost, "/v1/runs", fmt.Sprintf(`{"run_id":"mem-run-%d"}`, i))
		if err != nil {
			return err
		}
		if code != http.StatusOK && code != http.StatusCreated {
			return fmt.Errorf("admit mem-run-%d: %d %s", i, code, body)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	after, err := r.usedMemory(ctx)
	if err != nil {
		return nil, err
	}
	t.add("runs (ACTIVE, admitted)", "POST /v1/runs", thousands(float64(e.cfg.MemRuns)), bytesCell(float64(after-before)), bytesCell(float64(after-before)/float64(e.cfg.MemRuns)))

	e.cfg.logf("memory: %d GETs through the proxy in one run", e.cfg.MemIntents)
	before = after
	spec := loadSpec{Conns: 16, Method: http.MethodGet, URL: e.up.HTTPURL + "/small", Proxy: sg.proxyURL("mem-intents"), RequireHeader: headerIntent}
	if err := driveRequests(ctx, spec, e.cfg.MemIntents); err != nil {
		return nil, fmt.Errorf("memory: requests through the proxy: %w", err)
	}
	if after, err = r.usedMemory(ctx); err != nil {
		return nil, err
	}
	t.add("intents (RESPONDED GETs, one run)", "GET through the proxy", thousands(float64(e.cfg.MemIntents)), bytesCell(float64(after-before)), bytesCell(float64(after-before)/float64(e.cfg.MemIntents)))
	t.notes = append(t.notes, "Per item is Δ used_memory ÷ count: the row, its indexes and its audit events (an intent: guard and outcome). The stored-volume table below adds the same for bulk-loaded runs and intents.")
	return t, nil
}
