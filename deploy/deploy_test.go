// Package deploy_test holds the tests of deploy/: the files an operator
// copies (images, Kubernetes manifests, docker compose, the example policy)
// must work as shipped. It is a Go module of its own so that the Kubernetes
// API types it decodes the manifests into are never among the product's
// requirements; it runs stopgate's own parsing of serve's and redirect's
// command lines (packages serve and cli) on them, and the built binary.
package deploy_test

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	k8sjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
	k8syaml "k8s.io/apimachinery/pkg/util/yaml"

	"github.com/stopgate/stopgate/cli"
	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/policy"
	"github.com/stopgate/stopgate/proxy"
	"github.com/stopgate/stopgate/serve"
	"github.com/stopgate/stopgate/state/redisstore"
)

// binary is the stopgate TestMain builds from the repository.
var binary string

func TestMain(m *testing.M) {
	os.Exit(testkit.MainWithStopgate(m, "..", &binary))
}

// startServe starts the built `stopgate serve` with args, on ports of its
// own choosing, in an environment without STOPGATE_* variables: a
// developer's own settings cannot change what the test sees.
func startServe(t *testing.T, args ...string) *testkit.Process {
	t.Helper()
	return testkit.StartServe(t, binary, args, testkit.CleanEnv(), "")
}

// TestShippedExamplePolicyStartsAsIs: deploy/stopgate.yaml loads with the
// policy package and serve starts on it, with nothing set in the
// environment (it used to need STOPGATE_WEBHOOK_PAYMENTS, so it did not).
func TestShippedExamplePolicyStartsAsIs(t *testing.T) {
	const example = "stopgate.yaml"
	t.Setenv("STOPGATE_WEBHOOK_PAYMENTS", "")
	pol, err := policy.Load(example)
	if err != nil {
		t.Fatalf("policy.Load(%s): %v", example, err)
	}
	s := startServe(t, "--data-dir", t.TempDir(), "--config", example)
	resp, err := http.Get("http://" + s.Bound.Control + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/readyz: %d\n%s", resp.StatusCode, s.Log())
	}
	if want := "pass_through=1 delivery=2 effects=10 lookups=1"; !strings.Contains(s.Log(), want) || len(pol.Delivery) != 2 {
		t.Fatalf("serve did not start on the example's rules (want %q in its log):\n%s", want, s.Log())
	}
}

// manifest is one Kubernetes object of deploy/kubernetes, decoded into its
// API type.
type manifest struct {
	file string
	obj  runtime.Object
}

// manifestDecoder decodes YAML into the Kubernetes API types the manifests
// use, strictly: an unknown or duplicated field is an error, so a misspelt
// field fails here instead of being dropped by the API server.
func manifestDecoder() runtime.Decoder {
	scheme := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{corev1.AddToScheme, appsv1.AddToScheme, batchv1.AddToScheme, networkingv1.AddToScheme} {
		if err := add(scheme); err != nil {
			panic(err)
		}
	}
	return k8sjson.NewSerializerWithOptions(k8sjson.DefaultMetaFactory, scheme, scheme, k8sjson.SerializerOptions{Yaml: true, Strict: true})
}

// decodeDocs decodes every YAML document of b.
func decodeDocs(dec runtime.Decoder, b []byte) ([]runtime.Object, error) {
	r := k8syaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(b)))
	var objs []runtime.Object
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return objs, nil
		}
		if err != nil {
			return nil, err
		}
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		obj, _, err := dec.Decode(doc, nil, nil)
		if err != nil {
			return nil, err
		}
		objs = append(objs, obj)
	}
}

func loadManifests(t *testing.T) []manifest {
	t.Helper()
	files, err := filepath.Glob("kubernetes/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests in deploy/kubernetes: %v", err)
	}
	dec := manifestDecoder()
	var out []manifest
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		objs, err := decodeDocs(dec, b)
		if err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		for _, o := range objs {
			out = append(out, manifest{file: filepath.Base(f), obj: o})
		}
	}
	return out
}

// TestDeployManifestsDecodeStrictly: every manifest is a valid object of
// its API type, and the decoder would catch a misspelt field.
func TestDeployManifestsDecodeStrictly(t *testing.T) {
	ms := loadManifests(t)
	kinds := map[string]int{}
	for _, m := range ms {
		kinds[fmt.Sprintf("%T", m.obj)]++
		if acc, err := meta.Accessor(m.obj); err != nil || acc.GetName() == "" {
			t.Errorf("%s: an object without a name (%v)", m.file, err)
		} else if _, ns := m.obj.(*corev1.Namespace); !ns && acc.GetNamespace() != "stopgate" {
			t.Errorf("%s: %s is in namespace %q, want stopgate", m.file, acc.GetName(), acc.GetNamespace())
		}
	}
	for _, want := range []string{"*v1.Namespace", "*v1.StatefulSet", "*v1.Deployment", "*v1.Job", "*v1.Service", "*v1.ConfigMap", "*v1.NetworkPolicy"} {
		if kinds[want] == 0 {
			t.Errorf("no %s among the manifests: %v", want, kinds)
		}
	}
	b, err := os.ReadFile("kubernetes/agent-job.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for _, typo := range []struct{ field, misspelt string }{
		{"readOnlyRootFilesystem:", "readOnlyRootFileSystem:"},
		{"restartPolicy: Always", "restartpolicy: Always"},
		{"automountServiceAccountToken:", "automountServiceAcountToken:"},
	} {
		if !bytes.Contains(b, []byte(typo.field)) {
			t.Fatalf("agent-job.yaml has no %q to misspell", typo.field)
		}
		if _, err := decodeDocs(manifestDecoder(), bytes.Replace(b, []byte(typo.field), []byte(typo.misspelt), 1)); err == nil || !strings.Contains(err.Error(), "unknown field") {
			t.Errorf("%s misspelt as %s: decoded without an unknown-field error (%v)", typo.field, typo.misspelt, err)
		}
	}
}

// fleet is deploy/kubernetes, by kind.
type fleet struct {
	job        *batchv1.Job
	control    *appsv1.Deployment
	redis      *appsv1.StatefulSet
	configMaps map[string]*corev1.ConfigMap
	services   map[string]*corev1.Service
	policies   []*networkingv1.NetworkPolicy
	// ca is a CA made for the test, standing for the Secret stopgate-ca.
	caCert, caKey []byte
}

