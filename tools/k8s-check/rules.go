package main

import (
	"fmt"
	"regexp"

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
		if cm, ok := o.typed.(*corev1.ConfigMap); ok {
			for key := range cm.Data {
				if secretName.MatchString(key) {
					out = append(out, finding{o.ref(), ruleSecrets, fmt.Sprintf("key %s looks like a credential; put it in a Secret", key)})
				}
			}
		}
	}
	return append(out, coverage(objs)...)
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
			if !secretName.MatchString(e.Name) {
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
