package browserguard

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestParseCommandReadsWhatTheBrowserReads(t *testing.T) {
	for _, tc := range []struct {
		frame   string
		want    command
		wantErr string
	}{
		{`{"id":1,"method":"Page.navigate","params":{"url":"http://a/"},"sessionId":"S"}`,
			command{ID: 1, HasID: true, Method: "Page.navigate", SessionID: "S", Params: json.RawMessage(`{"url":"http://a/"}`)}, ""},
		{" {\n\"sessionId\":\"S\" , \"method\":\"DOM.getDocument\",\"id\":-3}\n",
			command{ID: -3, HasID: true, Method: "DOM.getDocument", SessionID: "S"}, ""},
		// Names are exact, as the browser reads them: "Method" is not "method".
		{`{"id":2,"Method":"Page.navigate","method":"DOM.getDocument"}`, command{ID: 2, HasID: true, Method: "DOM.getDocument"}, ""},
		{`{"id":3,"method":"Page.reload","params":null}`, command{ID: 3, HasID: true, Method: "Page.reload"}, ""},
		{`{"id":4,"method":"Page.reload","params":[1]}`, command{ID: 4, HasID: true}, "params of command 4 is not an object"},
		{`{"id":2147483648,"method":"Page.reload"}`, command{}, "not a 32-bit integer"},
		{`{"id":1.5,"method":"Page.reload"}`, command{}, "not a 32-bit integer"},
		{`{"id":5,"method":"Page.reload","sessionId":7}`, command{ID: 5, HasID: true, Method: "Page.reload"}, "sessionId is not a string"},
		{`{"id":6,"id":7,"method":"Page.reload"}`, command{ID: 6, HasID: true}, `"id" appears twice`},
		{`{"id":8,"method":"Page.reload"`, command{ID: 8, HasID: true}, "not JSON"},
		{`{"id":9,"method":"Page.reload"}x`, command{ID: 9, HasID: true, Method: ""}, "data after"},
		{``, command{}, "not JSON"},
	} {
		got, err := parseCommand([]byte(tc.frame))
		if tc.wantErr == "" && err != nil || tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)) {
			t.Errorf("%s: error %v, want %q", tc.frame, err, tc.wantErr)
		}
		if got.ID != tc.want.ID || got.HasID != tc.want.HasID || tc.wantErr == "" && (got.Method != tc.want.Method ||
			got.SessionID != tc.want.SessionID || string(got.Params) != string(tc.want.Params)) {
			t.Errorf("%s: got %+v, want %+v", tc.frame, got, tc.want)
		}
	}
}

func TestParseReply(t *testing.T) {
	r := parseReply([]byte(`{"id":4,"result":{"frameId":"F"},"sessionId":"S"}`))
	if !r.HasID || r.ID != 4 || r.SessionID != "S" || r.Err != "" {
		t.Errorf("result: %+v", r)
	}
	r = parseReply([]byte(`{"id":5,"error":{"code":-32000,"message":"Cannot navigate to invalid URL"}}`))
	if !r.HasID || r.ID != 5 || r.Err != "browser answered error -32000: Cannot navigate to invalid URL" {
		t.Errorf("error: %+v", r)
	}
	if r := parseReply([]byte(`{"method":"Page.loadEventFired","params":{}}`)); r.HasID {
		t.Errorf("an event read as a reply: %+v", r)
	}
}

func TestActionsAndTheirRecord(t *testing.T) {
	c := command{Method: "Page.navigate", Params: json.RawMessage(`{"url":"https://user:pw@shop.example/pay?card=4242#x"}`)}
	recorded, keyTarget, digest := effectOf(c)
	if recorded != "https://shop.example/pay" || keyTarget != "https://user:pw@shop.example/pay?card=4242#x" || !strings.HasPrefix(digest, "sha256:") {
		t.Errorf("navigate: %q %q %q", recorded, keyTarget, digest)
	}
	recorded, keyTarget, digest = effectOf(command{Method: "Input.insertText", Params: json.RawMessage(`{"text":"hi"}`)})
	if recorded != "cdp:Input.insertText" || keyTarget != recorded || digest == "" {
		t.Errorf("input: %q %q %q", recorded, keyTarget, digest)
	}
}

