package client

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"iter"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/state"
)

// WatchIdle is how long a watch stream may be silent before the client
// takes the connection for dead and opens another: three of the server's
// heartbeats (control.DefaultWatchHeartbeat).
const WatchIdle = 3 * control.DefaultWatchHeartbeat

// maxEventBytes bounds one line of a watch stream: a row is far smaller.
const maxEventBytes = 1 << 20

// Watch follows the run's row (GET /v1/runs/RUN/watch): it yields the row
// as it stands, then the row at every transition, until the row is final
// (CANCELLED or COMPLETED) or ctx ends. It opens the stream again when the
// connection breaks, goes silent for WatchIdle, or the server ends it
// (shutdown, max_age), and yields only rows further on than the last one it
// yielded, so a caller sees each transition once. An answer that trying
// again cannot change (401, 403, 404, 400) is yielded as an *APIError, and
// the iteration ends.
func (c *Client) Watch(ctx context.Context, runID string) iter.Seq2[state.Run, error] {
	return func(yield func(state.Run, error) bool) {
		var last state.Run
		backoff := 100 * time.Millisecond
		for ctx.Err() == nil {
			final, progressed, err := c.watchOnce(ctx, runID, &last, yield)
			if final {
				return
			}
			if err != nil && !retryableWatch(err) {
				yield(state.Run{}, err)
				return
			}
			if progressed {
				backoff = 100 * time.Millisecond
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, 5*time.Second)
		}
	}
}

// retryableWatch: what may pass (the server restarting, a full instance)
// is tried again; a refusal of the request itself is not.
func retryableWatch(err error) bool {
	var ae *APIError
	if errors.As(err, &ae) {
		return ae.StatusCode == http.StatusTooManyRequests || ae.StatusCode >= 500
	}
	return true
}

// errStop ends a stream whose caller stopped iterating.
var errStop = errors.New("stopped")

// watchOnce reads one stream. final is true when iteration must end (the
// run is final, or the caller stopped); progressed when the stream got
// as far as its first event.
func (c *Client) watchOnce(ctx context.Context, runID string, last *state.Run, yield func(state.Run, error) bool) (final, progressed bool, err error) {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	req, err := c.request(sctx, http.MethodGet, runPath(runID, "watch"), nil, nil)
	if err != nil {
		return false, false, err
	}
	req.Header.Set("Accept", "text/event-stream")
	resp, err := c.long.Do(req)
	if err != nil {
		return false, false, fmt.Errorf("cannot reach the control API at %s: %w", c.base.Redacted(), unwrapURLError(err))
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		raw, _ := io.ReadAll(io.LimitReader(resp.Body, maxEventBytes))
		return false, false, apiError(resp, raw)
	}
	// A silent stream is a dead one: cancelling the request ends the read.
	idle := time.AfterFunc(WatchIdle, cancel)
	defer idle.Stop()
	br := bufio.NewReaderSize(resp.Body, 4096)
	var event string
	var data []byte
	for {
		line, err := readLine(br)
		if err != nil {
			return false, progressed, fmt.Errorf("watch of %s: %w", runID, err)
		}
		idle.Reset(WatchIdle)
		switch {
		case len(line) == 0: // the end of one event
			if event == "" && data == nil {
				continue
			}
			progressed = true
			stop, err := deliver(event, data, last, yield)
			if stop || err != nil {
				return stop, progressed, err
			}
			event, data = "", nil
		case line[0] == ':': // a heartbeat
		default:
			field, value, _ := bytes.Cut(line, []byte(":"))
			value = bytes.TrimPrefix(value, []byte(" "))
			switch string(field) {
			case "event":
				event = string(value)
			case "data":
				data = append(data, value...)
			}
		}
	}
}

// deliver handles one event: a row further on is yielded; an end says
// whether to open the stream again.
func deliver(event string, data []byte, last *state.Run, yield func(state.Run, error) bool) (stop bool, err error) {
	switch event {
	case "run":
		var row state.Run
		if err := json.Unmarshal(data, &row); err != nil {
			return false, fmt.Errorf("watch event is not a row: %w", err)
		}
		if !control.After(row, last.CancelVersion, last.Status) {
			return false, nil
		}
		*last = row
		if !yield(row, nil) {
			return true, nil
		}
		return row.Final(), nil
	case "end":
		var end control.WatchEnd
		_ = json.Unmarshal(data, &end)
		if end.Reason == control.WatchEndFinal {
			return true, nil
		}
		return false, fmt.Errorf("the server ended the watch (%s)", end.Reason)
	}
	return false, nil
}

func readLine(br *bufio.Reader) ([]byte, error) {
	var line []byte
	for {
		chunk, isPrefix, err := br.ReadLine()
		if err != nil {
			return nil, err
		}
		line = append(line, chunk...)
		if len(line) > maxEventBytes {
			return nil, fmt.Errorf("a line of the stream is longer than %d bytes", maxEventBytes)
		}
		if !isPrefix {
			return line, nil
		}
	}
}

// Poll long-polls the run (GET /v1/runs/RUN/watch?after_version=…): the
// answer comes once the row is no longer at held's cancel_version and
// status (at once if it already is not, or is final), or as it stands
// after wait (at most control.MaxPollWait). Reply.Value is the row either
// way: control.After(row, held.CancelVersion, held.Status) tells a
// transition from a wait that ran out.
func (c *Client) Poll(ctx context.Context, runID string, held state.Run, wait time.Duration) (Reply[state.Run], error) {
	q := url.Values{
		"after_version": {strconv.FormatInt(held.CancelVersion, 10)},
		"after_status":  {string(held.Status)},
		"wait":          {wait.String()},
	}
	ctx, cancel := context.WithTimeout(ctx, wait+DefaultTimeout)
	defer cancel()
	var reply Reply[state.Run]
	raw, status, err := c.doWith(ctx, c.long, http.MethodGet, runPath(runID, "watch"), q, nil)
	if err != nil {
		return reply, err
	}
	reply.StatusCode, reply.Body = status, bytes.TrimSpace(raw)
	if err := json.Unmarshal(raw, &reply.Value); err != nil {
		return reply, fmt.Errorf("poll of %s: answer %d is not a row: %w", runID, status, err)
	}
	return reply, nil
}