func loadFleet(t *testing.T) *fleet {
	t.Helper()
	f := &fleet{configMaps: map[string]*corev1.ConfigMap{}, services: map[string]*corev1.Service{}}
	for _, m := range loadManifests(t) {
		switch o := m.obj.(type) {
		case *batchv1.Job:
			f.job = o
		case *appsv1.Deployment:
			f.control = o
		case *appsv1.StatefulSet:
			f.redis = o
		case *corev1.ConfigMap:
			f.configMaps[o.Name] = o
		case *corev1.Service:
			f.services[o.Name] = o
		case *networkingv1.NetworkPolicy:
			f.policies = append(f.policies, o)
		}
	}
	if f.job == nil || f.control == nil || f.redis == nil {
		t.Fatalf("want an agent Job, a control Deployment and a Redis StatefulSet in deploy/kubernetes")
	}
	certFile, keyFile := testkit.FleetCA(t)
	f.caCert, _ = os.ReadFile(certFile)
	f.caKey, _ = os.ReadFile(keyFile)
	return f
}

// pods are the pod templates of the fleet, by name.
func (f *fleet) pods() map[string]corev1.PodTemplateSpec {
	return map[string]corev1.PodTemplateSpec{"agent": f.job.Spec.Template, "control": f.control.Spec.Template, "redis": f.redis.Spec.Template}
}

// secretData is what the test puts in a Secret the operator creates
// (deploy/README.md).
func (f *fleet) secretData(name string) map[string][]byte {
	if name == "stopgate-ca" {
		return map[string][]byte{"tls.crt": f.caCert, "tls.key": f.caKey}
	}
	return map[string][]byte{"password": []byte("test-" + name + "-password"), "token": []byte("test-" + name + "-token")}
}

// configMapData is a ConfigMap of the manifests, or the one deploy/README.md
// makes from deploy/stopgate.yaml.
func (f *fleet) configMapData(t *testing.T, name string) map[string][]byte {
	t.Helper()
	if cm, ok := f.configMaps[name]; ok {
		out := map[string][]byte{}
		for k, v := range cm.Data {
			out[k] = []byte(v)
		}
		return out
	}
	if name == "stopgate-policy" {
		b, err := os.ReadFile("stopgate.yaml")
		if err != nil {
			t.Fatal(err)
		}
		return map[string][]byte{"stopgate.yaml": b}
	}
	t.Fatalf("ConfigMap %s is neither in the manifests nor made by deploy/README.md", name)
	return nil
}

// layOut makes c's volume mounts as the kubelet would, in temp dirs, and
// returns the function that maps a path in the container to this machine.
func (f *fleet) layOut(t *testing.T, spec corev1.PodSpec, c corev1.Container) func(string) string {
	t.Helper()
	volumes := map[string]corev1.Volume{}
	for _, v := range spec.Volumes {
		volumes[v.Name] = v
	}
	mounts := map[string]string{}
	for _, m := range c.VolumeMounts {
		v, ok := volumes[m.Name]
		if !ok {
			t.Fatalf("container %s mounts volume %s, which the pod does not have", c.Name, m.Name)
		}
		dir := t.TempDir()
		mounts[m.MountPath] = dir
		var data map[string][]byte
		var items []corev1.KeyToPath
		mode := int32(0o644)
		switch {
		case v.Secret != nil:
			data, items = f.secretData(v.Secret.SecretName), v.Secret.Items
			if v.Secret.DefaultMode != nil {
				mode = *v.Secret.DefaultMode
			}
		case v.ConfigMap != nil:
			data, items = f.configMapData(t, v.ConfigMap.Name), v.ConfigMap.Items
			if v.ConfigMap.DefaultMode != nil {
				mode = *v.ConfigMap.DefaultMode
			}
		case v.EmptyDir != nil:
			continue
		default:
			t.Fatalf("volume %s: a kind this test does not lay out", v.Name)
		}
		if items == nil {
			for k := range data {
				items = append(items, corev1.KeyToPath{Key: k, Path: k})
			}
		}
		for _, it := range items {
			m := mode
			if it.Mode != nil {
				m = *it.Mode
			}
			if err := os.WriteFile(filepath.Join(dir, it.Path), data[it.Key], os.FileMode(m)); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(filepath.Join(dir, it.Path), os.FileMode(m)); err != nil {
				t.Fatal(err)
			}
		}
	}
	return func(p string) string {
		best := ""
		for mp := range mounts {
			if (p == mp || strings.HasPrefix(p, mp+"/")) && len(mp) > len(best) {
				best = mp
			}
		}
		if best == "" {
			return p
		}
		return mounts[best] + strings.TrimPrefix(p, best)
	}
}

// containerEnv resolves c's environment as the kubelet does ($(VAR) of
// earlier entries; secrets as the test made them), over the image's ENV.
func (f *fleet) containerEnv(t *testing.T, c corev1.Container) map[string]string {
	t.Helper()
	envs := dockerfileEnv(t, imageStage(c.Image))
	resolved := map[string]string{}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil:
			ref := e.ValueFrom.SecretKeyRef
			v, ok := f.secretData(ref.Name)[ref.Key]
			if !ok {
				t.Fatalf("%s: %s from secret %s has no key %s", c.Name, e.Name, ref.Name, ref.Key)
			}
			resolved[e.Name] = string(v)
		case e.ValueFrom != nil:
			t.Fatalf("%s: %s: a source this test does not resolve", c.Name, e.Name)
		default:
			resolved[e.Name] = expandKube(e.Value, resolved)
		}
	}
	for k, v := range resolved {
		envs[k] = v
	}
	return envs
}