// FuzzParseCommand: the guard never panics on a frame, and whatever it
// accepts is one JSON object whose method, read by a plain decoder with
// exact names, is the method the guard classified.
func FuzzParseCommand(f *testing.F) {
	for _, s := range []string{
		`{"id":1,"method":"Page.navigate","params":{"url":"http://a/"}}`,
		`{"id":1,"method":"DOM.getDocument","method":"Page.navigate"}`,
		`{"id":1,"method":"DOM.getDocument","\u006dethod":"Page.navigate"}`,
		`{"id":1,"Method":"Page.navigate","method":"DOM.getDocument"}`,
		`{"id":1e0,"method":"x"}`, `[]`, `{"id":1,"method":"x"}{}`, "{\"id\":1,\"method\":\"\xff\"}",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := parseCommand(data)
		if err != nil {
			return
		}
		if !json.Valid(data) {
			t.Fatalf("accepted invalid JSON %q", data)
		}
		var m map[string]json.RawMessage
		if err := json.Unmarshal(data, &m); err != nil {
			t.Fatalf("accepted %q, which is not an object: %v", data, err)
		}
		var method string
		if err := json.Unmarshal(m["method"], &method); err != nil || method != c.Method {
			t.Fatalf("%q: guard read method %q, a decoder reads %q (%v)", data, c.Method, method, err)
		}
		_ = errorFrame(c, codeInvalidRequest, "x", "")
		_ = refusalFrame(c, "x", "")

		// Sent in the connection's own session, the frame says the same
		// to the browser, with that session and no other.
		if c.SessionID != "" {
			return
		}
		sent, err := inSession(c, data, "S1")
		if err != nil {
			t.Fatalf("%q: in a session: %v", data, err)
		}
		again, err := parseCommand(sent)
		if err != nil {
			t.Fatalf("%q sent as %q, which the guard cannot read: %v", data, sent, err)
		}
		if again.ID != c.ID || again.Method != c.Method || again.SessionID != "S1" || string(again.Params) != string(c.Params) {
			t.Fatalf("%q sent as %q reads %+v, want %+v in session S1", data, sent, again, c)
		}
	})
}

func TestFramesMoveBetweenSessions(t *testing.T) {
	for _, tc := range []struct{ frame, want string }{
		{`{"id":1,"result":{},"sessionId":"B"}`, `{"id":1,"result":{}}`},
		{`{"sessionId":"B","id":1,"result":{}}`, `{"id":1,"result":{}}`},
		{`{ "sessionId" : "B" , "method":"Page.loadEventFired","params":{}}`, `{ "method":"Page.loadEventFired","params":{}}`},
		{`{"method":"X","sessionId":"B","params":{"sessionId":"C"}}`, `{"method":"X","params":{"sessionId":"C"}}`},
	} {
		m, err := members([]byte(tc.frame), memberSessionID)
		if err != nil {
			t.Fatalf("%s: %v", tc.frame, err)
		}
		if got := string(dropMember([]byte(tc.frame), m[memberSessionID])); got != tc.want {
			t.Errorf("drop sessionId from %s: %s, want %s", tc.frame, got, tc.want)
		}
	}
	for _, tc := range []struct{ frame, want string }{
		{`{"id":3,"method":"Page.navigate"}`, `{"sessionId":"S","id":3,"method":"Page.navigate"}`},
		{` {"sessionId":"","id":3,"method":"Page.navigate"}`, ` {"sessionId":"S","id":3,"method":"Page.navigate"}`},
		{`{"id":3,"sessionId":"","method":"Page.navigate"}`, `{"sessionId":"S","id":3,"method":"Page.navigate"}`},
	} {
		c, err := parseCommand([]byte(tc.frame))
		if err != nil {
			t.Fatalf("%s: %v", tc.frame, err)
		}
		got, err := inSession(c, []byte(tc.frame), "S")
		if err != nil || string(got) != tc.want {
			t.Errorf("%s in session S: %s %v, want %s", tc.frame, got, err, tc.want)
		}
	}
}

func TestScriptRefusalsAreExceptions(t *testing.T) {
	var got struct {
		ID     int64  `json:"id"`
		Sess   string `json:"sessionId"`
		Result struct {
			ExceptionDetails struct {
				Exception struct {
					Subtype     string `json:"subtype"`
					Description string `json:"description"`
				} `json:"exception"`
			} `json:"exceptionDetails"`
		} `json:"result"`
	}
	frame := refusalFrame(command{ID: 7, HasID: true, Method: "Runtime.callFunctionOn", SessionID: "P"}, "stopgate: no", "")
	if err := json.Unmarshal(frame, &got); err != nil || got.ID != 7 || got.Sess != "P" ||
		got.Result.ExceptionDetails.Exception.Subtype != "error" || got.Result.ExceptionDetails.Exception.Description != "Error: stopgate: no" {
		t.Errorf("script refusal: %s", frame)
	}
	if frame := string(refusalFrame(command{ID: 8, HasID: true, Method: "Page.navigate"}, "stopgate: no", "d")); frame != `{"id":8,"error":{"code":-32000,"message":"stopgate: no","data":"d"}}` {
		t.Errorf("navigation refusal: %s", frame)
	}
}
