package main

// Strimzi's custom resources (kafka.strimzi.io) are not in k8s.io/api. They are validated against
// Strimzi's own published CRDs, vendored unchanged in crds/ from the operator repository at a
// pinned release (crds/README.md names the commit and each file's hash), the way the API server
// validates a custom resource:
//
//   - the object against the served version's openAPIV3Schema, with kube-openapi's validator (the
//     one the API server's CRD validation is built on): types, enumerations, required fields,
//     minimums and patterns;
//   - unknown fields refused (kubectl's strict field validation): a field that the schema does not
//     declare, where the schema neither allows additionalProperties nor sets
//     x-kubernetes-preserve-unknown-fields;
//   - metadata decoded strictly into ObjectMeta, its name a DNS-1123 subdomain.
//
// Not evaluated: the CRDs' CEL rules (x-kubernetes-validations; the four CRDs have six, none about
// a field the overlays set), and what only the operator checks when it reconciles. One such check
// is kept as a rule of its own: the Kafka options Strimzi sets itself and refuses in
// spec.kafka.config (rule "strimzi-config", from Strimzi's documentation).

import (
	"embed"
	"encoding/json"
	"fmt"
	"path"
	"sort"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/kube-openapi/pkg/validation/spec"
	"k8s.io/kube-openapi/pkg/validation/strfmt"
	"k8s.io/kube-openapi/pkg/validation/validate"
	sigsjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

const (
	strimziGroup     = "kafka.strimzi.io"
	ruleStrimziCfg   = "strimzi-config"
	preserveUnknown  = "x-kubernetes-preserve-unknown-fields"
	embeddedResource = "x-kubernetes-embedded-resource"
)

//go:embed crds/*.yaml
var crdFiles embed.FS

// strimziObject is a decoded Strimzi resource: its metadata (typed) and the whole object as
// generic JSON, already valid against its CRD's schema.
type strimziObject struct {
	Kind string
	metav1.ObjectMeta
	Object map[string]any
}

// crdSchemas maps "apiVersion/kind" (kafka.strimzi.io/v1/KafkaUser) to the served version's schema.
var crdSchemas = func() map[string]*spec.Schema {
	out := map[string]*spec.Schema{}
	entries, err := crdFiles.ReadDir("crds")
	if err != nil {
		panic(err)
	}
	for _, e := range entries {
		if path.Ext(e.Name()) != ".yaml" {
			continue
		}
		raw, err := crdFiles.ReadFile("crds/" + e.Name())
		if err != nil {
			panic(err)
		}
		var crd struct {
			Spec struct {
				Group string `json:"group"`
				Names struct {
					Kind string `json:"kind"`
				} `json:"names"`
				Versions []struct {
					Name   string `json:"name"`
					Served bool   `json:"served"`
					Schema struct {
						OpenAPIV3Schema json.RawMessage `json:"openAPIV3Schema"`
					} `json:"schema"`
				} `json:"versions"`
			} `json:"spec"`
		}
		if err := yaml.Unmarshal(raw, &crd); err != nil {
			panic(fmt.Sprintf("crds/%s: %v", e.Name(), err))
		}
		for _, v := range crd.Spec.Versions {
			if !v.Served {
				continue
			}
			s := &spec.Schema{}
			if err := json.Unmarshal(v.Schema.OpenAPIV3Schema, s); err != nil {
				panic(fmt.Sprintf("crds/%s %s: %v", e.Name(), v.Name, err))
			}
			out[crd.Spec.Group+"/"+v.Name+"/"+crd.Spec.Names.Kind] = s
		}
	}
	return out
}()

// servedStrimzi lists the apiVersion/kind pairs the vendored CRDs serve, for messages.
func servedStrimzi() string {
	var keys []string
	for k := range crdSchemas {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return strings.Join(keys, ", ")
}

// decodeStrimzi validates raw when it is a kafka.strimzi.io object (ok=true) against its CRD.
func decodeStrimzi(raw []byte) (typed any, ok bool, err error) {
	var tm metav1.TypeMeta
	if err := json.Unmarshal(raw, &tm); err != nil || !strings.HasPrefix(tm.APIVersion, strimziGroup+"/") {
		return nil, false, nil
	}
	schema := crdSchemas[tm.APIVersion+"/"+tm.Kind]
	if schema == nil {
		return nil, true, fmt.Errorf("%s %s is not served by the vendored Strimzi CRDs (tools/k8s-check/crds: %s)",
			tm.APIVersion, tm.Kind, servedStrimzi())
	}
	var obj map[string]any
	if err := json.Unmarshal(raw, &obj); err != nil {
		return nil, true, err
	}
	var problems []string
	var meta metav1.ObjectMeta
	if m, has := obj["metadata"]; has {
		metaRaw, _ := json.Marshal(m)
		strict, err := sigsjson.UnmarshalStrict(metaRaw, &meta)
		if err != nil {
			problems = append(problems, "metadata: "+err.Error())
		}
		for _, e := range strict {
			problems = append(problems, "metadata: "+e.Error())
		}
	}
	for _, msg := range validation.IsDNS1123Subdomain(meta.Name) {
		problems = append(problems, fmt.Sprintf("metadata.name %q: %s", meta.Name, msg))
	}
	result := validate.NewSchemaValidator(schema, nil, "", strfmt.Default).Validate(obj)
	for _, e := range result.Errors {
		problems = append(problems, e.Error())
	}
	rest := map[string]any{}
	for k, v := range obj {
		if k != "metadata" && k != "apiVersion" && k != "kind" {
			rest[k] = v
		}
	}
	walkSchema("", rest, schema, &problems) // unknown fields, as the API server's strict field validation
	if len(problems) > 0 {
		sort.Strings(problems)
		return nil, true, fmt.Errorf("%s (schema: Strimzi's CRD for %s %s)", strings.Join(problems, "; "), tm.APIVersion, tm.Kind)
	}
	return &strimziObject{Kind: tm.Kind, ObjectMeta: meta, Object: obj}, true, nil
}

// walkSchema reports every field of value (at path at) that schema s does not declare, where s
// neither allows additionalProperties nor preserves unknown fields.
func walkSchema(at string, value any, s *spec.Schema, problems *[]string) {
	if b, _ := s.Extensions[preserveUnknown].(bool); b {
		return
	}
	if b, _ := s.Extensions[embeddedResource].(bool); b {
		return
	}
	switch v := value.(type) {
	case map[string]any:
		for k, child := range v {
			childAt := k
			if at != "" {
				childAt = at + "." + k
			}
			if p, has := s.Properties[k]; has {
				walkSchema(childAt, child, &p, problems)
				continue
			}
			switch {
			case s.AdditionalProperties != nil && s.AdditionalProperties.Schema != nil:
				walkSchema(childAt, child, s.AdditionalProperties.Schema, problems)
			case s.AdditionalProperties != nil && s.AdditionalProperties.Allows:
			case len(s.Properties) == 0 && !s.Type.Contains("object"):
				// not an object in the schema: the type check reports it
			default:
				*problems = append(*problems, fmt.Sprintf("unknown field %q", childAt))
			}
		}
	case []any:
		if s.Items == nil || s.Items.Schema == nil {
			return
		}
		for i, item := range v {
			walkSchema(fmt.Sprintf("%s[%d]", at, i), item, s.Items.Schema, problems)
		}
	}
}

// Kafka options that Strimzi sets itself and refuses in spec.kafka.config (Strimzi's documentation,
// "Kafka broker configuration"; not in the CRD schema, which lets the field hold any map).
var forbiddenConfigPrefixes = []string{"listeners", "advertised.", "broker.", "listener.", "host.name",
	"port", "inter.broker.listener.name", "sasl.", "ssl.", "security.", "password.", "log.dir",
	"zookeeper.", "authorizer.", "super.user", "node.id", "process.roles", "controller.",
	"metadata.log.dir"}

// strimziConfigRules returns the spec.kafka.config keys of a Kafka that Strimzi manages itself.
func strimziConfigRules(o *strimziObject) []string {
	if o.Kind != "Kafka" {
		return nil
	}
	var out []string
	for key := range nested(o.Object, "spec", "kafka", "config") {
		for _, p := range forbiddenConfigPrefixes {
			if strings.HasPrefix(key, p) {
				out = append(out, fmt.Sprintf("spec.kafka.config[%q]: Strimzi manages this option itself", key))
				break
			}
		}
	}
	sort.Strings(out)
	return out
}

// nested returns the object at keys under m, or nil.
func nested(m map[string]any, keys ...string) map[string]any {
	for _, k := range keys {
		next, ok := m[k].(map[string]any)
		if !ok {
			return nil
		}
		m = next
	}
	return m
}
