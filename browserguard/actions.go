package browserguard

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"net/url"
	"strings"

	"github.com/stopgate/stopgate/intents"
)

// isAction reports whether a CDP method creates work: it makes the page
// load, run code, receive input, send or release a request, or reach the
// host's files. Each action goes through the guard and is recorded as an
// intent; every other method (reads such as DOM.getDocument,
// Page.captureScreenshot, Runtime.enable, Target.setAutoAttach) passes
// unguarded, and keeps working after a cancel so that an agent can still
// look at what it did.
//
// The list errs on the side of guarding: refusing a harmless command after
// a cancel costs nothing, missing an effect is the failure stopgate exists
// to prevent. Whatever the page then does on the network also goes through
// the egress proxy under the same run, which is the backstop for anything
// this list does not name.
func isAction(method string) bool {
	switch method {
	case
		// Load a document: network requests, and the page's scripts run.
		"Page.navigate", "Page.reload", "Page.navigateToHistoryEntry",
		// Replace the document, whose scripts and forms then run.
		"Page.setDocumentContent",
		// Code that runs in every document loaded from now on.
		"Page.addScriptToEvaluateOnNewDocument",
		// Answering confirm()/prompt() lets a paused script go on (and submit).
		"Page.handleJavaScriptDialog",
		// Let pages write files to the host's disk.
		"Page.setDownloadBehavior", "Browser.setDownloadBehavior",
		// Run browser commands (open UI features) outside any page.
		"Browser.executeBrowserCommand",
		// Run arbitrary script in the page: it can fetch, submit, navigate.
		"Runtime.evaluate", "Runtime.callFunctionOn", "Runtime.compileScript", "Runtime.runScript",
		"Debugger.evaluateOnCallFrame", "Debugger.setScriptSource",
		// Put the host's files into a form the page can submit.
		"DOM.setFileInputFiles",
		// Change the document: what a form submits, inline handlers that run
		// (setOuterHTML with <img onerror>), where a click lands.
		"DOM.setAttributeValue", "DOM.setAttributesAsText", "DOM.setOuterHTML", "DOM.setNodeValue",
		"DOM.setNodeName", "DOM.removeNode", "DOM.removeAttribute", "DOM.moveTo", "DOM.copyTo",
		"DOM.undo", "DOM.redo",
		// Fill a form with stored data.
		"Autofill.trigger",
		// Open a new page, usually at a URL: a navigation.
		"Target.createTarget",
		// Carries any command inside a string the guard does not unwrap, so
		// the wrapper itself is the action.
		"Target.sendMessageToTarget",
		// Hands the protocol to the page's own scripts.
		"Target.exposeDevToolsProtocol",
		// Release or answer a request the client paused: it goes out (or the
		// page acts on a made-up answer).
		"Fetch.continueRequest", "Fetch.fulfillRequest", "Fetch.continueWithAuth", "Fetch.continueResponse",
		// Send a request again, or fetch a resource through the browser.
		"Network.replayXHR", "Network.loadNetworkResource",
		// Wake a service worker's code, which can fetch and notify.
		"ServiceWorker.deliverPushMessage", "ServiceWorker.dispatchSyncEvent",
		"ServiceWorker.dispatchPeriodicSyncEvent", "ServiceWorker.startWorker",
		// Install or start applications and extensions: code that runs on its own.
		"PWA.install", "PWA.launch", "PWA.launchFilesInApp", "PWA.openCurrentPageInApp",
		"Extensions.loadUnpacked":
		return true
	}
	// Every Input command is a user gesture (click, key, touch, drag,
	// scroll, IME) or changes how gestures reach the page.
	return strings.HasPrefix(method, "Input.")
}

// navigationURL names the URL an action loads, for the methods that take
// one; "" for the others.
func navigationURL(method string, params json.RawMessage) string {
	switch method {
	case "Page.navigate", "Target.createTarget", "Network.loadNetworkResource":
	default:
		return ""
	}
	var p struct {
		URL string `json:"url"`
	}
	if len(params) == 0 || json.Unmarshal(params, &p) != nil {
		return ""
	}
	return p.URL
}

// effectOf names the effect of an action for the guard: the target that
// is recorded (the URL of a navigation, without query, fragment or
// credentials, which often carry secrets; "cdp:<method>" otherwise), the
// key's target (the full URL: the query still tells effects apart), and
// the digest of the params.
func effectOf(c command) (recorded, keyTarget, digest string) {
	keyTarget = "cdp:" + c.Method
	recorded = keyTarget
	if raw := navigationURL(c.Method, c.Params); raw != "" {
		keyTarget = raw
		// A URL that does not parse keeps "cdp:<method>": its query could
		// not be told apart from the rest.
		if u, err := url.Parse(raw); err == nil {
			recorded = intents.RecordedTarget(u, "")
		}
	}
	if len(c.Params) > 0 {
		sum := sha256.Sum256(c.Params)
		digest = "sha256:" + hex.EncodeToString(sum[:])
	}
	return recorded, keyTarget, digest
}
