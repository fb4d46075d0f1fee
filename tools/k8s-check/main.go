// k8s-check builds kustomize overlays in-process and checks every object they produce.
//
//	k8s-check [-dump] [-acl-policy FILE] OVERLAY_DIR...
//
// For each directory it runs kustomize's own build (sigs.k8s.io/kustomize/api/krusty, the code
// behind `kubectl apply -k`; no kubectl or kustomize binary is needed), then:
//
//  1. decodes every object strictly into its k8s.io/api type (unknown fields, duplicate fields and
//     kinds the checker has no type for are errors); Strimzi resources, which k8s.io/api does not
//     have, are validated against Strimzi's own CRD schemas, vendored in crds/ at a pinned release,
//     unknown fields refused as well (strimzi.go; rule "strict-decode");
//  2. applies Flywheel's own rules to every pod template (rules.go) and checks that every workload
//     is covered by a PodDisruptionBudget and a NetworkPolicy, that every HorizontalPodAutoscaler
//     targets a workload of the build and every Service selects one (coverage.go);
//  3. checks every KafkaUser's ACLs against what shared/acl.py grants its role, from the policy
//     file given with -acl-policy (`python -m shared.k8s_acl policy` writes it; acl.go): an ACL
//     the role is not granted there, a user that is no role, or a role made a super user is refused.
//
// Exit status: 0 when every overlay passes (one "ok" line each on stdout); 1 when any overlay has a
// finding, one line per finding on stderr: "k8s-check: OVERLAY: KIND/NAME: [RULE] message";
// 2 on bad usage. With -dump, each overlay that passes also prints its objects, one JSON document
// a line, after its "ok" line (for tests and for reading what an overlay deploys).
package main

import (
	"flag"
	"fmt"
	"os"
	"sort"
)

func main() {
	dump := flag.Bool("dump", false, "print every object of each passing overlay as one JSON line")
	policyFile := flag.String("acl-policy", "", "what shared/acl.py grants each role (python -m shared.k8s_acl policy)")
	flag.Usage = func() { fmt.Fprintln(os.Stderr, "usage: k8s-check [-dump] [-acl-policy FILE] OVERLAY_DIR...") }
	flag.Parse()
	if flag.NArg() == 0 {
		flag.Usage()
		os.Exit(2)
	}
	if *policyFile != "" {
		p, err := loadACLPolicy(*policyFile)
		if err != nil {
			fmt.Fprintf(os.Stderr, "k8s-check: -acl-policy: %v\n", err)
			os.Exit(2)
		}
		policy = p
	}
	failed := false
	for _, dir := range flag.Args() {
		objs, err := build(dir)
		if err != nil {
			fmt.Fprintf(os.Stderr, "k8s-check: %s: [kustomize-build] %v\n", dir, err)
			failed = true
			continue
		}
		findings := check(objs)
		sort.SliceStable(findings, func(i, j int) bool { return findings[i].object < findings[j].object })
		for _, f := range findings {
			fmt.Fprintf(os.Stderr, "k8s-check: %s: %s: [%s] %s\n", dir, f.object, f.rule, f.message)
		}
		if len(findings) > 0 {
			failed = true
			continue
		}
		fmt.Printf("ok  %s: %d objects\n", dir, len(objs))
		if *dump {
			for _, o := range objs {
				fmt.Printf("%s\n", o.raw)
			}
		}
	}
	if failed {
		os.Exit(1)
	}
}
