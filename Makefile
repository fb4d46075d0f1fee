# Flywheel. `make up` runs the whole system; `make test` runs the tests. Both install what they need.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
SAMPLERS ?= 2
# Kafka nodes: 1, or 3 for a replicated KRaft cluster (RF 3, min.insync.replicas 2; docs/local-stack.md). Docker:
# the compose `cluster` profile, which COMPOSE_CLUSTER turns on; local processes: FLYWHEEL_INFRA_BROKERS.
BROKERS ?= 1
# Data-parallel trainer ranks (trainer.world_size; docs/architecture.md "Trainer ranks"). Docker: 1, or 2 with the
# compose `ranks` profile; local processes: any number up to the samples topic's partitions.
TRAINERS ?= 1
# HOSTS=1: the local-process stack with every Kafka node, the S3 server, every trainer rank, paramsync, admin and
# each sampler in a network namespace of its own, at its own address on bridge fw-br0 (root; docs/local-stack.md,
# "Many hosts on one machine"). make down removes the namespaces, links and rules (HOSTS_STATE says one is up).
HOSTS ?=
HOSTS_FLAG := $(filter-out 0 no false,$(HOSTS))
HOSTS_STATE := $(or $(FLYWHEEL_HOME),.flywheel)/hosts.json
COMPOSE_CLUSTER := COMPOSE_PROFILES=cluster KAFKA_CLUSTER_VOTERS=1@kafka:9093,2@kafka-2:9093,3@kafka-3:9093 KAFKA_CLUSTER_HOST=kafka KAFKA_CLUSTER_REPLICATION=3 KAFKA_CLUSTER_MIN_ISR=2 KAFKA_CLUSTER_BOOTSTRAP=kafka:9094,kafka-2:9094,kafka-3:9094
CONFIG ?= configs/cartpole.yaml
PYTEST_ARGS ?=
ONLY ?=

.PHONY: help install up down status infra-up infra-down test test-faults test-partitions test-security test-soak test-compose test-k8s test-unit test-mutation bench lint k8s-check s3-live-check clean

help:
	@echo "make up        run the whole stack (docker compose if a Docker engine answers, else local processes)"
	@echo "make down      stop it"
	@echo "make status    what runs (local stack), with restart counts"
	@echo "make test      all tests (brings test Kafka + S3 up itself when no endpoints are given, and stops them after; FLYWHEEL_TEST_INFRA_REUSE=1 keeps them)"
	@echo "make test-unit fast tests only"
	@echo "make test-faults  the whole fault-injection suite (~10 min) -> docs/reliability.md"
	@echo "make test-partitions  the partition nemesis on the multi-host stack (network namespaces, root, ~16 min) -> docs/reliability-network.md"
	@echo "make test-security  the red-team suite: attacks on the running local stack, one row each (~6 min) -> docs/security.md"
	@echo "make test-soak     partitions and kill -9 at random on the multi-host stack for SOAK_MINUTES (10), outside CI (root, ~13 min) -> docs/reliability-soak.md"
	@echo "make test-compose  docker-compose.yml built and run for real on a test Docker engine of its own (root; docs/local-stack.md)"
	@echo "make test-mutation  mutation testing of the trust core (hours; ONLY=name for one file) -> docs/reliability-mutation.md"
	@echo "make bench     the benchmark suite (ONLY=name for one figure) -> docs/benchmarks.md"
	@echo "make lint      ruff + mypy --strict on shared/, services/ and devstack/"
	@echo "make test-k8s  deploy/k8s/overlays/local on a single-node cluster built from source (root; docs/kubernetes.md)"
	@echo "make k8s-check build every deploy/k8s overlay (kustomize, in-process) and check it, Strimzi objects against Strimzi's CRDs and Kafka ACLs against shared/acl.py (needs Go)"
	@echo "make infra-up / infra-down   just Kafka + S3 as local processes"

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[train,test]'
	@touch $(STAMP)

install: $(STAMP)

