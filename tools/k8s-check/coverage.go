package main

import (
	"fmt"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
)

// coverage checks relations between the objects of one build:
//   - every Deployment and StatefulSet has a PodDisruptionBudget and a NetworkPolicy selecting its pods;
//   - every HorizontalPodAutoscaler targets a Deployment or StatefulSet of the build;
//   - every Service with a selector selects the pods of some workload of the build;
//   - every ConfigMap a pod template reads exists in the build;
//   - every KafkaTopic, KafkaUser and KafkaNodePool names (label strimzi.io/cluster) a Kafka of the build.
func coverage(objs []object) []finding {
	type pods struct {
		ref, kind, namespace, name string
		labels                     labels.Set
		spec                       *corev1.PodSpec
	}
	var workloads []pods
	var pdbs, netpols []struct {
		namespace string
		selector  labels.Selector
	}
	configMaps := map[string]bool{}
	// Objects that did not decode are reported once (strict-decode), not again as missing targets.
	present := map[string]bool{}
	undecodedWorkloads := map[string]bool{}
	for _, o := range objs {
		present[o.namespace+"/"+o.kind+"/"+o.name] = true
		if o.typed == nil && (o.kind == "Deployment" || o.kind == "StatefulSet") {
			undecodedWorkloads[o.namespace] = true
		}
	}
	var out []finding
	selectorOf := func(o object, s *metav1.LabelSelector) labels.Selector {
		sel, err := metav1.LabelSelectorAsSelector(s)
		if err != nil {
			out = append(out, finding{o.ref(), ruleRefs, err.Error()})
			return labels.Nothing()
		}
		return sel
	}
	for _, o := range objs {
		switch t := o.typed.(type) {
		case *appsv1.Deployment, *appsv1.StatefulSet:
			w, _ := workloadOf(t)
			workloads = append(workloads, pods{o.ref(), o.kind, o.namespace, o.name, w.template.Labels, &w.template.Spec})
		case *policyv1.PodDisruptionBudget:
			pdbs = append(pdbs, struct {
				namespace string
				selector  labels.Selector
			}{o.namespace, selectorOf(o, t.Spec.Selector)})
		case *networkingv1.NetworkPolicy:
			netpols = append(netpols, struct {
				namespace string
				selector  labels.Selector
			}{o.namespace, selectorOf(o, &t.Spec.PodSelector)})
		case *corev1.ConfigMap:
			configMaps[o.namespace+"/"+o.name] = true
		}
	}
	for _, w := range workloads {
		for _, c := range []struct {
			rule     string
			policies []struct {
				namespace string
				selector  labels.Selector
			}
		}{{rulePDB, pdbs}, {ruleNetpol, netpols}} {
			covered := false
			for _, p := range c.policies {
				covered = covered || (p.namespace == w.namespace && p.selector.Matches(w.labels))
			}
			if !covered {
				out = append(out, finding{w.ref, c.rule, fmt.Sprintf("no %s selects the pods of this workload", map[string]string{
					rulePDB: "PodDisruptionBudget", ruleNetpol: "NetworkPolicy"}[c.rule])})
			}
		}
		for _, name := range configMapsRead(w.spec) {
			if !configMaps[w.namespace+"/"+name] {
				out = append(out, finding{w.ref, ruleRefs, fmt.Sprintf("reads ConfigMap %q, which the build does not contain", name)})
			}
		}
	}
	for _, o := range objs {
		switch t := o.typed.(type) {
		case *autoscalingv2.HorizontalPodAutoscaler:
			ref := t.Spec.ScaleTargetRef
			if (ref.Kind != "Deployment" && ref.Kind != "StatefulSet") || !present[o.namespace+"/"+ref.Kind+"/"+ref.Name] {
				out = append(out, finding{o.ref(), ruleRefs, fmt.Sprintf("scaleTargetRef %s/%s is not a workload of the build", ref.Kind, ref.Name)})
			}
		case *corev1.Service:
			if len(t.Spec.Selector) == 0 || undecodedWorkloads[o.namespace] {
				continue
			}
			sel := labels.SelectorFromSet(t.Spec.Selector)
			found := false
			for _, w := range workloads {
				found = found || (w.namespace == o.namespace && sel.Matches(w.labels))
			}
			if !found {
				out = append(out, finding{o.ref(), ruleRefs, fmt.Sprintf("selector %s matches no workload of the build", sel)})
			}
		case *strimziObject:
			if t.Kind == "Kafka" {
				continue
			}
			cluster := t.Labels["strimzi.io/cluster"]
			if !present[o.namespace+"/Kafka/"+cluster] {
				out = append(out, finding{o.ref(), ruleRefs, fmt.Sprintf("label strimzi.io/cluster=%q names no Kafka of the build", cluster)})
			}
		}
	}
	return out
}

// configMapsRead lists the ConfigMaps a pod spec reads through envFrom, env and volumes.
func configMapsRead(spec *corev1.PodSpec) []string {
	var names []string
	for _, c := range append(append([]corev1.Container{}, spec.InitContainers...), spec.Containers...) {
		for _, e := range c.EnvFrom {
			if e.ConfigMapRef != nil && (e.ConfigMapRef.Optional == nil || !*e.ConfigMapRef.Optional) {
				names = append(names, e.ConfigMapRef.Name)
			}
		}
		for _, e := range c.Env {
			if e.ValueFrom != nil && e.ValueFrom.ConfigMapKeyRef != nil {
				names = append(names, e.ValueFrom.ConfigMapKeyRef.Name)
			}
		}
	}
	for _, v := range spec.Volumes {
		if v.ConfigMap != nil {
			names = append(names, v.ConfigMap.Name)
		}
	}
	return names
}
