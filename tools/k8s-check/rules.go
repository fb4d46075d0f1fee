package main

import (
	"fmt"
	"net"
	"regexp"
	"strconv"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
)

// The rules every pod template of an overlay must follow (docs/kubernetes.md, "What k8s-check
// enforces"). Each finding names its rule, so a refusal says which rule and where.
const (
	ruleDecode    = "strict-decode"
	ruleProbes    = "probes"
	ruleResources = "resources"
	ruleSecurity  = "security-context"
	ruleHost      = "no-host-access"
	ruleSecrets   = "secret-by-reference"
	rulePDB       = "pdb"
	ruleNetpol    = "network-policy"
	ruleRefs      = "references"
	ruleRanks     = "trainer-ranks"
)

// The trainer's rank settings (shared/settings.py, TrainerSettings) and the label the StatefulSet
// controller puts on every pod (Kubernetes >= 1.28).
const (
	envWorldSize  = "FLYWHEEL_TRAINER_WORLD_SIZE"
	envRank       = "FLYWHEEL_TRAINER_RANK"
	envRendezvous = "FLYWHEEL_TRAINER_RENDEZVOUS"
	podIndexField = "metadata.labels['apps.kubernetes.io/pod-index']"
)

// flywheelLabel marks Flywheel's own services, whose probes must be HTTP GET /healthz.
const flywheelLabel, flywheelName = "app.kubernetes.io/name", "flywheel"

// secretName matches environment variable names that hold credentials.
var secretName = regexp.MustCompile(`(?i)(PASSWORD|SECRET|TOKEN|CREDENTIAL|ACCESS_KEY|PRIVATE_KEY|SASL_JAAS)`)

// devOnlySecret is the annotation a Secret object with inline data must carry: only the local
// overlay's development credentials may live in the repository.
const devOnlySecret = "flywheel.io/dev-only-secret"

type finding struct{ object, rule, message string }

// workload is a pod template and whether it runs for good (probes required) or to completion.
type workload struct {
	template    *corev1.PodTemplateSpec
	longRunning bool
}

func workloadOf(typed any) (workload, bool) {
	switch o := typed.(type) {
	case *appsv1.Deployment:
		return workload{&o.Spec.Template, true}, true
	case *appsv1.StatefulSet:
		return workload{&o.Spec.Template, true}, true
	case *appsv1.DaemonSet:
		return workload{&o.Spec.Template, true}, true
	case *batchv1.Job:
		return workload{&o.Spec.Template, false}, true
	case *batchv1.CronJob:
		return workload{&o.Spec.JobTemplate.Spec.Template, false}, true
	}
	return workload{}, false
}

// check decodes every object and returns every finding of every rule.
func check(objs []object) []finding {
	var out []finding
	for i := range objs {
		o := &objs[i]
		if err := decode(o); err != nil {
			out = append(out, finding{o.ref(), ruleDecode, err.Error()})
			continue
		}
		if w, ok := workloadOf(o.typed); ok {
			for _, f := range podRules(w) {
				out = append(out, finding{o.ref(), f.rule, f.message})
			}
		}
		if s, ok := o.typed.(*corev1.Secret); ok && (len(s.Data) > 0 || len(s.StringData) > 0) &&
			s.Annotations[devOnlySecret] != "true" {
			out = append(out, finding{o.ref(), ruleSecrets, fmt.Sprintf(
				"a Secret with inline data in the manifests; create it out of band (or annotate %s: \"true\" for local development credentials)", devOnlySecret)})
		}
		if so, ok := o.typed.(*strimziObject); ok {
			for _, msg := range strimziConfigRules(so) {
				out = append(out, finding{o.ref(), ruleStrimziCfg, msg})
			}
		}
		if cm, ok := o.typed.(*corev1.ConfigMap); ok {
			for key := range cm.Data {
				if secretName.MatchString(key) {
					out = append(out, finding{o.ref(), ruleSecrets, fmt.Sprintf("key %s looks like a credential; put it in a Secret", key)})
				}
			}
		}
	}
	out = append(out, rankRules(objs)...)
	out = append(out, aclRules(objs, policy)...)
	return append(out, coverage(objs)...)
}