up: install
	@if [ -n "$(HOSTS_FLAG)" ]; then \
		echo "HOSTS=$(HOSTS): local processes, each part in a network namespace of its own (docs/local-stack.md)"; \
		$(PY) -m devstack up --hosts --install-extras --samplers $(SAMPLERS) --brokers $(BROKERS) --trainers $(TRAINERS) --config $(CONFIG); \
	elif docker info >/dev/null 2>&1; then \
		export FLYWHEEL_ADMIN_TOKEN=$${FLYWHEEL_ADMIN_TOKEN:-$$($(PY) -c 'import secrets; print(secrets.token_hex(32))')}; \
		echo "Docker engine found: docker compose up (admin token: $$FLYWHEEL_ADMIN_TOKEN)"; \
		case "$(BROKERS)" in 1) ;; 3) export $(COMPOSE_CLUSTER);; *) echo "compose runs BROKERS=1 or 3" >&2; exit 2;; esac; \
		export TRAINERS=$(TRAINERS); \
		case "$(TRAINERS)" in 1) ;; 2) export COMPOSE_PROFILES=$${COMPOSE_PROFILES:+$$COMPOSE_PROFILES,}ranks;; *) echo "compose runs TRAINERS=1 or 2" >&2; exit 2;; esac; \
		docker compose up -d --build --scale sampler=$(SAMPLERS) && docker compose ps; \
	else \
		echo "No Docker engine: running the same stack as local processes."; \
		$(PY) -m devstack up --install-extras --samplers $(SAMPLERS) --brokers $(BROKERS) --trainers $(TRAINERS) --config $(CONFIG); \
	fi

down: install
	@if [ -n "$(HOSTS_FLAG)" ] || [ -f "$(HOSTS_STATE)" ]; then $(PY) -m devstack down; \
	elif docker info >/dev/null 2>&1; then COMPOSE_PROFILES=cluster,ranks docker compose down; else $(PY) -m devstack down; fi

status: install
	$(PY) -m devstack status
	@if [ -f "$(HOSTS_STATE)" ]; then $(PY) -m devstack hosts; fi

infra-up: install
	$(PY) -m devstack infra-up --brokers $(BROKERS)

infra-down: install
	$(PY) -m devstack infra-down

test: install
	FLYWHEEL_INFRA_BROKERS=$(BROKERS) $(PY) -m pytest -m "not faults_full and not learning_full and not hosts" $(PYTEST_ARGS)

test-faults: install
	FAULT_REPORT=1 FLYWHEEL_INFRA_BROKERS=$(BROKERS) $(PY) -m pytest tests/faults $(PYTEST_ARGS)

# The multi-host stack (every part in its own network namespace, HOSTS=1) and its network faults: root, ip netns
# and iptables (docs/local-stack.md, "Many hosts on one machine"); tests/hosts, run by CI.
test-partitions: install
	$(PY) -m pytest tests/hosts -m hosts $(PYTEST_ARGS)

# The red-team suite (issue 43): one attack per row on one local stack signed as devstack starts it (forged and
# replayed policies, an unsigned record rolled back to, another run's checkpoint, what a sampler holds, admin writes
# without the token), each refused, audited, training going on, flywheel verify ok; tests/security, run by CI. It
# rewrites only the generated red-team section of docs/security.md.
test-security: install
	SECURITY_REPORT=1 $(PY) -m pytest tests/security -m security $(PYTEST_ARGS)

# The soak, outside CI (not in .ci/run): on the multi-host stack, SOAK_MINUTES (default 10) of cuts and kill -9 at
# random from a printed seed (FLYWHEEL_SOAK_SEED replays it), then the partition rows' checks on the whole run
# (tests/hosts/test_soak.py, marker soak) -> docs/reliability-soak.md. Root; ~13 min with the stack's start.
SOAK_MINUTES ?= 10
test-soak: install
	SOAK_MINUTES=$(SOAK_MINUTES) $(PY) -m pytest tests/hosts -m soak $(PYTEST_ARGS)

