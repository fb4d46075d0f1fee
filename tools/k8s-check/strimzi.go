package main

// Strimzi's custom resources (kafka.strimzi.io/v1beta2) are not in k8s.io/api. The structs below
// hold the fields Flywheel's overlays use, typed and named after Strimzi's API reference
// (https://strimzi.io/docs/operators/latest/configuring.html, "Schema properties"); decoding is
// strict, so a misspelt or unsupported field is refused. They are a subset written from the
// documentation, not generated from Strimzi's CRD OpenAPI schema: a field Strimzi accepts but the
// structs lack is refused too (add it here, from the reference, when an overlay needs it).

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	sigsjson "sigs.k8s.io/json"
)

const strimziAPIVersion = "kafka.strimzi.io/v1beta2"

// Kafka is a Strimzi-managed Kafka cluster (KRaft, brokers and controllers from KafkaNodePools).
type Kafka struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Kafka struct {
			Version         string          `json:"version,omitempty"`
			MetadataVersion string          `json:"metadataVersion,omitempty"`
			Listeners       []KafkaListener `json:"listeners"`
			Authorization   *struct {
				Type       string   `json:"type"`
				SuperUsers []string `json:"superUsers,omitempty"`
			} `json:"authorization,omitempty"`
			Config map[string]json.RawMessage `json:"config,omitempty"`
		} `json:"kafka"`
		EntityOperator *struct {
			TopicOperator *struct {
				Resources *corev1.ResourceRequirements `json:"resources,omitempty"`
			} `json:"topicOperator,omitempty"`
			UserOperator *struct {
				Resources *corev1.ResourceRequirements `json:"resources,omitempty"`
			} `json:"userOperator,omitempty"`
		} `json:"entityOperator,omitempty"`
	} `json:"spec"`
}

// KafkaListener is one entry of Kafka.spec.kafka.listeners.
type KafkaListener struct {
	Name           string `json:"name"`
	Port           int    `json:"port"`
	Type           string `json:"type"`
	TLS            bool   `json:"tls"`
	Authentication *struct {
		Type string `json:"type"`
	} `json:"authentication,omitempty"`
}

// KafkaNodePool is a group of Kafka nodes with the same roles and storage.
type KafkaNodePool struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Replicas  int                          `json:"replicas"`
		Roles     []string                     `json:"roles"`
		Storage   KafkaStorage                 `json:"storage"`
		Resources *corev1.ResourceRequirements `json:"resources,omitempty"`
	} `json:"spec"`
}

// KafkaStorage is ephemeral, persistent-claim, or jbod of volumes.
type KafkaStorage struct {
	Type          string         `json:"type"`
	ID            *int           `json:"id,omitempty"`
	Size          string         `json:"size,omitempty"`
	Class         string         `json:"class,omitempty"`
	DeleteClaim   *bool          `json:"deleteClaim,omitempty"`
	KRaftMetadata string         `json:"kraftMetadata,omitempty"`
	Volumes       []KafkaStorage `json:"volumes,omitempty"`
}

// KafkaTopic is a topic managed by the topic operator.
type KafkaTopic struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		TopicName  string            `json:"topicName,omitempty"`
		Partitions int               `json:"partitions"`
		Replicas   int               `json:"replicas"`
		Config     map[string]string `json:"config,omitempty"`
	} `json:"spec"`
}

// KafkaUser is a client identity (the user operator writes its credentials into a Secret of the
// same name) with simple-authorizer ACLs.
type KafkaUser struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Authentication struct {
			Type string `json:"type"`
		} `json:"authentication"`
		Authorization *struct {
			Type string     `json:"type"`
			ACLs []KafkaACL `json:"acls"`
		} `json:"authorization,omitempty"`
	} `json:"spec"`
}

// KafkaACL is one ACL rule of a KafkaUser.
type KafkaACL struct {
	Resource struct {
		Type        string `json:"type"`
		Name        string `json:"name,omitempty"`
		PatternType string `json:"patternType,omitempty"`
	} `json:"resource"`
	Operations []string `json:"operations"`
	Host       string   `json:"host,omitempty"`
	Type       string   `json:"type,omitempty"`
}

// Allowed values, from Strimzi's API reference.
var (
	listenerTypes     = set("internal", "route", "loadbalancer", "nodeport", "ingress", "cluster-ip")
	listenerAuthTypes = set("tls", "scram-sha-512", "oauth", "custom")
	authorizerTypes   = set("simple", "opa", "keycloak", "custom")
	nodeRoles         = set("controller", "broker")
	storageTypes      = set("ephemeral", "persistent-claim", "jbod")
	userAuthTypes     = set("tls", "tls-external", "scram-sha-512")
	aclResourceTypes  = set("topic", "group", "cluster", "transactionalId")
	aclPatternTypes   = set("", "literal", "prefix")
	aclTypes          = set("", "allow", "deny")
	aclOperations     = set("Read", "Write", "Create", "Delete", "Alter", "Describe", "ClusterAction",
		"AlterConfigs", "DescribeConfigs", "IdempotentWrite", "All")
	listenerName = regexp.MustCompile(`^[a-z0-9]{1,11}$`)
	// Kafka options that Strimzi sets itself and refuses in spec.kafka.config.
	forbiddenConfigPrefixes = []string{"listeners", "advertised.", "broker.", "listener.", "host.name",
		"port", "inter.broker.listener.name", "sasl.", "ssl.", "security.", "password.", "log.dir",
		"zookeeper.", "authorizer.", "super.user", "node.id", "process.roles", "controller.",
		"metadata.log.dir"}
)

func set(values ...string) map[string]bool {
	m := map[string]bool{}
	for _, v := range values {
		m[v] = true
	}
	return m
}

