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
