package browserguard

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/url"
	"path/filepath"
	"strings"

	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/state"
)

// The guard sorts every CDP command into one of three:
//
//   - never forwarded (forbidden): whatever the run's state, the command
//     reaches for the machine rather than the web, so it gets the refusal
//     command_not_allowed and is recorded as refused;
//   - a read (reads): forwarded unguarded, and still after a cancel, so that
//     an agent can look at what it did;
//   - an action: everything else. It passes the guard and is recorded; once
//     the run is not ACTIVE it is refused.
//
// The read list is an allowlist: a command the guard does not know, a new
// one of the next Chromium or the old name of a guarded one, is an action.
// Refusing a harmless command after a cancel costs an agent a look;
// forwarding an unknown one could cost an effect.

// reads are the commands that only look at the browser, or say what the
// client is sent, and that CDP clients send to look at a page (Puppeteer,
// Playwright and chromedp send many of them as they attach).
var reads = setOf(
	// Which browser, which targets, and attaching to them: a session sees
	// a page, every command in it is checked again.
	"Browser.getVersion", "Browser.getBrowserCommandLine", "Browser.getHistograms", "Browser.getHistogram",
	"Browser.getWindowBounds", "Browser.getWindowForTarget",
	"Target.getTargets", "Target.getTargetInfo", "Target.getBrowserContexts", "Target.setDiscoverTargets",
	"Target.setAutoAttach", "Target.autoAttachRelated", "Target.attachToTarget", "Target.attachToBrowserTarget",
	"Target.detachFromTarget",
	// Ending things: work stops, nothing starts.
	"Target.closeTarget", "Target.disposeBrowserContext", "Page.close", "Browser.close", "Page.stopLoading",
	// A target paused at its start by the client's own auto-attach goes
	// on with what it was doing; whatever it sends is the egress proxy's.
	"Runtime.runIfWaitingForDebugger",
	// Domains' events on and off. Not Fetch.enable (it holds the page's
	// requests for the client to release or answer: an action) nor
	// Debugger.enable (the way to breakpoints and their conditions).
	"Accessibility.enable", "Accessibility.disable", "Animation.enable", "Animation.disable", "Audits.enable", "Audits.disable",
	"CSS.enable", "CSS.disable", "DOM.enable", "DOM.disable", "DOMSnapshot.enable", "DOMSnapshot.disable",
	"DOMStorage.enable", "DOMStorage.disable", "Inspector.enable", "Inspector.disable", "LayerTree.enable", "LayerTree.disable",
	"Log.enable", "Log.disable", "Log.clear", "Media.enable", "Media.disable", "Network.enable", "Network.disable",
	"Overlay.enable", "Overlay.disable", "Page.enable", "Page.disable", "Performance.enable", "Performance.disable",
	"Runtime.enable", "Runtime.disable", "Security.enable", "Security.disable", "ServiceWorker.enable", "ServiceWorker.disable",
	"WebMCP.enable", "WebMCP.disable", "Fetch.disable", "Debugger.disable", "Profiler.disable", "HeapProfiler.disable",
	"Page.setLifecycleEventsEnabled", "Runtime.setAsyncCallStackDepth", "Network.setAttachDebugStack",
	"Page.startScreencast", "Page.stopScreencast", "Page.screencastFrameAck",
	// The page, as it is.
	"Page.getFrameTree", "Page.getResourceTree", "Page.getResourceContent", "Page.searchInResource", "Page.getLayoutMetrics",
	"Page.getNavigationHistory", "Page.getAppManifest", "Page.getInstallabilityErrors", "Page.getAppId",
	"Page.getOriginTrials", "Page.getPermissionsPolicyState", "Page.captureScreenshot", "Page.captureSnapshot", "Page.printToPDF",
	"Page.createIsolatedWorld",
	"DOM.getDocument", "DOM.getFlattenedDocument", "DOM.requestChildNodes", "DOM.describeNode", "DOM.resolveNode",
	"DOM.requestNode", "DOM.pushNodeByPathToFrontend", "DOM.pushNodesByBackendIdsToFrontend", "DOM.querySelector",
	"DOM.querySelectorAll", "DOM.getOuterHTML", "DOM.getAttributes", "DOM.getBoxModel", "DOM.getContentQuads",
	"DOM.getNodeForLocation", "DOM.getFrameOwner", "DOM.getFileInfo", "DOM.getNodesForSubtreeByStyle", "DOM.getTopLayerElements",
	"DOM.getContainerForNode", "DOM.getQueryingDescendantsForContainer", "DOM.performSearch", "DOM.getSearchResults",
	"DOM.discardSearchResults", "DOM.markUndoableState", "DOM.setInspectedNode",
	"DOMSnapshot.captureSnapshot", "DOMSnapshot.getSnapshot",
	"CSS.getComputedStyleForNode", "CSS.getMatchedStylesForNode", "CSS.getInlineStylesForNode", "CSS.getPlatformFontsForNode",
	"CSS.getStyleSheetText", "CSS.getBackgroundColors", "CSS.getMediaQueries", "CSS.getLayersForNode",
	"Accessibility.getFullAXTree", "Accessibility.getPartialAXTree", "Accessibility.queryAXTree", "Accessibility.getChildAXNodes",
	"Accessibility.getRootAXNode", "Accessibility.getAXNodeAndAncestors",
	"LayerTree.compositingReasons", "LayerTree.snapshotCommandLog",
	"DOMStorage.getDOMStorageItems", "Storage.getCookies", "Storage.getUsageAndQuota", "Storage.getStorageKeyForFrame",
	"Network.getResponseBody", "Network.getRequestPostData", "Network.getCookies", "Network.getAllCookies",
	"Network.getCertificate", "Network.getSecurityIsolationStatus",
	"Performance.getMetrics", "SystemInfo.getInfo", "SystemInfo.getProcessInfo", "SystemInfo.getFeatureState", "Schema.getDomains",
	"Log.startViolationsReport", "Log.stopViolationsReport",
	// Values the page already holds, without running anything of its.
	"Runtime.getProperties", "Runtime.getHeapUsage", "Runtime.getIsolateId", "Runtime.globalLexicalScopeNames",
	"Runtime.queryObjects", "Runtime.releaseObject", "Runtime.releaseObjectGroup", "Runtime.discardConsoleEntries",
	"Runtime.awaitPromise", "Runtime.getExceptionDetails", "Runtime.addBinding", "Runtime.removeBinding",
	"Debugger.getScriptSource", "Debugger.getPossibleBreakpoints", "Debugger.searchInContent",
	"IO.read", "IO.close", "IO.resolveBlob",
	// How the page is shown to the client: its view, not what it sends.
	"Emulation.setDeviceMetricsOverride", "Emulation.clearDeviceMetricsOverride", "Emulation.setDefaultBackgroundColorOverride",
	"Emulation.setFocusEmulationEnabled", "Emulation.setEmulatedMedia", "Emulation.setEmulatedVisionDeficiency",
	"Emulation.setScrollbarsHidden", "Emulation.setTouchEmulationEnabled", "Emulation.setEmitTouchEventsForMouse",
	"Emulation.setPageScaleFactor", "Emulation.setVisibleSize", "Emulation.setAutoDarkModeOverride", "Emulation.setDocumentCookieDisabled",
	"Emulation.canEmulate", "Page.setFontFamilies", "Page.setFontSizes", "Page.resetNavigationHistory",
	"Overlay.highlightNode", "Overlay.highlightQuad", "Overlay.highlightRect", "Overlay.hideHighlight", "Overlay.setShowViewportSizeOnResize",
	"Overlay.setShowGridOverlays", "Overlay.setShowFlexOverlays", "Overlay.setPausedInDebuggerMessage",
	// What later requests carry and whether they may use the cache: the
	// requests themselves still pass the egress proxy.
	"Network.setCacheDisabled", "Network.setBypassServiceWorker", "Network.setExtraHTTPHeaders", "Network.setUserAgentOverride",
	"Emulation.setUserAgentOverride", "Emulation.setLocaleOverride", "Emulation.setTimezoneOverride", "Network.setBlockedURLs",
	"Network.emulateNetworkConditions", "Network.overrideNetworkState", "Page.setAdBlockingEnabled",
)