// rankRules checks the trainer's ranks (docs/kubernetes.md, "Trainer ranks"):
//   - no ConfigMap sets FLYWHEEL_TRAINER_WORLD_SIZE or FLYWHEEL_TRAINER_RANK (they belong on the
//     StatefulSet, beside the replicas they must agree with);
//   - a workload running services.trainer with more than one replica sets FLYWHEEL_TRAINER_WORLD_SIZE
//     (without it, each pod would be a trainer of its own);
//
// and every StatefulSet whose containers set FLYWHEEL_TRAINER_WORLD_SIZE:
//   - the world size is an integer >= 1 and equals spec.replicas (default 1): one pod per rank;
//   - with a world size above 1, FLYWHEEL_TRAINER_RANK comes from the pod-index label (one rank per
//     pod, never a constant), and FLYWHEEL_TRAINER_RENDEZVOUS is host:port where host is pod 0 of
//     this StatefulSet under its own serviceName (<name>-0.<serviceName>, optionally followed by
//     .<namespace>, .svc and .cluster.local), serviceName is a headless Service of the build, and
//     the port is a container port of the pod.
func rankRules(objs []object) []finding {
	headless := map[string]bool{}
	for _, o := range objs {
		if svc, ok := o.typed.(*corev1.Service); ok && svc.Spec.ClusterIP == corev1.ClusterIPNone {
			headless[o.namespace+"/"+o.name] = true
		}
	}
	var out []finding
	for _, o := range objs {
		if cm, ok := o.typed.(*corev1.ConfigMap); ok {
			for _, key := range []string{envWorldSize, envRank} {
				if _, has := cm.Data[key]; has {
					out = append(out, finding{o.ref(), ruleRanks, fmt.Sprintf(
						"key %s: set it on the trainer's StatefulSet, where it must agree with replicas", key)})
				}
			}
		}
		if d, ok := o.typed.(*appsv1.Deployment); ok && d.Spec.Replicas != nil && *d.Spec.Replicas > 1 &&
			runsTrainer(d.Spec.Template.Spec) {
			out = append(out, finding{o.ref(), ruleRanks, fmt.Sprintf(
				"%d replicas of services.trainer in a Deployment: ranks need a StatefulSet (stable pod index)", *d.Spec.Replicas)})
		}
		sts, ok := o.typed.(*appsv1.StatefulSet)
		if !ok {
			continue
		}
		bad := func(format string, args ...any) {
			out = append(out, finding{o.ref(), ruleRanks, fmt.Sprintf(format, args...)})
		}
		for _, c := range sts.Spec.Template.Spec.Containers {
			env := map[string]corev1.EnvVar{}
			for _, e := range c.Env {
				env[e.Name] = e
			}
			ws, has := env[envWorldSize]
			if !has {
				if sts.Spec.Replicas != nil && *sts.Spec.Replicas > 1 && runsTrainer(sts.Spec.Template.Spec) {
					bad("container %q: %d replicas of services.trainer without %s: each pod would train alone",
						c.Name, *sts.Spec.Replicas, envWorldSize)
				}
				continue
			}
			world, err := strconv.Atoi(ws.Value)
			if err != nil || world < 1 {
				bad("container %q: %s must be an integer >= 1, got %q", c.Name, envWorldSize, ws.Value)
				continue
			}
			replicas := int32(1)
			if sts.Spec.Replicas != nil {
				replicas = *sts.Spec.Replicas
			}
			if int(replicas) != world {
				bad("container %q: replicas %d but %s %d; scale the StatefulSet and the world size together",
					c.Name, replicas, envWorldSize, world)
			}
			if world == 1 {
				continue
			}
			if r, has := env[envRank]; !has || r.ValueFrom == nil || r.ValueFrom.FieldRef == nil ||
				r.ValueFrom.FieldRef.FieldPath != podIndexField {
				bad("container %q: with world size %d, %s must come from fieldRef %s", c.Name, world, envRank, podIndexField)
			}
			rv, has := env[envRendezvous]
			if !has || rv.Value == "" {
				bad("container %q: with world size %d, %s must name rank 0 (%s-0.%s:PORT)", c.Name, world, envRendezvous,
					sts.Name, sts.Spec.ServiceName)
				continue
			}
			host, port, err := net.SplitHostPort(rv.Value)
			want := sts.Name + "-0." + sts.Spec.ServiceName
			if err != nil || !rendezvousHost(host, want, o.namespace) {
				bad("container %q: %s %q must be %s[.%s[.svc[.cluster.local]]]:PORT, pod 0 under the StatefulSet's own service",
					c.Name, envRendezvous, rv.Value, want, o.namespace)
				continue
			}
			if !headless[o.namespace+"/"+sts.Spec.ServiceName] {
				bad("serviceName %q is not a headless Service (clusterIP: None) of the build", sts.Spec.ServiceName)
			}
			if !containerPort(c, port) {
				bad("container %q: rendezvous port %s is not one of its container ports", c.Name, port)
			}
		}
	}
	return out
}

// rendezvousHost reports whether host is want, or want qualified by namespace (and .svc, .svc.cluster.local).
func rendezvousHost(host, want, namespace string) bool {
	if host == want {
		return true
	}
	rest, ok := strings.CutPrefix(host, want+".")
	if !ok {
		return false
	}
	rest = strings.TrimSuffix(rest, ".")
	return rest == namespace || rest == namespace+".svc" || rest == namespace+".svc.cluster.local"
}

