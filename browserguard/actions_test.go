package browserguard

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// classOf is what the guard does with a command: "never" (refused
// whatever the run's state), "read" (forwarded, also after a cancel) or
// "action" (guarded; refused once the run is not ACTIVE).
func classOf(c command, uploads string) string {
	switch {
	case forbidden(c, uploads) != "":
		return "never"
	case isAction(c.Method):
		return "action"
	}
	return "read"
}

// TestCommandsAreActionsUnlessKnownToBeReads (issue 23, finding 4): the
// read list is an allowlist. A command the guard does not know (a new one,
// the old name of a guarded one, a misspelling the browser would refuse
// anyway) is an action; so are the ways to run script or hold requests
// that are not called evaluate: breakpoints and their conditions, scripts
// for the next document, paused requests, new contexts and targets, input,
// downloads.
func TestCommandsAreActionsUnlessKnownToBeReads(t *testing.T) {
	for _, method := range []string{
		// Finding 4: script by another name.
		"Debugger.enable", "Debugger.setBreakpoint", "Debugger.setBreakpointByUrl", "Debugger.setBreakpointOnFunctionCall",
		"Debugger.setScriptSource", "Debugger.evaluateOnCallFrame", "Debugger.setVariableValue", "Debugger.setReturnValue",
		"Debugger.restartFrame", "Debugger.resume", "Debugger.stepOver", "Debugger.pause", "Debugger.setInstrumentationBreakpoint",
		"DOMDebugger.setEventListenerBreakpoint", "EventBreakpoints.setInstrumentationBreakpoint",
		"Page.addScriptToEvaluateOnLoad", "Page.addScriptToEvaluateOnNewDocument", "Page.setBypassCSP",
		"Runtime.evaluate", "Runtime.callFunctionOn", "Runtime.compileScript", "Runtime.runScript", "Runtime.setCustomObjectFormatterEnabled",
		"Emulation.setVirtualTimePolicy", "Emulation.setScriptExecutionDisabled", "Page.setWebLifecycleState",
		// Requests held, released or made.
		"Fetch.enable", "Fetch.continueRequest", "Fetch.fulfillRequest", "Fetch.failRequest", "Fetch.continueWithAuth",
		"Fetch.continueResponse", "Network.setRequestInterception", "Network.continueInterceptedRequest", "Network.replayXHR",
		"Network.loadNetworkResource", "Network.setCookie", "Network.setCookies", "Network.clearBrowserCookies",
		// Pages and contexts made, brought forward.
		"Target.createTarget", "Target.createBrowserContext", "Target.activateTarget", "Page.bringToFront",
		"Page.navigate", "Page.reload", "Page.navigateToHistoryEntry", "Page.setDocumentContent",
		// Browser-wide.
		"Browser.setDownloadBehavior", "Page.setDownloadBehavior", "Browser.grantPermissions", "Browser.setPermission",
		"Browser.resetPermissions", "Browser.crash", "Browser.crashGpuProcess", "Browser.setWindowBounds", "Browser.setDockTile",
		// Input, and the DOM changed.
		"Input.dispatchMouseEvent", "Input.dispatchKeyEvent", "Input.insertText", "Input.dispatchDragEvent", "Input.setInterceptDrags",
		"DOM.setOuterHTML", "DOM.setAttributeValue", "DOM.removeNode", "DOM.focus", "DOM.scrollIntoViewIfNeeded", "DOM.setFileInputFiles",
		"Page.handleJavaScriptDialog", "Page.setInterceptFileChooserDialog", "Autofill.trigger", "Storage.clearDataForOrigin",
		"ServiceWorker.startWorker", "ServiceWorker.deliverPushMessage", "Tracing.start", "Memory.simulatePressureNotification",
		// Not a command the guard knows.
		"Inputs.fake", "page.navigate", "Page.Navigate", "Runtime.evaluateAsync", "NewDomain.doSomething", "",
	} {
		if got := classOf(command{Method: method, Params: json.RawMessage(`{"url":"https://shop.example/"}`)}, ""); got != "action" {
			t.Errorf("%q is %s, want action", method, got)
		}
	}
}