// isAction reports whether a command must pass the guard: whatever is not
// a known read.
func isAction(method string) bool { return !reads[method] }

// forbiddenMethods are never forwarded: they reach past the page (the
// browser's UI, extensions and installed apps, files on the host, the
// protocol handed to page script, DevTools listening elsewhere), or hide
// a command inside a string the guard does not read.
var forbiddenMethods = map[string]string{
	"Target.sendMessageToTarget":    "it carries a command inside a string the guard does not read; use flat sessions (Target.attachToTarget with flatten: true)",
	"Target.exposeDevToolsProtocol": "it hands the DevTools protocol to page script, around the guard",
	"Target.setRemoteLocations":     "it points the browser's DevTools at other hosts",
	"Browser.executeBrowserCommand": "it runs the browser's own UI commands",
	"Page.handleFileChooser":        "it gives the page files from the host",
	"Tethering.bind":                "it opens a port on the browser's side",
	"Tethering.unbind":              "it opens a port on the browser's side",
}

// forbiddenDomains are domains none of whose commands is forwarded.
var forbiddenDomains = map[string]string{
	"Extensions": "extensions are code of their own, loaded from the host's files",
	"PWA":        "installed applications run on their own and open the host's files",
	"Cast":       "casting sends the page to devices on the network, around the egress proxy",
}

