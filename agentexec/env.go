package agentexec

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/stopgate/stopgate/control/client"
)

// Proxy and CA variables exec sets or clears for the command. Every common
// runtime reads one of these; both cases, because curl reads only
// lower-case http_proxy and Go and Python read either.
var (
	proxyVars = []string{"HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"}
	// noProxyVars are cleared: an inherited exception list is a way around the guard.
	noProxyVars = []string{"NO_PROXY", "no_proxy"}
	// caBundleVars replace the trusted roots, so they get the system roots plus the CA.
	caBundleVars = []string{"SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO", "AWS_CA_BUNDLE", "HTTPLIB2_CA_CERTS", "PIP_CERT", "NIX_SSL_CERT_FILE", "CARGO_HTTP_CAINFO", "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH", "DENO_CERT"}
	// caExtraVars add to the roots, so they get the CA alone.
	caExtraVars = []string{"NODE_EXTRA_CA_CERTS"}
)

// systemBundles are where distributions keep the system's roots (as Go looks for them).
var systemBundles = []string{
	"/etc/ssl/certs/ca-certificates.crt",
	"/etc/pki/tls/certs/ca-bundle.crt",
	"/etc/ssl/ca-bundle.pem",
	"/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
	"/etc/ssl/cert.pem",
}

// UnisolatedClients lists the clients that go around the proxy variables:
// what --no-isolate says on stderr and records in the run's audit.
const UnisolatedClients = "Node.js's built-in fetch and http before the Node version that reads NODE_USE_ENV_PROXY (Node 20 and 22 do not); Go programs, for loopback destinations; anything that opens its own sockets (raw TCP, gRPC without proxy support, many database drivers)"

// environment is the command's: the caller's without STOPGATE_* variables
// (the operator's token is not the agent's), with the CA trusted by every
// common runtime, the cancel file named, and, unisolated, the proxy with
// the run's identity. Isolated, the proxy variables are cleared: every
// connection is carried anyway, and one sent to the proxy would be carried
// to it and refused (stopgate's own listeners are never a destination).
func (e *execution) environment(ctx context.Context, dir string) (env []string, cancelFile string, err error) {
	o := e.opts
	set := map[string]string{}
	unset := slices.Concat(proxyVars, noProxyVars, []string{"NODE_USE_ENV_PROXY", "WGETRC"})
	if err := os.Chmod(dir, 0o755); err != nil {
		return nil, "", err
	}
	pem, err := o.Client.CA(ctx)
	var ae *client.APIError
	switch {
	case errors.As(err, &ae) && ae.StatusCode == http.StatusNotFound:
		e.warnf("this stopgate intercepts no HTTPS (no CA): HTTPS reaches only pass-through hosts")
	case err != nil:
		return nil, "", fmt.Errorf("reading the CA: %w", err)
	default:
		caFile, bundleFile, err := writeCA(dir, pem)
		if err != nil {
			return nil, "", err
		}
		for _, k := range caBundleVars {
			set[k] = bundleFile
		}
		for _, k := range caExtraVars {
			set[k] = caFile
		}
		// wget reads no variable for its roots, only a wgetrc.
		wgetrc := filepath.Join(dir, "wgetrc")
		if err := os.WriteFile(wgetrc, []byte("ca_certificate = "+bundleFile+"\n"), 0o644); err != nil {
			return nil, "", fmt.Errorf("writing the wgetrc for CMD: %w", err)
		}
		set["WGETRC"] = wgetrc
	}
	if o.Mode == Unisolated {
		u := &url.URL{Scheme: "http", User: url.UserPassword(o.Run, e.pass), Host: e.proxy}
		for _, k := range proxyVars {
			set[k] = u.String()
		}
		set["NODE_USE_ENV_PROXY"] = "1"
	}
	cancelFile = filepath.Join(dir, "cancel.json")
	set[CancelFileVar] = cancelFile
	env = make([]string, 0, len(set)+64)
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if _, ok := set[k]; ok || slices.Contains(unset, k) {
			continue
		}
		// The operator's token and stopgate's own settings are not the
		// agent's: with them it could drive the control API.
		if strings.HasPrefix(k, "STOPGATE_") {
			continue
		}
		env = append(env, kv)
	}
	for k, v := range set {
		env = append(env, k+"="+v)
	}
	slices.Sort(env)
	return env, cancelFile, nil
}

// writeCA writes the CA alone (for variables that add to the roots) and
// the system roots plus the CA (for variables that replace them, so that
// pass-through hosts still verify), readable by the command's user.
func writeCA(dir string, pem []byte) (caFile, bundleFile string, err error) {
	caFile, bundleFile = filepath.Join(dir, "stopgate-ca.pem"), filepath.Join(dir, "ca-bundle.pem")
	bundle := []byte{}
	for _, p := range systemBundles {
		if b, err := os.ReadFile(p); err == nil {
			bundle = append(b, '\n')
			break
		}
	}
	bundle = append(bundle, pem...)
	for path, data := range map[string][]byte{caFile: pem, bundleFile: bundle} {
		if err := os.WriteFile(path, data, 0o644); err != nil {
			return "", "", fmt.Errorf("writing the CA for CMD: %w", err)
		}
	}
	return caFile, bundleFile, nil
}