// TestClientsReadsWorkAfterTheCancel: what Puppeteer, Playwright and
// chromedp send as they attach and look (recorded from their tests), and
// the reads an agent makes after a cancel, are reads.
func TestClientsReadsWorkAfterTheCancel(t *testing.T) {
	for _, method := range []string{
		"Accessibility.getFullAXTree", "Audits.enable", "Browser.getVersion", "CSS.enable", "DOM.describeNode", "DOM.enable",
		"DOM.getContentQuads", "DOM.getDocument", "DOM.querySelector", "DOM.resolveNode", "DOM.getOuterHTML", "DOM.getBoxModel",
		"Emulation.setEmulatedMedia", "Emulation.setFocusEmulationEnabled", "Emulation.setDeviceMetricsOverride",
		"Inspector.enable", "Log.enable", "Network.enable", "Page.captureScreenshot", "Page.createIsolatedWorld", "Page.enable",
		"Page.getFrameTree", "Page.getNavigationHistory", "Page.setFontFamilies", "Page.setLifecycleEventsEnabled",
		"Performance.enable", "Runtime.addBinding", "Runtime.enable", "Runtime.releaseObject", "Runtime.runIfWaitingForDebugger",
		"Target.attachToBrowserTarget", "Target.attachToTarget", "Target.closeTarget", "Target.detachFromTarget",
		"Target.getBrowserContexts", "Target.getTargetInfo", "Target.getTargets", "Target.setAutoAttach", "Target.setDiscoverTargets",
		"WebMCP.enable", "Fetch.disable", "Page.printToPDF", "IO.read", "IO.close", "Page.captureSnapshot", "Page.getResourceTree",
	} {
		if got := classOf(command{Method: method}, ""); got != "read" {
			t.Errorf("%s is %s, want read", method, got)
		}
	}
}

