package testkit

import (
	"encoding/json"
	"fmt"
	"net/http"
)

// CDPCommand is the frame of a DevTools protocol command, as a client
// writes it: params and sessionId only when set.
func CDPCommand(id int64, session, method string, params any) []byte {
	msg := map[string]any{"id": id, "method": method}
	if params != nil {
		msg["params"] = params
	}
	if session != "" {
		msg["sessionId"] = session
	}
	b, err := json.Marshal(msg)
	if err != nil {
		panic(fmt.Sprintf("CDP command %s: params do not encode: %v", method, err))
	}
	return b
}

// DebuggerURL is the webSocketDebuggerUrl of the DevTools /json/version
// document at url.
func DebuggerURL(url string) (string, error) {
	resp, err := http.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	var v struct {
		WS string `json:"webSocketDebuggerUrl"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&v); err != nil {
		return "", fmt.Errorf("GET %s: %w", url, err)
	}
	return v.WS, nil
}

// PageTargets are the ids of the pages in the result of a
// Target.getTargets command.
func PageTargets(result json.RawMessage) ([]string, error) {
	var ts struct {
		TargetInfos []struct {
			TargetID string `json:"targetId"`
			Type     string `json:"type"`
		} `json:"targetInfos"`
	}
	if err := json.Unmarshal(result, &ts); err != nil {
		return nil, fmt.Errorf("Target.getTargets result: %w", err)
	}
	var ids []string
	for _, ti := range ts.TargetInfos {
		if ti.Type == "page" {
			ids = append(ids, ti.TargetID)
		}
	}
	return ids, nil
}