// expandKube is Kubernetes' $(VAR) expansion in env values and args.
func expandKube(s string, vars map[string]string) string {
	return regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`).ReplaceAllStringFunc(s, func(m string) string {
		if v, ok := vars[m[2:len(m)-1]]; ok {
			return v
		}
		return m
	})
}

// serveConfigOf feeds a stopgate container's arguments and environment,
// resolved and with its volumes laid out, to serve's own flag parsing.
func (f *fleet) serveConfigOf(t *testing.T, spec corev1.PodSpec, c corev1.Container) serve.Config {
	t.Helper()
	if len(c.Command) != 0 || len(c.Args) == 0 || c.Args[0] != "serve" {
		t.Fatalf("%s: want args [serve ...] on the image's stopgate entrypoint, got command %q args %q", c.Name, c.Command, c.Args)
	}
	path := f.layOut(t, spec, c)
	envs := f.containerEnv(t, c)
	args := make([]string, 0, len(c.Args)-1)
	for _, a := range c.Args[1:] {
		args = append(args, path(expandKube(a, envs)))
	}
	cfg, err := serve.ParseConfig(args, func(k string) string { return path(envs[k]) })
	if err != nil {
		t.Fatalf("%s: stopgate serve %q: %v", c.Name, args, err)
	}
	if cfg.Config != "" {
		if _, err := policy.Load(cfg.Config); err != nil {
			t.Errorf("%s: its policy does not load: %v", c.Name, err)
		}
	}
	if cfg.CACert != "" {
		if _, err := proxy.LoadCA(cfg.CACert, cfg.CAKey); err != nil {
			t.Errorf("%s: its CA does not load: %v", c.Name, err)
		}
	}
	return cfg
}

func uidString(uid *int64) string {
	if uid == nil {
		return "unset"
	}
	return fmt.Sprint(*uid)
}

func isLoopbackAddr(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	ip := net.ParseIP(host)
	return err == nil && ip != nil && ip.IsLoopback()
}

func findContainer(cs []corev1.Container, name string) (corev1.Container, bool) {
	for _, c := range cs {
		if c.Name == name {
			return c, true
		}
	}
	return corev1.Container{}, false
}

func envOf(c corev1.Container, name string) (corev1.EnvVar, bool) {
	for _, e := range c.Env {
		if e.Name == name {
			return e, true
		}
	}
	return corev1.EnvVar{}, false
}

// effectiveUser is the uid and runAsNonRoot a container runs with.
func effectiveUser(spec corev1.PodSpec, c corev1.Container) (uid *int64, nonRoot bool) {
	if psc := spec.SecurityContext; psc != nil {
		uid = psc.RunAsUser
		nonRoot = psc.RunAsNonRoot != nil && *psc.RunAsNonRoot
	}
	if sc := c.SecurityContext; sc != nil {
		if sc.RunAsUser != nil {
			uid = sc.RunAsUser
		}
		if sc.RunAsNonRoot != nil {
			nonRoot = *sc.RunAsNonRoot
		}
	}
	return uid, nonRoot
}

// TestDeployPodsAreLockedDown: every pod gets no API token and shares
// nothing with its node; every container has resources, a read-only root
// and no capability — but the redirect's init container, which is root
// with NET_ADMIN alone and exits before anything else runs.
func TestDeployPodsAreLockedDown(t *testing.T) {
	f := loadFleet(t)
	for name, pod := range f.pods() {
		spec := pod.Spec
		if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
			t.Errorf("%s: the pod gets a Kubernetes API token (automountServiceAccountToken is not false)", name)
		}
		if spec.HostNetwork || spec.HostPID || spec.HostIPC || (spec.ShareProcessNamespace != nil && *spec.ShareProcessNamespace) {
			t.Errorf("%s: the pod shares a namespace with its node or between its containers", name)
		}
		if spec.SecurityContext == nil || spec.SecurityContext.SeccompProfile == nil || spec.SecurityContext.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
			t.Errorf("%s: no RuntimeDefault seccomp profile", name)
		}
		for _, c := range append(append([]corev1.Container{}, spec.InitContainers...), spec.Containers...) {
			where := name + "/" + c.Name
			if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() || c.Resources.Limits.Memory().IsZero() {
				t.Errorf("%s: want cpu and memory requests and a memory limit, got %v", where, c.Resources)
			}
			for _, p := range c.Ports {
				if p.HostPort != 0 {
					t.Errorf("%s: hostPort %d", where, p.HostPort)
				}
			}
			sc := c.SecurityContext
			if sc == nil || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
				sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, "ALL") || (sc.Privileged != nil && *sc.Privileged) {
				t.Errorf("%s: want allowPrivilegeEscalation false, readOnlyRootFilesystem true, capabilities drop ALL, not privileged", where)
				continue
			}
			uid, nonRoot := effectiveUser(spec, c)
			if c.Name == "stopgate-redirect" {
				if uid == nil || *uid != 0 || !slices.Equal(sc.Capabilities.Add, []corev1.Capability{"NET_ADMIN"}) || c.RestartPolicy != nil {
					t.Errorf("%s: want an init container that runs to completion as root with NET_ADMIN alone, got uid %s caps %v", where, uidString(uid), sc.Capabilities.Add)
				}
				if !slices.ContainsFunc(spec.InitContainers, func(ic corev1.Container) bool { return ic.Name == c.Name }) {
					t.Errorf("%s: the redirect must be an init container", where)
				}
				continue
			}
			if len(sc.Capabilities.Add) != 0 {
				t.Errorf("%s: adds capabilities %v", where, sc.Capabilities.Add)
			}
			if !nonRoot || uid == nil || *uid == 0 {
				t.Errorf("%s: want runAsNonRoot with a non-zero runAsUser, got %v %s", where, nonRoot, uidString(uid))
			}
		}
	}
}

// TestDeployAgentPodWiring checks the agent Job as deploy/README.md
// describes it: the redirect of the worker's uid to the sidecar's
// transparent listener, the sidecar started (and probed) before the
// worker, the worker given the CA certificate alone and nothing else of
// stopgate's.
func TestDeployAgentPodWiring(t *testing.T) {
	f := loadFleet(t)
	spec := f.job.Spec.Template.Spec
	if len(spec.InitContainers) != 2 || spec.InitContainers[0].Name != "stopgate-redirect" || spec.InitContainers[1].Name != "stopgate" {
		t.Fatalf("want init containers [stopgate-redirect stopgate] in that order, got %d", len(spec.InitContainers))
	}
	redir, sidecar := spec.InitContainers[0], spec.InitContainers[1]
	worker, ok := findContainer(spec.Containers, "worker")
	if !ok || len(spec.Containers) != 1 {
		t.Fatalf("want one container, worker")
	}

	// The redirect's arguments, through stopgate redirect's own flags.
	if len(redir.Args) == 0 || redir.Args[0] != "redirect" {
		t.Fatalf("stopgate-redirect: want args [redirect install ...], got %q", redir.Args)
	}
	ro, err := cli.ParseRedirect(redir.Args[1:])
	if err != nil || ro.Action != "install" || ro.Port == 0 {
		t.Fatalf("stopgate-redirect: %q: %v %q (want install with --uid and --port: serve is not up to be asked)", redir.Args, err, ro.Action)
	}
	if !strings.HasSuffix(redir.Image, ":redirect") {
		t.Errorf("stopgate-redirect: image %s, want the Dockerfile's redirect target (it has iptables)", redir.Image)
	}

	// The sidecar: a native sidecar with a startup probe, serving the
	// transparent listener the redirect sends to, for the run of the pod.
	if sidecar.RestartPolicy == nil || *sidecar.RestartPolicy != corev1.ContainerRestartPolicyAlways || sidecar.StartupProbe == nil {
		t.Errorf("stopgate: want restartPolicy Always and a startupProbe, so the worker starts only once stopgate serves")
	} else if ex := sidecar.StartupProbe.Exec; ex == nil || !slices.Equal(ex.Command, []string{"stopgate", "ca"}) {
		t.Errorf("stopgate: startup probe %v, want exec stopgate ca (the control API is on loopback, out of the kubelet's reach)", sidecar.StartupProbe)
	}
	cfg := f.serveConfigOf(t, spec, sidecar)
	if _, port, _ := net.SplitHostPort(cfg.TransparentAddr); !isLoopbackAddr(cfg.TransparentAddr) || port != fmt.Sprint(ro.Port) {
		t.Errorf("stopgate: --transparent-addr %q, want loopback at the redirect's port %d", cfg.TransparentAddr, ro.Port)
	}
	for flag, addr := range map[string]string{"proxy": cfg.ProxyAddr, "control": cfg.ControlAddr, "browser": cfg.BrowserAddr} {
		if !isLoopbackAddr(addr) {
			t.Errorf("stopgate: the %s listener %q is not on loopback: it would be reachable from beyond the pod", flag, addr)
		}
	}
	runID, _ := envOf(worker, "RUN_ID")
	if cfg.Run == "" || cfg.Run != runID.Value {
		t.Errorf("stopgate: --run %q, want the worker's RUN_ID %q", cfg.Run, runID.Value)
	}
	if !cfg.RequireDurable || cfg.CACert == "" || !strings.HasPrefix(cfg.Store, "redis://") {
		t.Errorf("stopgate: want the fleet's Redis with --require-durable and the fleet CA, got store %q durable %v ca %q", redisstore.Redact(cfg.Store), cfg.RequireDurable, cfg.CACert)
	}
	sidecarUID, _ := effectiveUser(spec, sidecar)
	workerUID, _ := effectiveUser(spec, worker)
	if workerUID == nil || *workerUID != int64(ro.UID) {
		t.Errorf("worker: runs as uid %s, but the redirect is for uid %d", uidString(workerUID), ro.UID)
	}
	if sidecarUID == nil || *sidecarUID == int64(ro.UID) {
		t.Errorf("stopgate: runs as the redirected uid %d: its own upstream connections would come back to it", ro.UID)
	}

	// The worker: no proxy variables (the redirect carries everything), no
	// secrets, the CA certificate alone, nothing of the sidecar's.
	volumes := map[string]corev1.Volume{}
	for _, v := range spec.Volumes {
		volumes[v.Name] = v
	}
	sidecarVolumes := map[string]bool{}
	for _, m := range sidecar.VolumeMounts {
		sidecarVolumes[m.Name] = true
	}
	certMounts := map[string]string{} // mount path -> file name of the certificate
	for _, m := range worker.VolumeMounts {
		if sidecarVolumes[m.Name] {
			t.Errorf("worker: mounts %s, which the sidecar mounts (its data directory or its key)", m.Name)
		}
		v := volumes[m.Name]
		if v.Secret != nil {
			if len(v.Secret.Items) != 1 || v.Secret.Items[0].Key != "tls.crt" {
				t.Errorf("worker: mounts secret %s with items %v: want tls.crt alone (never the key)", v.Secret.SecretName, v.Secret.Items)
				continue
			}
			certMounts[m.MountPath] = v.Secret.Items[0].Path
		}
	}
	if len(worker.EnvFrom) != 0 {
		t.Errorf("worker: envFrom %v", worker.EnvFrom)
	}
	for _, e := range worker.Env {
		if strings.Contains(strings.ToUpper(e.Name), "PROXY") {
			t.Errorf("worker: %s is set: with the redirect, a client sending to the proxy would be redirected on its way there", e.Name)
		}
		if e.ValueFrom != nil {
			t.Errorf("worker: %s comes from %v: the worker gets no secret", e.Name, e.ValueFrom)
		}
	}
	for _, name := range []string{"SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS"} {
		e, ok := envOf(worker, name)
		if !ok || certMounts[filepath.Dir(e.Value)] != filepath.Base(e.Value) {
			t.Errorf("worker: %s=%q, want the CA certificate of a mounted tls.crt-only volume %v", name, e.Value, certMounts)
		}
	}
	// The worker's CA is the certificate the sidecar signs with.
	path := f.layOut(t, spec, worker)
	ssl, _ := envOf(worker, "SSL_CERT_FILE")
	if b, err := os.ReadFile(path(ssl.Value)); err != nil || !bytes.Equal(b, f.caCert) {
		t.Errorf("worker: %s is not the fleet CA's certificate: %v", ssl.Value, err)
	}

	// Nothing in the agent pod is exposed but the sidecar's metrics port,
	// which serves /metrics alone (--metrics-addr): no other port, no Service.
	sidecarCfg := f.serveConfigOf(t, spec, sidecar)
	for _, c := range append(append([]corev1.Container{}, spec.InitContainers...), spec.Containers...) {
		_, mport, _ := net.SplitHostPort(sidecarCfg.MetricsAddr)
		if c.Name == "stopgate" && len(c.Ports) == 1 && c.Ports[0].Name == "metrics" && fmt.Sprint(c.Ports[0].ContainerPort) == mport {
			continue
		}
		if len(c.Ports) != 0 {
			t.Errorf("agent pod: %s declares ports %v", c.Name, c.Ports)
		}
	}
	for name, svc := range f.services {
		if labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(f.job.Spec.Template.Labels)) {
			t.Errorf("Service %s selects the agent pods", name)
		}
	}
	if f.job.Spec.BackoffLimit == nil || *f.job.Spec.BackoffLimit != 0 {
		t.Errorf("agent Job: backoffLimit %v, want 0: a new attempt of a run is a decision, not a retry", f.job.Spec.BackoffLimit)
	}
}

// TestDeployControlPlaneWiring: the one place the control API is opened
// has a token, a Service and probes; every stopgate uses the Redis the
// manifests define.
func TestDeployControlPlaneWiring(t *testing.T) {
	f := loadFleet(t)
	spec := f.control.Spec.Template.Spec
	c, ok := findContainer(spec.Containers, "stopgate")
	if !ok {
		t.Fatal("control: no stopgate container")
	}
	cfg := f.serveConfigOf(t, spec, c)
	if isLoopbackAddr(cfg.ControlAddr) || cfg.ControlToken == "" {
		t.Errorf("control: control API %q with token %v: want it opened to the pod network, with a token", cfg.ControlAddr, cfg.ControlToken != "")
	}
	if !isLoopbackAddr(cfg.ProxyAddr) || !isLoopbackAddr(cfg.BrowserAddr) || !cfg.RequireDurable {
		t.Errorf("control: want the proxy and browser listeners on loopback and --require-durable: %+v", cfg)
	}
	svc := f.services["stopgate-control"]
	if svc == nil || !labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(f.control.Spec.Template.Labels)) {
		t.Fatalf("no Service stopgate-control selecting the control pods")
	}
	_, port, _ := net.SplitHostPort(cfg.ControlAddr)
	if len(c.Ports) != 2 || fmt.Sprint(c.Ports[0].ContainerPort) != port || svc.Spec.Ports[0].TargetPort.String() != c.Ports[0].Name {
		t.Errorf("control: the Service and the container port do not lead to the control API's port %s", port)
	}
	if _, mport, _ := net.SplitHostPort(cfg.MetricsAddr); c.Ports[1].Name != "metrics" || fmt.Sprint(c.Ports[1].ContainerPort) != mport {
		t.Errorf("control: want the port named metrics on --metrics-addr %q, got %v", cfg.MetricsAddr, c.Ports[1])
	}
	if c.ReadinessProbe == nil || c.ReadinessProbe.HTTPGet == nil || c.ReadinessProbe.HTTPGet.Path != "/readyz" {
		t.Errorf("control: want a readiness probe on /readyz (the store answers)")
	}

	// Every stopgate's store is the Redis Service of the manifests.
	redisSvc := f.services[f.redis.Spec.ServiceName]
	if redisSvc == nil || !labels.SelectorFromSet(redisSvc.Spec.Selector).Matches(labels.Set(f.redis.Spec.Template.Labels)) {
		t.Fatalf("the Redis StatefulSet's serviceName %q is not a Service selecting its pods", f.redis.Spec.ServiceName)
	}
	want := fmt.Sprintf("redis://%s.%s.svc:%d/", redisSvc.Name, redisSvc.Namespace, redisSvc.Spec.Ports[0].Port)
	sidecar, _ := findContainer(f.job.Spec.Template.Spec.InitContainers, "stopgate")
	redisPassword := f.redis.Spec.Template.Spec.Containers[0].Env[0].ValueFrom.SecretKeyRef
	for name, sc := range map[string]serve.Config{"control": cfg, "agent": f.serveConfigOf(t, f.job.Spec.Template.Spec, sidecar)} {
		if !strings.HasPrefix(sc.Store, want) {
			t.Errorf("%s: store %s is not the Redis Service (%s)", name, redisstore.Redact(sc.Store), want)
		}
		// The password Redis asks, apart from the URL.
		if sc.StorePassword == "" || sc.StorePassword != string(f.secretData(redisPassword.Name)[redisPassword.Key]) || redisstore.HasSecret(sc.Store) {
			t.Errorf("%s: the store password is not Redis's, from its Secret, apart from the URL", name)
		}
	}
	if len(f.redis.Spec.VolumeClaimTemplates) != 1 {
		t.Errorf("redis: want one PersistentVolumeClaim template")
	}
}

// TestDeployRedisConfigSatisfiesRequireDurable: the manifest's redis.conf,
// run by a real redis-server, is one stopgate serve --require-durable
// starts on.
func TestDeployRedisConfigSatisfiesRequireDurable(t *testing.T) {
	f := loadFleet(t)
	conf := f.configMaps["redis-config"].Data["redis.conf"]
	for _, line := range []string{"appendonly yes", "appendfsync always", "maxmemory-policy noeviction"} {
		if !regexp.MustCompile(`(?m)^\s*` + line + `\s*$`).MatchString(conf) {
			t.Errorf("redis.conf has no %q", line)
		}
	}
	if _, err := exec.LookPath("redis-server"); err != nil {
		t.Fatalf("redis-server not on PATH (make test installs it)")
	}
	// Redis keeps its AOF in the claimed volume: dir is where it is mounted.
	redisC := f.redis.Spec.Template.Spec.Containers[0]
	dataDir := regexp.MustCompile(`(?m)^dir (\S+)$`).FindStringSubmatch(conf)
	if len(dataDir) != 2 || !slices.ContainsFunc(redisC.VolumeMounts, func(m corev1.VolumeMount) bool {
		return m.MountPath == dataDir[1] && m.Name == f.redis.Spec.VolumeClaimTemplates[0].Name
	}) {
		t.Fatalf("redis.conf's dir %v is not the PersistentVolumeClaim's mount", dataDir)
	}
	// The volume is a temp dir here (Redis changes to its dir as it reads
	// the file); the harness's --dir, --port and --bind come after the file
	// and win; persistence is the file's alone.
	local := strings.Replace(conf, dataDir[0], "dir "+t.TempDir(), 1)
	redis := redisserver.Start(t, redisserver.Options{Conf: local, Password: "test-password", ConfDecides: true})
	s := startServe(t, "--store", redis.URL(), "--require-durable", "--data-dir", t.TempDir())
	if !strings.Contains(s.Log(), "durable=true") {
		t.Fatalf("serve did not report a durable store:\n%s", s.Log())
	}
}

// TestDeployNetworkPolicies: everything is denied but what the README
// lists; nothing reaches the agent pods; the control API answers only the
// operators' namespaces; Redis answers only stopgate.
func TestDeployNetworkPolicies(t *testing.T) {
	f := loadFleet(t)
	selects := func(p *networkingv1.NetworkPolicy, podLabels map[string]string) bool {
		sel, err := metav1.LabelSelectorAsSelector(&p.Spec.PodSelector)
		if err != nil {
			t.Fatalf("policy %s: %v", p.Name, err)
		}
		return sel.Matches(labels.Set(podLabels))
	}
	denyAll := false
	for _, p := range f.policies {
		if len(p.Spec.PodSelector.MatchLabels)+len(p.Spec.PodSelector.MatchExpressions) == 0 && len(p.Spec.Ingress) == 0 && len(p.Spec.Egress) == 0 &&
			slices.Contains(p.Spec.PolicyTypes, networkingv1.PolicyTypeIngress) && slices.Contains(p.Spec.PolicyTypes, networkingv1.PolicyTypeEgress) {
			denyAll = true
		}
	}
	if !denyAll {
		t.Fatalf("no default-deny policy (every pod, Ingress and Egress, no rule)")
	}
	pods := f.pods()
	operators := labels.Set{"stopgate-operator": "true", "kubernetes.io/metadata.name": "ops"}
	others := labels.Set{"kubernetes.io/metadata.name": "default"}
	scraperNS, scraper := labels.Set{"kubernetes.io/metadata.name": "monitoring"}, labels.Set{"app.kubernetes.io/name": "prometheus"}
	// scrapeOnly: the rule lets the scraper alone reach the metrics port alone.
	scrapeOnly := func(rule networkingv1.NetworkPolicyIngressRule) bool {
		if len(rule.Ports) != 1 || rule.Ports[0].Port.IntValue() != 9090 || len(rule.From) == 0 {
			return false
		}
		for _, peer := range rule.From {
			ns, err1 := metav1.LabelSelectorAsSelector(peer.NamespaceSelector)
			pod, err2 := metav1.LabelSelectorAsSelector(peer.PodSelector)
			if peer.NamespaceSelector == nil || peer.PodSelector == nil || err1 != nil || err2 != nil ||
				!ns.Matches(scraperNS) || ns.Matches(others) || !pod.Matches(scraper) || pod.Matches(labels.Set{"app": "anything-else"}) {
				return false
			}
		}
		return true
	}
	scraped := map[string]bool{}
	for _, p := range f.policies {
		for _, rule := range p.Spec.Ingress {
			if scrapeOnly(rule) {
				for _, kind := range []string{"agent", "control"} {
					scraped[kind] = scraped[kind] || selects(p, pods[kind].Labels)
				}
				continue
			}
			switch {
			case selects(p, pods["agent"].Labels):
				t.Errorf("policy %s lets something into the agent pods but the scraper on the metrics port: %v", p.Name, rule)
			case selects(p, pods["control"].Labels):
				for _, peer := range rule.From {
					ns, err := metav1.LabelSelectorAsSelector(peer.NamespaceSelector)
					if peer.NamespaceSelector == nil || peer.PodSelector != nil || peer.IPBlock != nil || err != nil || !ns.Matches(operators) || ns.Matches(others) {
						t.Errorf("policy %s: the control API admits %v, want the operators' namespaces alone", p.Name, peer)
					}
				}
				if len(rule.From) == 0 || len(rule.Ports) != 1 || rule.Ports[0].Port.IntValue() != 8081 {
					t.Errorf("policy %s: want the control port 8081 from named peers only, got %v", p.Name, rule)
				}
			case selects(p, pods["redis"].Labels):
				for _, peer := range rule.From {
					sel, err := metav1.LabelSelectorAsSelector(peer.PodSelector)
					if peer.PodSelector == nil || peer.NamespaceSelector != nil || err != nil || sel.Matches(labels.Set{"app": "anything-else"}) ||
						!sel.Matches(labels.Set(pods["control"].Labels)) || !sel.Matches(labels.Set(pods["agent"].Labels)) {
						t.Errorf("policy %s: Redis admits %v, want stopgate's pods alone", p.Name, peer)
					}
				}
			}
		}
		for _, rule := range p.Spec.Egress {
			for _, peer := range rule.To {
				if b := peer.IPBlock; b != nil && b.CIDR == "0.0.0.0/0" && !slices.Contains(b.Except, "169.254.0.0/16") {
					t.Errorf("policy %s: egress to the internet without excepting the metadata range: %v", p.Name, b)
				}
			}
		}
		if selects(p, pods["redis"].Labels) && len(p.Spec.Egress) != 0 {
			t.Errorf("policy %s: Redis may initiate connections", p.Name)
		}
	}
	if !scraped["agent"] || !scraped["control"] {
		t.Errorf("the scraper cannot reach the metrics port of the agent pods (%v) or the control pods (%v)", scraped["agent"], scraped["control"])
	}
}

// podMonitor is monitoring/podmonitor.yaml, decoded strictly.
type podMonitor struct {
	testkit.ObjectHead `yaml:",inline"`

	Spec struct {
		Selector struct {
			MatchExpressions []struct {
				Key      string   `yaml:"key"`
				Operator string   `yaml:"operator"`
				Values   []string `yaml:"values"`
			} `yaml:"matchExpressions"`
		} `yaml:"selector"`
		PodMetricsEndpoints []struct {
			Port        string `yaml:"port"`
			Path        string `yaml:"path"`
			Interval    string `yaml:"interval"`
			Relabelings []struct {
				SourceLabels []string `yaml:"sourceLabels"`
				TargetLabel  string   `yaml:"targetLabel"`
			} `yaml:"relabelings"`
		} `yaml:"podMetricsEndpoints"`
	} `yaml:"spec"`
}

// TestDeployPodMonitor: the PodMonitor scrapes the port the manifests name
// metrics, on the pods networkpolicy.yaml lets the scraper reach. (That
// every shipped expression names what serve's /metrics serves is
// cmd/proxy's TestMonitoringNamesWhatMetricsServes.)
func TestDeployPodMonitor(t *testing.T) {
	var pm podMonitor
	testkit.DecodeStrict(t, "monitoring/podmonitor.yaml", &pm)
	if pm.Kind != "PodMonitor" || pm.Metadata.Namespace != "stopgate" || len(pm.Spec.PodMetricsEndpoints) != 1 {
		t.Fatalf("podmonitor.yaml: %+v", pm)
	}
	ep := pm.Spec.PodMetricsEndpoints[0]
	f := loadFleet(t)
	pods := f.pods()
	for _, kind := range []string{"agent", "control"} {
		selected := true
		for _, e := range pm.Spec.Selector.MatchExpressions {
			selected = selected && e.Operator == "In" && slices.Contains(e.Values, labels.Set(pods[kind].Labels).Get(e.Key))
		}
		if !selected {
			t.Errorf("the PodMonitor does not select the %s pods", kind)
		}
		spec := pods[kind].Spec
		named := false
		for _, c := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
			for _, p := range c.Ports {
				named = named || p.Name == ep.Port && p.ContainerPort == 9090
			}
		}
		if !named || ep.Path != "/metrics" {
			t.Errorf("the %s pods have no port %q on 9090 for %s", kind, ep.Port, ep.Path)
		}
	}
}

// stage is one FROM ... AS name of deploy/Dockerfile, with its
// instructions (continuation lines joined).
type stage struct {
	name, from string
	lines      []string // "INSTRUCTION args"
}

func dockerfileStages(t *testing.T) []stage {
	t.Helper()
	b, err := os.ReadFile("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	var stages []stage
	joined := strings.ReplaceAll(string(b), "\\\n", " ")
	for _, line := range strings.Split(joined, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fields := strings.Fields(line)
		if strings.EqualFold(fields[0], "FROM") {
			if len(fields) != 4 || !strings.EqualFold(fields[2], "AS") {
				t.Fatalf("Dockerfile: %q: want FROM IMAGE AS NAME", line)
			}
			stages = append(stages, stage{name: fields[3], from: fields[1]})
			continue
		}
		if len(stages) == 0 {
			t.Fatalf("Dockerfile: %q before any FROM", line)
		}
		st := &stages[len(stages)-1]
		st.lines = append(st.lines, strings.ToUpper(fields[0])+" "+strings.Join(fields[1:], " "))
	}
	return stages
}

func (s stage) instructions(name string) []string {
	var out []string
	for _, l := range s.lines {
		if strings.HasPrefix(l, name+" ") {
			out = append(out, strings.TrimPrefix(l, name+" "))
		}
	}
	return out
}

// env is the stage's ENV, KEY=VALUE pairs.
func (s stage) env() map[string]string {
	out := map[string]string{}
	for _, e := range s.instructions("ENV") {
		for _, kv := range strings.Fields(e) {
			if k, v, ok := strings.Cut(kv, "="); ok {
				out[k] = v
			}
		}
	}
	return out
}

// imageStage is the Dockerfile target an image reference names:
// stopgate:browser is the browser stage, stopgate:latest the default.
func imageStage(image string) string {
	name, tag, _ := strings.Cut(image, ":")
	if name != "stopgate" {
		return ""
	}
	if tag == "browser" || tag == "redirect" {
		return tag
	}
	return "stopgate"
}

// dockerfileEnv is the ENV of a stage ("" for an image not built here).
func dockerfileEnv(t *testing.T, name string) map[string]string {
	t.Helper()
	if name == "" {
		return map[string]string{}
	}
	for _, s := range dockerfileStages(t) {
		if s.name == name {
			return s.env()
		}
	}
	t.Fatalf("no stage %s in deploy/Dockerfile", name)
	return nil
}

// TestDeployDockerfile: the default image is the small one, every image is
// non-root but the redirect's, none opens the control API, and nothing of
// the build context but the binary reaches an image.
func TestDeployDockerfile(t *testing.T) {
	stages := dockerfileStages(t)
	var names []string
	for _, s := range stages {
		names = append(names, s.name)
	}
	if !slices.Equal(names, []string{"build", "browser", "redirect", "stopgate"}) {
		t.Fatalf("stages %v, want build, browser, redirect and stopgate last (the default target)", names)
	}
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range stages[1:] {
		if !strings.Contains(string(readme), "docker build -f deploy/Dockerfile") ||
			(s.name != "stopgate" && !strings.Contains(string(readme), "--target "+s.name)) {
			t.Errorf("deploy/README.md does not say how to build the %s image", s.name)
		}
		for _, l := range s.lines {
			if strings.HasPrefix(l, "ADD ") || (strings.HasPrefix(l, "COPY ") && !strings.Contains(l, "--from=build ")) {
				t.Errorf("%s: %q: only the binary (and an empty data directory) may come from the build", s.name, l)
			}
		}
		users := s.instructions("USER")
		if len(users) == 0 {
			t.Errorf("%s: no USER", s.name)
			continue
		}
		user := users[len(users)-1]
		switch s.name {
		case "redirect":
			if user != "0:0" {
				t.Errorf("redirect: USER %s, want 0:0 (iptables; it runs once, in an init container)", user)
			}
		default:
			if user != "10001:10001" {
				t.Errorf("%s: USER %s, want 10001:10001, the uid the manifests run stopgate as", s.name, user)
			}
		}
		if ep := s.instructions("ENTRYPOINT"); !slices.Equal(ep, []string{`["stopgate"]`}) {
			t.Errorf("%s: ENTRYPOINT %v, want [\"stopgate\"] (the manifests pass args only)", s.name, ep)
		}
		for _, ports := range s.instructions("EXPOSE") {
			for _, p := range strings.Fields(ports) {
				if p != "8080" {
					t.Errorf("%s: EXPOSE %s: only the proxy's port is meant to be opened by an image", s.name, p)
				}
			}
		}
		for k, v := range s.env() {
			if strings.HasSuffix(k, "_ADDR") {
				t.Errorf("%s: ENV %s=%s: the images keep the loopback defaults; opening a listener is the operator's act", s.name, k, v)
			}
		}
	}
	browser := stages[1]
	if !strings.Contains(strings.Join(browser.instructions("RUN"), " "), "chromium") || browser.env()["STOPGATE_CHROMIUM"] != "/usr/bin/chromium" {
		t.Errorf("browser: want Chromium installed and STOPGATE_CHROMIUM=/usr/bin/chromium")
	}
	if !strings.Contains(strings.Join(stages[2].instructions("RUN"), " "), "iptables") {
		t.Errorf("redirect: want iptables installed")
	}

	ignore, err := os.ReadFile("../.dockerignore")
	if err != nil {
		t.Fatalf(".dockerignore: %v", err)
	}
	patterns := strings.Fields(string(regexp.MustCompile(`(?m)#.*$`).ReplaceAll(ignore, nil)))
	for _, want := range []string{"stopgate-data", "**/stopgate-data", "**/*.pem", "bin", ".git"} {
		if !slices.Contains(patterns, want) {
			t.Errorf(".dockerignore does not list %s", want)
		}
	}
}