// TestCommandsNeverForwarded (issue 23, finding 1): commands that reach for
// the machine rather than the web are refused whatever the run's state.
func TestCommandsNeverForwarded(t *testing.T) {
	uploads := t.TempDir()
	inside := filepath.Join(uploads, "invoice.pdf")
	if err := os.WriteFile(inside, []byte("%PDF"), 0o600); err != nil {
		t.Fatal(err)
	}
	secret := filepath.Join(t.TempDir(), "operator.token")
	if err := os.WriteFile(secret, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	// A link in the upload directory to a file outside it.
	if err := os.Symlink(secret, filepath.Join(uploads, "innocent.txt")); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		method, params string
		uploads        string
		want           string // "never" or the class it otherwise has
		say            string
	}{
		{"Page.navigate", `{"url":"file:///srv/stopgate-data/operator.token"}`, "", "never", "a file: URL is not the web's"},
		{"Page.navigate", `{"url":"FILE:///etc/passwd"}`, "", "never", "a file: URL"},
		{"Page.navigate", `{"url":"file:/etc/passwd"}`, "", "never", "a file: URL"},
		{"Page.navigate", `{"url":"file://localhost/etc/passwd"}`, "", "never", "a file: URL"},
		{"Page.navigate", `{"url":" file:///etc/passwd"}`, "", "never", "control characters"},
		{"Page.navigate", `{"url":"fi\tle:///etc/passwd"}`, "", "never", "control characters"},
		{"Page.navigate", `{"url":"http://shop.example/\n"}`, "", "never", "control characters"},
		{"Page.navigate", `{"url":"http://shop.example/ "}`, "", "never", "spaces around it"},
		{"Page.navigate", `{"url":"http://shop.example/a b"}`, "", "action", ""},
		{"Page.navigate", `{"url":"data:text/html,<input type=file>"}`, "", "action", ""},
		{"Page.navigate", `{"url":"view-source:file:///etc/passwd"}`, "", "never", "a view-source: URL"},
		{"Page.navigate", `{"url":"view-source:https://shop.example/"}`, "", "never", "a view-source: URL"},
		{"Page.navigate", `{"url":"filesystem:file:///temporary/x"}`, "", "never", "a filesystem: URL"},
		{"Page.navigate", `{"url":"chrome://version"}`, "", "never", "a chrome: URL"},
		{"Page.navigate", `{"url":"chrome-untrusted://terminal/"}`, "", "never", "a chrome-untrusted: URL"},
		{"Page.navigate", `{"url":"devtools://devtools/bundled/inspector.html"}`, "", "never", "a devtools: URL"},
		{"Page.navigate", `{"url":"about:settings"}`, "", "never", "only about:blank"},
		{"Page.navigate", `{"url":"javascript:fetch('/x')"}`, "", "never", "a javascript: URL"},
		{"Page.navigate", `{"url":"blob:https://shop.example/1234"}`, "", "never", "a blob: URL"},
		{"Page.navigate", `{"url":"/relative"}`, "", "never", "not an absolute URL"},
		{"Page.navigate", `{"url":"http://shop.example/","url":"file:///etc/passwd"}`, "", "never", `"url" appears twice`},
		{"Page.navigate", `{"url":7}`, "", "never", "its url is not a string"},
		{"Page.navigate", `{"url":"https://shop.example/pay"}`, "", "action", ""},
		{"Page.navigate", `{"url":"data:text/html,<p>hi"}`, "", "action", ""},
		{"Page.navigate", `{"url":"about:blank"}`, "", "action", ""},
		// A name the browser does not read is not the URL: it loads nothing.
		{"Page.navigate", `{"URL":"file:///etc/passwd","url":"https://shop.example/"}`, "", "action", ""},
		{"Target.createTarget", `{"url":"file:///etc/passwd"}`, "", "never", "a file: URL"},
		{"Target.createTarget", `{"url":"view-source:file:///etc/passwd"}`, "", "never", "a view-source: URL"},
		{"Target.createTarget", `{"url":""}`, "", "action", ""},
		{"Target.createTarget", `{"url":"about:blank"}`, "", "action", ""},
		{"Network.loadNetworkResource", `{"url":"file:///etc/passwd","frameId":"F"}`, "", "never", "only http and https"},
		{"Network.loadNetworkResource", `{"url":"data:text/plain,x","frameId":"F"}`, "", "never", "only http and https"},
		{"Network.loadNetworkResource", `{"url":"https://shop.example/map.js","frameId":"F"}`, "", "action", ""},
		{"Fetch.continueRequest", `{"requestId":"1","url":"file:///etc/passwd"}`, "", "never", "only http and https"},
		{"Fetch.continueRequest", `{"requestId":"1"}`, "", "action", ""},
		{"Network.continueInterceptedRequest", `{"interceptionId":"1","url":"file:///etc/passwd"}`, "", "never", "only http and https"},
		{"Page.getResourceContent", `{"frameId":"F","url":"file:///etc/passwd"}`, "", "never", "only http and https"},
		{"Page.getResourceContent", `{"frameId":"F","url":"https://shop.example/app.js"}`, "", "read", ""},
		{"DOM.setFileInputFiles", `{"nodeId":1,"files":["` + secret + `"]}`, "", "never", "no upload directory"},
		{"DOM.setFileInputFiles", `{"nodeId":1,"files":["` + secret + `"]}`, uploads, "never", "not in the run's upload directory"},
		{"DOM.setFileInputFiles", `{"nodeId":1,"files":["` + filepath.Join(uploads, "innocent.txt") + `"]}`, uploads, "never", "not in the run's upload directory"},
		{"DOM.setFileInputFiles", `{"nodeId":1,"files":["` + filepath.Join(uploads, "..", filepath.Base(filepath.Dir(secret))) + `"]}`, uploads, "never", "not"},
		{"DOM.setFileInputFiles", `{"nodeId":1,"files":["` + inside + `"]}`, uploads, "action", ""},
		{"DOM.setFileInputFiles", `{"nodeId":1,"files":[]}`, "", "action", ""},
		{"Input.dispatchDragEvent", `{"type":"drop","x":1,"y":1,"data":{"items":[],"files":["` + secret + `"],"dragOperationsMask":1}}`, "", "never", "no upload directory"},
		{"Input.dispatchDragEvent", `{"type":"drop","x":1,"y":1,"data":{"items":[],"dragOperationsMask":1}}`, "", "action", ""},
		{"Page.handleFileChooser", `{"action":"accept","files":["/etc/passwd"]}`, "", "never", "gives the page files from the host"},
		{"Target.sendMessageToTarget", `{"message":"{\"id\":1,\"method\":\"Page.navigate\",\"params\":{\"url\":\"file:///etc/passwd\"}}"}`, "", "never", "inside a string"},
		{"Target.exposeDevToolsProtocol", `{"targetId":"T"}`, "", "never", "page script"},
		{"Target.setRemoteLocations", `{"locations":[{"host":"evil.example","port":9222}]}`, "", "never", "other hosts"},
		{"Target.createBrowserContext", `{"proxyServer":"direct://"}`, "", "never", "a proxy of its own"},
		{"Target.createBrowserContext", `{"originsWithUniversalAccess":["file://"]}`, "", "never", "universal access"},
		{"Target.createBrowserContext", `{"disposeOnDetach":true}`, "", "action", ""},
		{"Browser.executeBrowserCommand", `{"commandId":"openTabSearch"}`, "", "never", "UI commands"},
		{"Extensions.loadUnpacked", `{"path":"/home/me/ext"}`, "", "never", "extensions"},
		{"PWA.launchFilesInApp", `{"manifestId":"m","files":["/etc/passwd"]}`, "", "never", "installed applications"},
		{"Cast.startTabMirroring", `{"sinkName":"tv"}`, "", "never", "casting"},
		{"Tethering.bind", `{"port":9222}`, "", "never", "opens a port"},
	} {
		c := command{Method: tc.method, Params: json.RawMessage(tc.params)}
		got := classOf(c, tc.uploads)
		why := forbidden(c, tc.uploads)
		if got != tc.want || tc.say != "" && !strings.Contains(why, tc.say) {
			t.Errorf("%s %s (uploads %q): %s %q, want %s saying %q", tc.method, tc.params, tc.uploads, got, why, tc.want, tc.say)
		}
	}
}