// forbidden says why a command is never forwarded, "" when it may be (as
// a read or an action). uploads is the directory the run may upload files
// from ("" for none).
func forbidden(c command, uploads string) string {
	if why, ok := forbiddenMethods[c.Method]; ok {
		return c.Method + " is never forwarded: " + why
	}
	if domain, _, ok := strings.Cut(c.Method, "."); ok {
		if why, ok := forbiddenDomains[domain]; ok {
			return domain + ".* is never forwarded: " + why
		}
	}
	fields, ok := checkedParams[c.Method]
	if !ok {
		return ""
	}
	// Read as the browser reads them: exact names, none twice.
	params := c.Params
	if len(params) == 0 {
		params = json.RawMessage("{}")
	}
	m, err := members(params, fields...)
	if err != nil {
		return "its params cannot be read as the browser would: " + err.Error()
	}
	switch c.Method {
	case "Page.navigate", "Target.createTarget":
		u, err := stringMember(m, "url")
		if err != nil {
			return err.Error()
		}
		return notLoadable(u, c.Method == "Target.createTarget")
	case "Network.loadNetworkResource":
		u, err := stringMember(m, "url")
		if err != nil {
			return err.Error()
		}
		return notWeb(u)
	case "Fetch.continueRequest", "Network.continueInterceptedRequest", "Page.getResourceContent":
		// A request sent on elsewhere, or a resource looked up: only ever
		// the web's.
		if _, given := m["url"]; !given {
			return ""
		}
		u, err := stringMember(m, "url")
		if err != nil {
			return err.Error()
		}
		return notWeb(u)
	case "DOM.setFileInputFiles":
		files, err := stringsMember(m, "files")
		if err != nil {
			return err.Error()
		}
		return notUploadable(files, uploads)
	case "Input.dispatchDragEvent":
		data, ok := m["data"]
		if !ok {
			return ""
		}
		dm, err := members(data.raw, "files")
		if err != nil {
			return "its drag data cannot be read as the browser would: " + err.Error()
		}
		files, err := stringsMember(dm, "files")
		if err != nil {
			return err.Error()
		}
		return notUploadable(files, uploads)
	case "Target.createBrowserContext":
		for _, k := range []string{"proxyServer", "proxyBypassList"} {
			if _, ok := m[k]; ok {
				return "a browser context with a proxy of its own would send around the egress proxy"
			}
		}
		if _, ok := m["originsWithUniversalAccess"]; ok {
			return "origins with universal access could read what no page may"
		}
	}
	return ""
}

// checkedParams are the commands whose params decide whether they are
// forwarded at all, and the params read.
var checkedParams = map[string][]string{
	"Page.navigate":                      {"url"},
	"Target.createTarget":                {"url"},
	"Network.loadNetworkResource":        {"url"},
	"Fetch.continueRequest":              {"url"},
	"Network.continueInterceptedRequest": {"url"},
	"Page.getResourceContent":            {"url"},
	"DOM.setFileInputFiles":              {"files"},
	"Input.dispatchDragEvent":            {"data"},
	"Target.createBrowserContext":        {"proxyServer", "proxyBypassList", "originsWithUniversalAccess"},
}

// stringMember is the string member name of m ("" when it is absent).
func stringMember(m map[string]member, name string) (string, error) {
	mm, ok := m[name]
	if !ok {
		return "", nil
	}
	var v string
	if err := json.Unmarshal(mm.raw, &v); err != nil {
		return "", fmt.Errorf("its %s is not a string", name)
	}
	return v, nil
}

// stringsMember is the string list member name of m (nil when absent).
func stringsMember(m map[string]member, name string) ([]string, error) {
	mm, ok := m[name]
	if !ok {
		return nil, nil
	}
	var v []string
	if err := json.Unmarshal(mm.raw, &v); err != nil {
		return nil, fmt.Errorf("its %s is not a list of strings", name)
	}
	return v, nil
}