// decodeStrimzi decodes raw when it is a kafka.strimzi.io object (ok=true), strictly, and checks
// the enumerations and constraints of the fields above.
func decodeStrimzi(raw []byte) (typed any, ok bool, err error) {
	var tm metav1.TypeMeta
	if err := json.Unmarshal(raw, &tm); err != nil || !strings.HasPrefix(tm.APIVersion, "kafka.strimzi.io/") {
		return nil, false, nil
	}
	if tm.APIVersion != strimziAPIVersion {
		return nil, true, fmt.Errorf("apiVersion %q: the checker knows %s only", tm.APIVersion, strimziAPIVersion)
	}
	switch tm.Kind {
	case "Kafka":
		typed = &Kafka{}
	case "KafkaNodePool":
		typed = &KafkaNodePool{}
	case "KafkaTopic":
		typed = &KafkaTopic{}
	case "KafkaUser":
		typed = &KafkaUser{}
	default:
		return nil, true, fmt.Errorf("no Strimzi type for kind %q in the checker", tm.Kind)
	}
	strict, err := sigsjson.UnmarshalStrict(raw, typed)
	if err != nil {
		return nil, true, err
	}
	if len(strict) > 0 {
		return nil, true, fmt.Errorf("strict decoding error: %v", strict)
	}
	return typed, true, validateStrimzi(typed)
}

func validateStrimzi(typed any) error {
	var problems []string
	bad := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }
	switch o := typed.(type) {
	case *Kafka:
		if len(o.Spec.Kafka.Listeners) == 0 {
			bad("spec.kafka.listeners: at least one listener is required")
		}
		for i, l := range o.Spec.Kafka.Listeners {
			if !listenerName.MatchString(l.Name) {
				bad("spec.kafka.listeners[%d].name %q: lower-case letters and digits, at most 11", i, l.Name)
			}
			if l.Port < 9092 || l.Port == 9404 || l.Port == 9999 {
				bad("spec.kafka.listeners[%d].port %d: 9092 or above, not 9404 or 9999", i, l.Port)
			}
			if !listenerTypes[l.Type] {
				bad("spec.kafka.listeners[%d].type %q: not a Strimzi listener type", i, l.Type)
			}
			if l.Authentication != nil && !listenerAuthTypes[l.Authentication.Type] {
				bad("spec.kafka.listeners[%d].authentication.type %q: not a Strimzi listener authentication", i, l.Authentication.Type)
			}
		}
		if a := o.Spec.Kafka.Authorization; a != nil && !authorizerTypes[a.Type] {
			bad("spec.kafka.authorization.type %q: not a Strimzi authorization type", a.Type)
		}
		for key := range o.Spec.Kafka.Config {
			for _, p := range forbiddenConfigPrefixes {
				if strings.HasPrefix(key, p) {
					bad("spec.kafka.config[%q]: Strimzi manages this option itself", key)
				}
			}
		}
	case *KafkaNodePool:
		if o.Spec.Replicas < 1 {
			bad("spec.replicas %d: at least 1", o.Spec.Replicas)
		}
		if len(o.Spec.Roles) == 0 {
			bad("spec.roles: at least one of controller, broker")
		}
		for _, r := range o.Spec.Roles {
			if !nodeRoles[r] {
				bad("spec.roles: %q is not controller or broker", r)
			}
		}
		validateStorage("spec.storage", o.Spec.Storage, bad)
	case *KafkaTopic:
		if o.Spec.Partitions < 1 || o.Spec.Replicas < 1 {
			bad("spec.partitions and spec.replicas: at least 1 (got %d, %d)", o.Spec.Partitions, o.Spec.Replicas)
		}
	case *KafkaUser:
		if !userAuthTypes[o.Spec.Authentication.Type] {
			bad("spec.authentication.type %q: not a Strimzi user authentication", o.Spec.Authentication.Type)
		}
		if a := o.Spec.Authorization; a != nil {
			if a.Type != "simple" {
				bad("spec.authorization.type %q: KafkaUser ACLs need type simple", a.Type)
			}
			for i, acl := range a.ACLs {
				if !aclResourceTypes[acl.Resource.Type] || !aclPatternTypes[acl.Resource.PatternType] || !aclTypes[acl.Type] {
					bad("spec.authorization.acls[%d]: resource type %q, patternType %q, type %q", i,
						acl.Resource.Type, acl.Resource.PatternType, acl.Type)
				}
				if acl.Resource.Type != "cluster" && acl.Resource.Name == "" {
					bad("spec.authorization.acls[%d].resource.name: required for %s", i, acl.Resource.Type)
				}
				if len(acl.Operations) == 0 {
					bad("spec.authorization.acls[%d].operations: at least one", i)
				}
				for _, op := range acl.Operations {
					if !aclOperations[op] {
						bad("spec.authorization.acls[%d].operations: %q is not a Kafka ACL operation", i, op)
					}
				}
			}
		}
	}
	if len(problems) > 0 {
		return fmt.Errorf("%s", strings.Join(problems, "; "))
	}
	return nil
}

func validateStorage(path string, s KafkaStorage, bad func(string, ...any)) {
	if !storageTypes[s.Type] {
		bad("%s.type %q: ephemeral, persistent-claim or jbod", path, s.Type)
	}
	if s.Type == "persistent-claim" && s.Size == "" {
		bad("%s.size: required for persistent-claim", path)
	}
	if s.Type == "jbod" {
		if len(s.Volumes) == 0 {
			bad("%s.volumes: jbod needs at least one volume", path)
		}
		for i, v := range s.Volumes {
			if v.Type == "jbod" {
				bad("%s.volumes[%d]: jbod cannot nest", path, i)
			}
			validateStorage(fmt.Sprintf("%s.volumes[%d]", path, i), v, bad)
		}
	}
}