// composeFile is the part of docker-compose.yml the test reads.
type composeFile struct {
	Services map[string]struct {
		Build struct {
			Target string `yaml:"target"`
		} `yaml:"build"`
		Image       string            `yaml:"image"`
		Command     []string          `yaml:"command"`
		Environment map[string]string `yaml:"environment"`
		Ports       []string          `yaml:"ports"`
		Networks    yaml.Node         `yaml:"networks"`
	} `yaml:"services"`
	Networks map[string]struct {
		Internal bool `yaml:"internal"`
	} `yaml:"networks"`
}

// networks are a service's networks, from a list or a map.
func networksOf(n yaml.Node) []string {
	var out []string
	switch n.Kind {
	case yaml.SequenceNode:
		for _, c := range n.Content {
			out = append(out, c.Value)
		}
	case yaml.MappingNode:
		for i := 0; i < len(n.Content); i += 2 {
			out = append(out, n.Content[i].Value)
		}
	}
	return out
}

// TestDeployCompose: Redis persists every write; both stopgate instances
// start on it as configured; the agent reaches stopgate-a alone; only
// stopgate-b's control API is published, on the laptop's loopback.
func TestDeployCompose(t *testing.T) {
	b, err := os.ReadFile("docker-compose.yml")
	if err != nil {
		t.Fatal(err)
	}
	var c composeFile
	if err := yaml.Unmarshal(b, &c); err != nil {
		t.Fatalf("docker-compose.yml: %v", err)
	}
	redis := strings.Join(c.Services["redis"].Command, " ")
	if !strings.Contains(redis, "--appendonly yes") || !strings.Contains(redis, "--appendfsync always") {
		t.Errorf("redis: %q, want AOF with appendfsync always", redis)
	}
	// Redis asks a password, which only the stopgate instances are given.
	password := c.Services["redis"].Environment["REDIS_PASSWORD"]
	if !strings.Contains(redis, "requirepass") || !strings.Contains(redis, "$$REDIS_PASSWORD") || !strings.Contains(redis, "--maxmemory-policy noeviction") ||
		!strings.HasPrefix(password, "${STOPGATE_REDIS_PASSWORD:?") {
		t.Errorf("redis: %q with REDIS_PASSWORD %q, want requirepass from the variable the operator exports, and noeviction", redis, password)
	}
	for name, svc := range c.Services {
		if p := svc.Environment["STOPGATE_STORE_PASSWORD"]; (p != "") != strings.HasPrefix(name, "stopgate-") || (p != "" && p != "${STOPGATE_REDIS_PASSWORD}") {
			t.Errorf("%s: STOPGATE_STORE_PASSWORD %q: only the stopgate instances get Redis's password", name, p)
		}
	}
	cfgs := map[string]serve.Config{}
	for _, name := range []string{"stopgate-a", "stopgate-b"} {
		svc := c.Services[name]
		stage := "stopgate"
		if svc.Build.Target != "" {
			stage = svc.Build.Target
		}
		envs := dockerfileEnv(t, stage)
		for k, v := range svc.Environment {
			envs[k] = v
		}
		cfg, err := serve.ParseConfig(nil, func(k string) string { return envs[k] })
		if err != nil {
			t.Fatalf("%s: stopgate serve with its environment: %v", name, err)
		}
		cfgs[name] = cfg
		if !cfg.RequireDurable || !strings.HasPrefix(cfg.Store, "redis://redis:") {
			t.Errorf("%s: want the compose Redis with --require-durable, got %q %v", name, cfg.Store, cfg.RequireDurable)
		}
		for _, p := range svc.Ports {
			if !strings.HasPrefix(p, "127.0.0.1:") {
				t.Errorf("%s: publishes %s beyond the laptop's loopback", name, p)
			}
		}
	}
	if cfgs["stopgate-a"].Store != cfgs["stopgate-b"].Store {
		t.Errorf("the two instances do not share a store")
	}
	// The browser image is used: the agent's sidecar can start a guarded
	// Chromium for its run.
	if c.Services["stopgate-a"].Build.Target != "browser" || cfgs["stopgate-a"].Chromium != "/usr/bin/chromium" {
		t.Errorf("stopgate-a: want the browser image, with its Chromium: target %q, chromium %q", c.Services["stopgate-a"].Build.Target, cfgs["stopgate-a"].Chromium)
	}
	if !isLoopbackAddr(cfgs["stopgate-a"].ControlAddr) || len(c.Services["stopgate-a"].Ports) != 0 {
		t.Errorf("stopgate-a: the agent's sidecar opens its control API or publishes a port")
	}
	agent := c.Services["agent"]
	for _, n := range networksOf(agent.Networks) {
		if !c.Networks[n].Internal {
			t.Errorf("agent: on network %s, which is not internal", n)
		}
		for name, svc := range c.Services {
			if name != "agent" && name != "stopgate-a" && slices.Contains(networksOf(svc.Networks), n) {
				t.Errorf("agent: shares network %s with %s; it should reach stopgate-a alone", n, name)
			}
		}
	}
	for _, k := range []string{"HTTP_PROXY", "http_proxy"} {
		if u, err := url.Parse(agent.Environment[k]); err != nil || u.Hostname() != "stopgate-a" || u.User.Username() == "" {
			t.Errorf("agent: %s=%q, want stopgate-a's proxy with the run as credentials", k, agent.Environment[k])
		}
	}
}

