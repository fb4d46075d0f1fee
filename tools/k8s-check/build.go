package main

import (
	"fmt"

	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

// object is one resource of a build: its raw JSON, as kustomize emitted it, and, once decoded,
// the typed value (a k8s.io/api struct, or a *strimziObject valid against Strimzi's CRD). typed is nil when decoding failed.
type object struct {
	kind, namespace, name string
	raw                   []byte
	typed                 any
}

// ref names an object in findings: Kind/name, or Kind/namespace/name when it has a namespace.
func (o object) ref() string {
	if o.namespace == "" {
		return o.kind + "/" + o.name
	}
	return o.kind + "/" + o.namespace + "/" + o.name
}

// build runs kustomize on dir with its default options (load restrictions: files only from
// inside the kustomization's root) and returns every resource it produces, not yet decoded.
func build(dir string) ([]object, error) {
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	m, err := k.Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		return nil, err
	}
	var out []object
	for _, r := range m.Resources() {
		raw, err := r.MarshalJSON()
		if err != nil {
			return nil, fmt.Errorf("%s/%s: %w", r.GetKind(), r.GetName(), err)
		}
		out = append(out, object{kind: r.GetKind(), namespace: r.GetNamespace(), name: r.GetName(), raw: raw})
	}
	return out, nil
}

// decode sets o.typed, strictly: an unknown or duplicated field, a kind without a Go type here, or
// a Strimzi object its CRD schema refuses, is an error.
func decode(o *object) error {
	if typed, ok, err := decodeStrimzi(o.raw); ok {
		if err != nil {
			return err
		}
		o.typed = typed
		return nil
	}
	typed, _, err := kubeCodec.Decode(o.raw, nil, nil)
	if err != nil {
		if runtime.IsNotRegisteredError(err) {
			return fmt.Errorf("no k8s.io/api type for this kind (the checker knows core, apps, batch, policy, networking, autoscaling and rbac): %w", err)
		}
		return err
	}
	o.typed = typed
	return nil
}