# docker-compose.yml for real: a Docker engine on its own socket and data root (so `make up`'s `docker info` never
# sees it), images built without a registry (tools/compose/), tests/compose, then the engine stopped and cleaned.
test-compose: install
	COMPOSE_REPORT=1 tools/compose/run.sh $(PYTEST_ARGS)

# deploy/k8s/overlays/local on a single-node Kubernetes cluster of its own, built from source (tools/k8s/: root;
# binaries and images cached in /var/cache/flywheel-k8s, outside the clone), tests/k8s, then the cluster torn down
# and checked for leftovers; the report lands in .flywheel/k8s-report.md (docs/kubernetes.md). In .ci/run, last.
test-k8s: install
	tools/k8s/run.sh $(PYTEST_ARGS)

test-unit: install
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

# cosmic-ray over the trust core's files against their unit tests (tools/mutation/targets.toml), each in a private
# copy of the tree; not part of make test nor CI (it takes long: the time per file is in the report).
test-mutation: install
	$(PY) -m pip install --quiet -e '.[train,test,mutation]'
	$(PY) tools/mutation/run.py $(if $(ONLY),--only $(ONLY),)

bench: install
	$(PY) -m pip install --quiet -e '.[train,test,bench]'
	$(PY) -m bench $(if $(ONLY),--only $(ONLY),)

lint: install
	$(PY) -m pip install --quiet -e '.[train,test,dev]'
	$(PY) -m ruff check shared services devstack tests bench
	$(PY) -m mypy

# Kubernetes manifests: tools/k8s-check builds each overlay with kustomize's Go API, decodes every
# object strictly into the k8s.io/api types, validates Strimzi's against Strimzi's own CRD schemas
# (tools/k8s-check/crds, pinned), then applies the project's rules (docs/kubernetes.md). Before it,
# the cluster overlay's generated Kafka users, ACLs and topics must be the generator's output, and
# every KafkaUser is held to what shared/acl.py grants its role (a policy written fresh each time).
# The binary is rebuilt only when its sources change; tests/unit/test_k8s_check.py runs this target.
K8S_CHECK := .flywheel/bin/k8s-check
K8S_OVERLAYS := deploy/k8s/overlays/local deploy/k8s/overlays/gpu deploy/k8s/overlays/cluster
K8S_GENERATED := deploy/k8s/overlays/cluster
K8S_ACL_POLICY := .flywheel/k8s-acl-policy.json

$(K8S_CHECK): tools/k8s-check/go.mod tools/k8s-check/go.sum $(wildcard tools/k8s-check/*.go) $(wildcard tools/k8s-check/crds/*.yaml)
	@command -v go >/dev/null || { echo "make k8s-check needs Go on PATH (https://go.dev/dl/)" >&2; exit 1; }
	@mkdir -p $(dir $@)
	cd tools/k8s-check && GOTOOLCHAIN=local GOFLAGS="-mod=readonly -buildvcs=false" \
		go build -trimpath -o ../../$@.$$$$.partial . && mv ../../$@.$$$$.partial ../../$@

k8s-check: $(K8S_CHECK)
	@test -x $(PY) || { echo "make k8s-check needs the virtualenv (make install)" >&2; exit 1; }
	$(PY) -m shared.k8s_acl check $(K8S_GENERATED)
	$(PY) -m shared.k8s_acl policy --out $(K8S_ACL_POLICY)
	$(K8S_CHECK) -acl-policy $(K8S_ACL_POLICY) $(K8S_OVERLAYS)

clean:
	rm -rf .pytest_cache build *.egg-info

# Build versitygw v1.8.0 from its Go module and check the S3 policies per role against it (docs/security.md,
# "Enforced live"); not part of make test (the first build takes minutes).
s3-live-check: install
	tools/s3-live/build.sh
	$(PY) -m pytest tests/integration/test_s3_policies_live.py $(PYTEST_ARGS)
