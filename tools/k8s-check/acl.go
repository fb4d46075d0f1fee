package main

// Rule "acl-policy": no KafkaUser of a build may be granted more than shared/acl.py grants its role
// (docs/security.md, "Kafka ACLs per role"). The policy is written from shared/acl.py by
// `python -m shared.k8s_acl policy` on every `make k8s-check` (never a committed copy) and given
// with -acl-policy; its resource names carry a placeholder for the run, which each KafkaUser names
// in its annotation flywheel.io/run.

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strings"
)

const (
	ruleACL       = "acl-policy"
	runAnnotation = "flywheel.io/run"
)

// aclPolicy is what shared/acl.py allows each role, for any run.
type aclPolicy struct {
	Source      string                `json:"source"`
	Placeholder string                `json:"run_placeholder"`
	UserPrefix  string                `json:"user_prefix"`
	Roles       map[string][]aclGrant `json:"roles"`
}

// aclGrant is one allowed (resource, pattern, name, operation), in Strimzi's terms.
type aclGrant struct {
	Resource    string `json:"resource"`
	PatternType string `json:"patternType"`
	Name        string `json:"name"`
	Operation   string `json:"operation"`
}

func (g aclGrant) String() string {
	return fmt.Sprintf("%s %s %q (%s)", g.Operation, g.Resource, g.Name, g.PatternType)
}

// policy is the -acl-policy file, or nil when none was given.
var policy *aclPolicy

func loadACLPolicy(file string) (*aclPolicy, error) {
	raw, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	p := &aclPolicy{}
	dec := json.NewDecoder(strings.NewReader(string(raw)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(p); err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	if p.Placeholder == "" || p.UserPrefix == "" || len(p.Roles) == 0 {
		return nil, fmt.Errorf("%s: run_placeholder, user_prefix and roles are required", file)
	}
	return p, nil
}

func (p *aclPolicy) roleNames() string {
	var names []string
	for r := range p.Roles {
		names = append(names, p.UserPrefix+r)
	}
	sort.Strings(names)
	return strings.Join(names, ", ")
}

// aclRules checks every KafkaUser's ACLs, and every Kafka's super users, against the policy.
func aclRules(objs []object, p *aclPolicy) []finding {
	var out []finding
	for _, o := range objs {
		s, ok := o.typed.(*strimziObject)
		if !ok {
			continue
		}
		bad := func(format string, args ...any) {
			out = append(out, finding{o.ref(), ruleACL, fmt.Sprintf(format, args...)})
		}
		if s.Kind == "Kafka" && p != nil {
			auth := nested(s.Object, "spec", "kafka", "authorization")
			supers, _ := auth["superUsers"].([]any)
			for _, su := range supers {
				name, _ := su.(string)
				bare := strings.TrimPrefix(strings.TrimPrefix(name, "User:"), "CN=")
				if role, isRole := strings.CutPrefix(bare, p.UserPrefix); isRole && p.Roles[role] != nil {
					bad("spec.kafka.authorization.superUsers: %q makes role %s a super user (every ACL bypassed); %s grants it only its ACLs",
						name, role, p.Source)
				}
			}
		}
		if s.Kind != "KafkaUser" {
			continue
		}
		acls, _ := nested(s.Object, "spec", "authorization")["acls"].([]any)
		if p == nil {
			if len(acls) > 0 {
				bad("has ACLs but no -acl-policy was given (make k8s-check writes it from shared/acl.py)")
			}
			continue
		}
		role, isRole := strings.CutPrefix(s.Name, p.UserPrefix)
		if !isRole || p.Roles[role] == nil {
			bad("KafkaUser %q is not a role of %s (the users are %s)", s.Name, p.Source, p.roleNames())
			continue
		}
		run := s.Annotations[runAnnotation]
		if run == "" {
			bad("no annotation %s: the run whose topics and groups role %s may use", runAnnotation, role)
			continue
		}
		allowed := map[aclGrant]bool{}
		for _, g := range p.Roles[role] {
			g.Name = strings.ReplaceAll(g.Name, p.Placeholder, run)
			allowed[g] = true
		}
		for i, a := range acls {
			acl, _ := a.(map[string]any)
			if t, _ := acl["type"].(string); t == "deny" {
				continue // a deny only narrows
			}
			resource, _ := acl["resource"].(map[string]any)
			g := aclGrant{PatternType: "literal"}
			g.Resource, _ = resource["type"].(string)
			g.Name, _ = resource["name"].(string)
			if pt, has := resource["patternType"].(string); has {
				g.PatternType = pt
			}
			ops, _ := acl["operations"].([]any)
			for _, op := range ops {
				g.Operation, _ = op.(string)
				if !allowed[g] {
					bad("spec.authorization.acls[%d]: role %s (run %s) may %s, which %s does not grant it",
						i, role, run, g, p.Source)
				}
			}
		}
	}
	return out
}