// TestDeployReadmeCommands: the Secrets and ConfigMap the manifests use are
// the ones deploy/README.md makes, and its CA command makes a CA serve
// loads.
func TestDeployReadmeCommands(t *testing.T) {
	f := loadFleet(t)
	b, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	readme := string(b)
	made := map[string]bool{}
	for _, m := range regexp.MustCompile(`kubectl -n stopgate create (?:secret (?:tls|generic)|configmap) ([a-z0-9-]+)`).FindAllStringSubmatch(readme, -1) {
		made[m[1]] = true
	}
	for _, pod := range f.pods() {
		for _, v := range pod.Spec.Volumes {
			if v.Secret != nil && !made[v.Secret.SecretName] {
				t.Errorf("secret %s is used but deploy/README.md does not create it", v.Secret.SecretName)
			}
			if v.ConfigMap != nil && f.configMaps[v.ConfigMap.Name] == nil && !made[v.ConfigMap.Name] {
				t.Errorf("configmap %s is used but neither shipped nor created by deploy/README.md", v.ConfigMap.Name)
			}
		}
		for _, c := range append(append([]corev1.Container{}, pod.Spec.InitContainers...), pod.Spec.Containers...) {
			for _, e := range c.Env {
				if e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil && !made[e.ValueFrom.SecretKeyRef.Name] {
					t.Errorf("%s: secret %s is used but deploy/README.md does not create it", c.Name, e.ValueFrom.SecretKeyRef.Name)
				}
			}
		}
	}
	line := regexp.MustCompile(`(?m)^openssl req .*$`).FindString(readme)
	if line == "" {
		t.Fatal("deploy/README.md has no openssl command to make the fleet CA")
	}
	if _, err := exec.LookPath("openssl"); err != nil {
		t.Skip("openssl is not installed: the CA command is not run")
	}
	dir := t.TempDir()
	cmd := exec.Command("sh", "-c", line)
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", line, err, out)
	}
	if _, err := proxy.LoadCA(filepath.Join(dir, "ca.pem"), filepath.Join(dir, "ca-key.pem")); err != nil {
		t.Fatalf("the CA deploy/README.md makes does not load: %v", err)
	}
}