// TestDownloadsAreForwardedAsDeny: a client's setDownloadBehavior is
// forwarded with behavior deny and no path, its context kept.
func TestDownloadsAreForwardedAsDeny(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{`{"behavior":"allowAndName","browserContextId":"C","downloadPath":"/tmp/x","eventsEnabled":true}`, `{"behavior":"deny","browserContextId":"C","eventsEnabled":true}`},
		{`{"behavior":"allow","downloadPath":"/tmp/x"}`, `{"behavior":"deny"}`},
		{`{"behavior":"default"}`, `{"behavior":"deny"}`},
		{`{"behavior":"deny","behavior":"allow"}`, `{"behavior":"deny"}`},
		{`{"behavior":"deny"}`, ``},
	} {
		got, err := withDownloadsDenied(json.RawMessage(tc.in))
		if err != nil || string(got) != tc.want {
			t.Errorf("%s: %s %v, want %s", tc.in, got, err, tc.want)
		}
	}
	c, err := parseCommand([]byte(`{"id":3,"method":"Browser.setDownloadBehavior","params":{"behavior":"allow","downloadPath":"/home/me"},"sessionId":"S"}`))
	if err != nil {
		t.Fatal(err)
	}
	nc, frame, err := downloadsDenied(c, []byte(`{"id":3,"method":"Browser.setDownloadBehavior","params":{"behavior":"allow","downloadPath":"/home/me"},"sessionId":"S"}`))
	if err != nil || nc.ID != 3 || nc.SessionID != "S" || string(nc.Params) != `{"behavior":"deny"}` || strings.Contains(string(frame), "/home/me") {
		t.Errorf("the forwarded frame: %s %+v %v", frame, nc, err)
	}
}
