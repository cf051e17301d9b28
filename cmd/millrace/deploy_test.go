package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"sigs.k8s.io/yaml"
)

const deployDir = "../../deploy"

// manifests are the Kubernetes objects of deploy/kubernetes/base, each
// decoded into its API type with unknown fields refused, by kind.
type manifests struct {
	deployments []appsv1.Deployment
	services    []corev1.Service
	pdbs        []policyv1.PodDisruptionBudget
	configMaps  []corev1.ConfigMap
	secrets     []corev1.Secret // secrets.example.yaml
}

func readManifests(t *testing.T) (manifests, []string) {
	t.Helper()
	base := filepath.Join(deployDir, "kubernetes", "base")
	var k struct {
		Resources []string `json:"resources"`
		Images    []struct {
			Name string `json:"name"`
		} `json:"images"`
	}
	b, err := os.ReadFile(filepath.Join(base, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, &k); err != nil {
		t.Fatalf("kustomization.yaml: %v", err)
	}
	files, _ := filepath.Glob(filepath.Join(base, "*.yaml"))
	for _, f := range files {
		name := filepath.Base(f)
		if name != "kustomization.yaml" && name != "secrets.example.yaml" && !slices.Contains(k.Resources, name) {
			t.Errorf("%s is not among kustomization.yaml's resources", name)
		}
	}
	var m manifests
	for _, name := range append(slices.Clone(k.Resources), "secrets.example.yaml") {
		b, err := os.ReadFile(filepath.Join(base, name))
		if err != nil {
			t.Fatalf("kustomization.yaml lists %s: %v", name, err)
		}
		for i, doc := range bytes.Split(b, []byte("\n---\n")) {
			var head struct{ APIVersion, Kind string }
			if err := yaml.Unmarshal(doc, &head); err != nil {
				t.Fatalf("%s #%d: %v", name, i+1, err)
			}
			var dst any
			switch head.APIVersion + " " + head.Kind {
			case "apps/v1 Deployment":
				m.deployments = append(m.deployments, appsv1.Deployment{})
				dst = &m.deployments[len(m.deployments)-1]
			case "v1 Service":
				m.services = append(m.services, corev1.Service{})
				dst = &m.services[len(m.services)-1]
			case "policy/v1 PodDisruptionBudget":
				m.pdbs = append(m.pdbs, policyv1.PodDisruptionBudget{})
				dst = &m.pdbs[len(m.pdbs)-1]
			case "v1 ConfigMap":
				m.configMaps = append(m.configMaps, corev1.ConfigMap{})
				dst = &m.configMaps[len(m.configMaps)-1]
			case "v1 Secret":
				m.secrets = append(m.secrets, corev1.Secret{})
				dst = &m.secrets[len(m.secrets)-1]
			default:
				t.Fatalf("%s #%d: %s %s is not a kind this test knows", name, i+1, head.APIVersion, head.Kind)
			}
			if err := yaml.UnmarshalStrict(doc, dst); err != nil {
				t.Fatalf("%s #%d (%s): %v", name, i+1, head.Kind, err)
			}
		}
	}
	var images []string
	for _, im := range k.Images {
		images = append(images, im.Name)
	}
	return m, images
}

// commandOf finds the subcommand whose words begin args, and the flags and
// environment variables it reads (its flags' usage names them, [$VAR]).
func commandOf(t *testing.T, args []string) (name string, fs *flag.FlagSet, envs map[string]bool, rest []string) {
	t.Helper()
	for _, c := range commands {
		words := strings.Fields(c.Name)
		if len(args) >= len(words) && slices.Equal(args[:len(words)], words) && len(words) > len(strings.Fields(name)) {
			name, rest = c.Name, args[len(words):]
			fs = flag.NewFlagSet(c.Name, flag.ContinueOnError)
			c.Flags(fs)
		}
	}
	if fs == nil {
		t.Fatalf("no millrace command runs as %q", args)
	}
	envs = map[string]bool{"GOGC": true, "GOMEMLIMIT": true, gcHeadroomEnv: true}
	re := regexp.MustCompile(`\[\$([A-Z0-9_]+)\]`)
	fs.VisitAll(func(f *flag.Flag) {
		for _, m := range re.FindAllStringSubmatch(f.Usage, -1) {
			envs[m[1]] = true
		}
	})
	return name, fs, envs, rest
}

// checkArgs: every flag in args is one the command has.
func checkArgs(t *testing.T, where string, fs *flag.FlagSet, args []string) {
	t.Helper()
	for _, a := range args {
		if !strings.HasPrefix(a, "-") {
			t.Errorf("%s: argument %q is not a flag", where, a)
			continue
		}
		name, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if fs.Lookup(name) == nil {
			t.Errorf("%s: %s has no flag %q", where, fs.Name(), name)
		}
	}
}

// dockerImage is the image the Dockerfile says it builds (its label
// io.millrace.image), and where it puts the binary (ENTRYPOINT).
func dockerImage(t *testing.T) (image, entrypoint string, uid int64) {
	t.Helper()
	b, err := os.ReadFile("../../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	if m := regexp.MustCompile(`io\.millrace\.image="([^"]+)"`).FindStringSubmatch(s); m != nil {
		image = m[1]
	}
	if m := regexp.MustCompile(`(?m)^ENTRYPOINT \["([^"]+)"\]`).FindStringSubmatch(s); m != nil {
		entrypoint = m[1]
	}
	if m := regexp.MustCompile(`(?m)^USER (\d+)`).FindStringSubmatch(s); m != nil {
		fmt.Sscan(m[1], &uid)
	}
	if image == "" || entrypoint != "/usr/local/bin/millrace" || uid == 0 {
		t.Fatalf("the Dockerfile's image %q, entrypoint %q, user %d: want a label io.millrace.image, the binary as entrypoint, a non-root user", image, entrypoint, uid)
	}
	return image, entrypoint, uid
}

func imageName(ref string) string {
	if i := strings.LastIndex(ref, ":"); i > strings.LastIndex(ref, "/") {
		return ref[:i]
	}
	return ref
}

func listenPort(addr string) int32 {
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		return -1
	}
	var n int32
	fmt.Sscan(p, &n)
	return n
}

// TestKubernetesManifests parses every manifest of deploy/kubernetes/base
// with the Kubernetes API types and checks it against the code: each
// container runs the Dockerfile's image as a millrace command with flags
// and environment that command has, listens where its ports say, is
// probed on /readyz and /healthz of its HTTP address, mounts Secrets that
// secrets.example.yaml describes, and each Deployment has a disruption
// budget and its Service (if any) a port the container serves.
func TestKubernetesManifests(t *testing.T) {
	m, images := readManifests(t)
	image, _, uid := dockerImage(t)
	if !slices.Contains(images, image) {
		t.Errorf("kustomization.yaml's images %v do not name the Dockerfile's %s", images, image)
	}
	configEnv := map[string]bool{}
	for _, cm := range m.configMaps {
		for k := range cm.Data {
			configEnv[k] = false // true once a command reads it
		}
	}
	secretKeys := map[string]map[string]bool{}
	for _, s := range m.secrets {
		secretKeys[s.Name] = map[string]bool{}
		for k := range s.StringData {
			secretKeys[s.Name][k] = true
		}
	}
	seen := map[string]bool{}
	for _, d := range m.deployments {
		spec := d.Spec.Template.Spec
		if sc := spec.SecurityContext; sc == nil || sc.RunAsUser == nil || *sc.RunAsUser != uid {
			t.Errorf("%s: the pod does not run as the image's user %d", d.Name, uid)
		}
		if spec.TerminationGracePeriodSeconds == nil || *spec.TerminationGracePeriodSeconds <= 20 {
			t.Errorf("%s: the grace period must be above the processes' shutdown timeout (20 s)", d.Name)
		}
		if !labelsMatch(d.Spec.Selector.MatchLabels, d.Spec.Template.Labels) {
			t.Errorf("%s: the selector does not match the pod's labels", d.Name)
		}
		vols := map[string]corev1.Volume{}
		for _, v := range spec.Volumes {
			vols[v.Name] = v
		}
		for i, c := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
			where := d.Name + "/" + c.Name
			if imageName(c.Image) != image {
				t.Errorf("%s: image %s, want the Dockerfile's %s", where, c.Image, image)
			}
			if len(c.Command) > 0 {
				t.Errorf("%s: a command replaces the image's entrypoint", where)
			}
			name, fs, envs, rest := commandOf(t, c.Args)
			seen[name] = true
			checkArgs(t, where, fs, rest)
			env := map[string]string{}
			for _, e := range c.Env {
				if !envs[e.Name] {
					t.Errorf("%s: %s does not read $%s", where, name, e.Name)
				}
				env[e.Name] = e.Value
			}
			for k := range configEnv {
				if envs[k] {
					configEnv[k] = true
				}
			}
			for _, vm := range c.VolumeMounts {
				v, ok := vols[vm.Name]
				if !ok {
					t.Errorf("%s: mounts %s, which the pod does not have", where, vm.Name)
				} else if v.Secret != nil && secretKeys[v.Secret.SecretName] == nil {
					t.Errorf("%s: mounts Secret %s, which secrets.example.yaml does not describe", where, v.Secret.SecretName)
				}
			}
			for _, e := range c.Env {
				if r := e.ValueFrom; r != nil && r.SecretKeyRef != nil && !secretKeys[r.SecretKeyRef.Name][r.SecretKeyRef.Key] {
					t.Errorf("%s: $%s from Secret %s key %s, which secrets.example.yaml does not describe", where, e.Name, r.SecretKeyRef.Name, r.SecretKeyRef.Key)
				}
			}
			// Secret files named by flags are in a mounted Secret with that key.
			for _, a := range rest {
				_, v, ok := strings.Cut(a, "=")
				if !ok || !strings.HasPrefix(v, "/etc/millrace/") {
					continue
				}
				if !mountedSecretKey(c, vols, secretKeys, v) {
					t.Errorf("%s: %s is in no mounted Secret's keys", where, v)
				}
			}
			if i < len(spec.InitContainers) {
				continue
			}
			checkPorts(t, where, c, env)
		}
		var budget bool
		for _, p := range m.pdbs {
			budget = budget || labelsMatch(p.Spec.Selector.MatchLabels, d.Spec.Template.Labels)
		}
		if !budget {
			t.Errorf("%s: no PodDisruptionBudget selects its pods", d.Name)
		}
	}
	for k, read := range configEnv {
		if !read {
			t.Errorf("the ConfigMap sets $%s, which no command of the Deployments reads", k)
		}
	}
	for _, s := range m.services {
		var target *appsv1.Deployment
		for i, d := range m.deployments {
			if labelsMatch(s.Spec.Selector, d.Spec.Template.Labels) {
				target = &m.deployments[i]
			}
		}
		if target == nil {
			t.Errorf("Service %s selects no Deployment", s.Name)
			continue
		}
		for _, p := range s.Spec.Ports {
			var served bool
			for _, cp := range target.Spec.Template.Spec.Containers[0].Ports {
				served = served || cp.Name == p.TargetPort.String() && cp.ContainerPort == p.Port
			}
			if !served {
				t.Errorf("Service %s port %d (%s): the container serves no such port", s.Name, p.Port, p.TargetPort.String())
			}
		}
	}
	for _, want := range []string{"serve bes", "project builds", "serve fleet", "serve reservations", "project fleet", "project placer",
		"serve commits", "project compactor", "export kafka", "serve console", "migrate"} {
		if !seen[want] {
			t.Errorf("no Deployment runs `millrace %s`", want)
		}
	}
}