// notLoadable says why a URL is not one the browser may load as a
// document, "" when it is: the web (http, https), data: documents (their
// origin is opaque: they can load no local file) and about:blank. Not
// file:, filesystem: (local files), view-source: (of anything: it shows a
// file: as well as a page), chrome:, chrome-untrusted:, devtools:,
// chrome-extension: (the browser's own pages and its settings), blob:
// (documents of another origin's making), javascript: (script in whatever
// page is there), nor anything else. An empty URL opens about:blank where
// a new target is made.
func notLoadable(raw string, emptyOK bool) string {
	if raw == "" && emptyOK {
		return ""
	}
	u, why := readURL(raw)
	if why != "" {
		return why
	}
	switch u.Scheme {
	case "http", "https", "data":
		return ""
	case "about":
		if u.Opaque == "blank" {
			return ""
		}
		return fmt.Sprintf("%s is not loaded: of about: only about:blank is (the others are the browser's own pages)", state.Clip(raw, 64))
	}
	return fmt.Sprintf("%s is not loaded: a %s: URL is not the web's; the browser loads http, https, data: documents and about:blank", state.Clip(raw, 64), u.Scheme)
}

// notWeb says why a URL is not http or https, "" when it is.
func notWeb(raw string) string {
	u, why := readURL(raw)
	if why != "" {
		return why
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return fmt.Sprintf("%s is not fetched: only http and https URLs are", state.Clip(raw, 64))
	}
	return ""
}

// readURL parses a URL as strictly as the guard must: Chromium's parser
// drops leading and trailing spaces and control characters, and tabs and
// newlines anywhere (" fi\tle:" is file:), so any of them is refused
// rather than read differently from the browser. A space inside is
// escaped by both alike.
func readURL(raw string) (*url.URL, string) {
	stripped := strings.TrimFunc(raw, func(r rune) bool { return r <= ' ' })
	controls := strings.ContainsFunc(raw, func(r rune) bool { return r < ' ' || r == 0x7f })
	if stripped != raw || controls {
		return nil, fmt.Sprintf("%q is not loaded: spaces around it and control characters in it make a URL the browser reads otherwise", state.Clip(raw, 64))
	}
	u, err := url.Parse(raw)
	if err != nil || u.Scheme == "" {
		return nil, fmt.Sprintf("%q is not loaded: not an absolute URL", state.Clip(raw, 64))
	}
	return u, ""
}

// notUploadable says why files may not be given to a page, "" when each
// is in the run's upload directory. Paths are taken as the browser will
// open them (after links), so that a link in the directory cannot point
// out of it.
func notUploadable(files []string, uploads string) string {
	if len(files) == 0 {
		return ""
	}
	if uploads == "" {
		return "files are not given to pages: this stopgate has no upload directory (serve --browser-upload-dir)"
	}
	root, err := filepath.EvalSymlinks(uploads)
	if err != nil {
		return fmt.Sprintf("files are not given to pages: the run's upload directory %s: %v", uploads, err)
	}
	for _, f := range files {
		real, err := filepath.EvalSymlinks(f)
		if err != nil || !filepath.IsAbs(f) {
			return fmt.Sprintf("file %q is not given to the page: not a file in the run's upload directory %s", state.Clip(f, 128), uploads)
		}
		if rel, err := filepath.Rel(root, real); err != nil || rel == "." || rel == ".." || strings.HasPrefix(rel, "../") {
			return fmt.Sprintf("file %q is not given to the page: it is not in the run's upload directory %s", state.Clip(f, 128), uploads)
		}
	}
	return ""
}

// downloadMethods set where downloads go. A client may turn them off; its
// allow (Playwright asks for allowAndName on every context it sets up, and
// fails to connect if that is refused) is forwarded as deny.
var downloadMethods = setOf("Browser.setDownloadBehavior", "Page.setDownloadBehavior")

// withDownloadsDenied is a setDownloadBehavior frame's params with
// behavior deny and no download path; "" when they already deny.
func withDownloadsDenied(params json.RawMessage) (json.RawMessage, error) {
	m := map[string]json.RawMessage{}
	if len(params) > 0 {
		if err := json.Unmarshal(params, &m); err != nil {
			return nil, err
		}
	}
	var behavior string
	_ = json.Unmarshal(m["behavior"], &behavior)
	if behavior == "deny" && len(m) == 1 {
		return nil, nil
	}
	out := map[string]json.RawMessage{"behavior": json.RawMessage(`"deny"`)}
	for _, k := range []string{"browserContextId", "eventsEnabled"} {
		if v, ok := m[k]; ok {
			out[k] = v
		}
	}
	return json.Marshal(out)
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

func setOf(items ...string) map[string]bool {
	m := make(map[string]bool, len(items))
	for _, s := range items {
		m[s] = true
	}
	return m
}