// runsTrainer reports whether a pod runs the trainer service (`python -m services.trainer`).
func runsTrainer(spec corev1.PodSpec) bool {
	for _, c := range spec.Containers {
		for _, a := range append(append([]string{}, c.Command...), c.Args...) {
			if a == "services.trainer" || strings.Contains(a, "-m services.trainer") {
				return true
			}
		}
	}
	return false
}

func containerPort(c corev1.Container, port string) bool {
	for _, p := range c.Ports {
		if strconv.Itoa(int(p.ContainerPort)) == port {
			return true
		}
	}
	return false
}

func podRules(w workload) []finding {
	var out []finding
	bad := func(rule, format string, args ...any) {
		out = append(out, finding{"", rule, fmt.Sprintf(format, args...)})
	}
	spec := &w.template.Spec
	if spec.HostNetwork || spec.HostPID || spec.HostIPC {
		bad(ruleHost, "hostNetwork, hostPID and hostIPC must be false")
	}
	for _, v := range spec.Volumes {
		if v.HostPath != nil {
			bad(ruleHost, "volume %q is a hostPath volume", v.Name)
		}
	}
	podNonRoot := spec.SecurityContext != nil && spec.SecurityContext.RunAsNonRoot != nil && *spec.SecurityContext.RunAsNonRoot
	isFlywheel := w.template.Labels[flywheelLabel] == flywheelName
	all := append(append([]corev1.Container{}, spec.InitContainers...), spec.Containers...)
	for i, c := range all {
		where := fmt.Sprintf("container %q", c.Name)
		if i < len(spec.InitContainers) {
			where = fmt.Sprintf("init container %q", c.Name)
		} else if w.longRunning {
			probeRules(where, c, isFlywheel, bad)
		}
		resourceRules(where, c, bad)
		securityRules(where, c, podNonRoot, bad)
		for _, e := range c.Env {
			// A variable ending in _FILE names a path: the secret itself is a mounted Secret volume (the
			// references rule checks that it exists or is created out of band), so the path may be inline.
			if !secretName.MatchString(e.Name) || strings.HasSuffix(strings.ToUpper(e.Name), "_FILE") {
				continue
			}
			if e.Value != "" {
				bad(ruleSecrets, "%s: env %s has an inline value; use valueFrom.secretKeyRef", where, e.Name)
			} else if e.ValueFrom == nil || e.ValueFrom.SecretKeyRef == nil {
				bad(ruleSecrets, "%s: env %s must come from valueFrom.secretKeyRef", where, e.Name)
			}
		}
	}
	return out
}

func probeRules(where string, c corev1.Container, isFlywheel bool, bad func(string, string, ...any)) {
	for _, p := range []struct {
		name  string
		probe *corev1.Probe
	}{{"livenessProbe", c.LivenessProbe}, {"readinessProbe", c.ReadinessProbe}} {
		switch {
		case p.probe == nil:
			bad(ruleProbes, "%s has no %s", where, p.name)
		case isFlywheel && (p.probe.HTTPGet == nil || p.probe.HTTPGet.Path != "/healthz"):
			bad(ruleProbes, "%s: %s must be an HTTP GET of /healthz", where, p.name)
		}
	}
}

func resourceRules(where string, c corev1.Container, bad func(string, string, ...any)) {
	for _, name := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
		req, hasReq := c.Resources.Requests[name]
		lim, hasLim := c.Resources.Limits[name]
		if !hasReq || !hasLim {
			bad(ruleResources, "%s: %s request and limit must both be set", where, name)
			continue
		}
		if lim.Cmp(req) < 0 {
			bad(ruleResources, "%s: %s limit %s is below its request %s", where, name, lim.String(), req.String())
		}
	}
}

func securityRules(where string, c corev1.Container, podNonRoot bool, bad func(string, string, ...any)) {
	sc := c.SecurityContext
	if sc == nil {
		bad(ruleSecurity, "%s has no securityContext", where)
		return
	}
	nonRoot := podNonRoot
	if sc.RunAsNonRoot != nil {
		nonRoot = *sc.RunAsNonRoot
	}
	if !nonRoot {
		bad(ruleSecurity, "%s: runAsNonRoot must be true (pod or container)", where)
	}
	if sc.RunAsUser != nil && *sc.RunAsUser == 0 {
		bad(ruleSecurity, "%s: runAsUser 0 is root", where)
	}
	if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		bad(ruleSecurity, "%s: readOnlyRootFilesystem must be true (mount an emptyDir where it writes)", where)
	}
	if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
		bad(ruleSecurity, "%s: allowPrivilegeEscalation must be false", where)
	}
	if sc.Privileged != nil && *sc.Privileged {
		bad(ruleSecurity, "%s: privileged must not be true", where)
	}
}