func labelsMatch(selector, labels map[string]string) bool {
	if len(selector) == 0 {
		return false
	}
	for k, v := range selector {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// mountedSecretKey: path is a key of a Secret the container mounts.
func mountedSecretKey(c corev1.Container, vols map[string]corev1.Volume, keys map[string]map[string]bool, path string) bool {
	for _, vm := range c.VolumeMounts {
		v := vols[vm.Name]
		if v.Secret == nil || filepath.Dir(path) != filepath.Clean(vm.MountPath) {
			continue
		}
		if keys[v.Secret.SecretName][filepath.Base(path)] {
			return true
		}
	}
	return false
}

// checkPorts: the container's http port is its MILLRACE_HTTP_LISTEN, its
// grpc port the listen address of its gRPC server, both on every address,
// and the probes ask /readyz and /healthz on the http port.
func checkPorts(t *testing.T, where string, c corev1.Container, env map[string]string) {
	t.Helper()
	ports := map[string]int32{}
	for _, p := range c.Ports {
		ports[p.Name] = p.ContainerPort
	}
	http, ok := env["MILLRACE_HTTP_LISTEN"]
	if !ok || !strings.HasPrefix(http, "0.0.0.0:") || listenPort(http) != ports["http"] {
		t.Errorf("%s: MILLRACE_HTTP_LISTEN %q and the http port %d disagree (or it listens on loopback only)", where, http, ports["http"])
	}
	for k, v := range env {
		if strings.HasSuffix(k, "_LISTEN") && k != "MILLRACE_HTTP_LISTEN" {
			if ports["grpc"] != listenPort(v) || !strings.HasPrefix(v, "0.0.0.0:") {
				t.Errorf("%s: %s %q and the grpc port %d disagree", where, k, v, ports["grpc"])
			}
		}
	}
	if _, ok := ports["grpc"]; ok && !slices.ContainsFunc(keysOf(env), func(k string) bool { return strings.HasSuffix(k, "_LISTEN") && k != "MILLRACE_HTTP_LISTEN" }) {
		t.Errorf("%s: a grpc port, but no listen address set for it (the default is loopback)", where)
	}
	for probe, want := range map[*corev1.Probe]string{c.ReadinessProbe: "/readyz", c.LivenessProbe: "/healthz"} {
		if probe == nil || probe.HTTPGet == nil || probe.HTTPGet.Path != want || probe.HTTPGet.Port.String() != "http" {
			t.Errorf("%s: want an HTTP probe of %s on the http port", where, want)
		}
	}
	if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() || c.Resources.Limits.Memory().IsZero() {
		t.Errorf("%s: CPU and memory requests and a memory limit are required", where)
	}
}

func keysOf(m map[string]string) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	return ks
}

// TestComposeFile checks deploy/compose/compose.yaml against the code as
// TestKubernetesManifests checks the manifests: the image, each service's
// command and its flags, and the environment each reads.
func TestComposeFile(t *testing.T) {
	image, _, uid := dockerImage(t)
	b, err := os.ReadFile(filepath.Join(deployDir, "compose", "compose.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		Services map[string]struct {
			Image       string            `json:"image"`
			Command     []string          `json:"command"`
			User        string            `json:"user"`
			Environment map[string]string `json:"environment"`
		} `json:"services"`
	}
	if err := yaml.Unmarshal(b, &f); err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for name, s := range f.Services {
		if imageName(s.Image) != image {
			continue // nats, postgres
		}
		if s.User != fmt.Sprintf("%d:%d", uid, uid) {
			t.Errorf("%s: user %q, want the image's %d", name, s.User, uid)
		}
		cmd, fs, envs, rest := commandOf(t, s.Command)
		seen[cmd] = true
		checkArgs(t, name, fs, rest)
		for k := range s.Environment {
			if !envs[k] && !strings.HasPrefix(k, "MILLRACE_NATS_") && k != "DATABASE_URL" && k != "MILLRACE_BUCKET_URL" && k != "RETENTION_RAW_DAYS" && k != "MILLRACE_LOG_FORMAT" {
				t.Errorf("%s: %s does not read $%s", name, cmd, k)
			}
		}
	}
	if len(seen) < 11 {
		t.Errorf("compose.yaml runs %d millrace commands (%v), want every service's and migrate", len(seen), seen)
	}
}

// registeredMetrics are the metric names the code registers: the Name of
// every prometheus Opts of a millrace_ metric in the repository's code,
// and the names given to bucket.NewOperations; a histogram's series add
// _bucket, _sum and _count.
func registeredMetrics(t *testing.T) map[string]bool {
	t.Helper()
	names := map[string]bool{}
	opts := regexp.MustCompile(`Name:\s+"(millrace_[a-z0-9_]+)"`)
	ops := regexp.MustCompile(`NewOperations\([^,]+,\s*"(millrace_[a-z0-9_]+)"`)
	err := filepath.WalkDir("../..", func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "var" || d.Name() == "node_modules" || strings.HasPrefix(d.Name(), ".")) && path != "../.." {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, re := range []*regexp.Regexp{opts, ops} {
			for _, m := range re.FindAllSubmatch(b, -1) {
				names[string(m[1])] = true
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if !names["millrace_bes_events_total"] || !names["millrace_consumer_lag_seconds"] {
		t.Fatalf("found %d metric names, not the edge's and the consumers'", len(names))
	}
	return names
}

// TestDashboardsNameRegisteredMetrics: every query of every Grafana
// dashboard in deploy/grafana names only metrics the code registers.
func TestDashboardsNameRegisteredMetrics(t *testing.T) {
	names := registeredMetrics(t)
	files, _ := filepath.Glob(filepath.Join(deployDir, "grafana", "*.json"))
	if len(files) < 5 {
		t.Fatalf("%d dashboards, want the edges', projectors', fleet's, commit log's and export's", len(files))
	}
	metric := regexp.MustCompile(`\bmillrace_[a-z0-9_]+`)
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var d struct {
			Title  string
			Panels []struct {
				Title   string
				Targets []struct{ Expr string }
			}
		}
		if err := json.Unmarshal(b, &d); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		queries := 0
		for _, p := range d.Panels {
			for _, q := range p.Targets {
				queries++
				found := metric.FindAllString(q.Expr, -1)
				if len(found) == 0 {
					t.Errorf("%s, %q: query %q names no millrace metric", filepath.Base(f), p.Title, q.Expr)
				}
				for _, n := range found {
					base := n
					for _, suffix := range []string{"_bucket", "_sum", "_count"} {
						if b, ok := strings.CutSuffix(n, suffix); ok && names[b] {
							base = b
						}
					}
					if !names[base] {
						t.Errorf("%s, %q: %s is no metric the code registers", filepath.Base(f), p.Title, n)
					}
				}
			}
		}
		if queries == 0 {
			t.Errorf("%s has no queries", f)
		}
	}
}
