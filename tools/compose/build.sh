#!/usr/bin/env bash
# Everything `make test-compose` needs before `docker compose up`, on a machine that reaches no container
# registry: the base image (base-image.sh), a wheelhouse, Docker Compose v2 built from the Go module proxy, the
# stand-in third-party images (deploy/standins/) under the names docker-compose.yml uses, and flywheel:local and
# flywheel-sampler:local from deploy/Dockerfile as shipped, with only PYTHON_IMAGE and the pip wheelhouse arguments set
# (and TORCH_CPU_ONLY=0 for flywheel:local: the wheelhouse has PyPI's CUDA torch). One image at a time (the machine
# has 2 cores). Caches in $FLYWHEEL_COMPOSE_CACHE (default /var/cache/flywheel-compose), outside the clone.
# DOCKER_HOST must name the test engine (engine.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
CACHE=${FLYWHEEL_COMPOSE_CACHE:-/var/cache/flywheel-compose}
COMPOSE_VERSION=${COMPOSE_VERSION:-v2.40.3}
PY=${PY:-.venv/bin/python}
export DOCKER_BUILDKIT=0     # the classic builder: Debian's engine has no buildx plugin here
mkdir -p "$CACHE"
t0=$(date +%s)
say() { echo "compose-build [$(( $(date +%s) - t0 )) s]: $*"; }

# ---- Docker Compose v2, a CLI plugin in a private DOCKER_CONFIG (the user's ~/.docker is left alone) ----------
PLUGIN=$CACHE/docker-compose-$COMPOSE_VERSION
if [ ! -x "$PLUGIN" ]; then
  say "building Docker Compose $COMPOSE_VERSION from the Go module proxy (first run only)"
  # `go install module@version` refuses compose's go.mod (it has exclude directives): build in a copy of the module.
  src=$(cd /tmp && GOTOOLCHAIN=local GOFLAGS=-mod=mod go mod download -json "github.com/docker/compose/v2@$COMPOSE_VERSION" \
        | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  work=$(mktemp -d); cp -r "$src/." "$work"; chmod -R u+w "$work"
  (cd "$work" && GOTOOLCHAIN=local GOFLAGS=-mod=mod nice go build -trimpath \
     -ldflags "-s -w -X github.com/docker/compose/v2/internal.Version=$COMPOSE_VERSION" -o "$PLUGIN.partial" ./cmd)
  mv "$PLUGIN.partial" "$PLUGIN"; rm -rf "$work"
fi
mkdir -p "$CACHE/docker-config/cli-plugins"
ln -sf "$PLUGIN" "$CACHE/docker-config/cli-plugins/docker-compose"

# ---- the base image ---------------------------------------------------------------------------------------
BASE=$(tools/compose/base-image.sh)
say "base image $BASE"

# ---- the wheelhouse: every dependency of the project (and the S3 stand-in), for Linux x86_64, CPython 3.11 -------
WHEELS=$CACHE/wheels
# Keyed by what the wheelhouse holds (the dependencies and build requirements), not by the rest of pyproject.toml.
# The `train` extra is in it too: flywheel:local installs it (torch), flywheel-sampler:local does not.
key=$(python3 -c 'import tomllib, json, hashlib; p = tomllib.load(open("pyproject.toml", "rb")); print(hashlib.sha256(json.dumps([p["project"]["dependencies"], p["project"]["optional-dependencies"]["train"], p["build-system"]["requires"], "moto[server]>=5.1 boto3"]).encode()).hexdigest()[:16])')
if [ ! -f "$WHEELS/.complete-$key" ]; then
  say "pip download into $WHEELS (first run, or the dependencies changed)"
  mkdir -p "$WHEELS"
  python3 -m pip download --quiet --dest "$WHEELS" --python-version 3.11 --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64 --platform linux_x86_64 \
    '.[train]' 'setuptools>=68' wheel pip 'moto[server]>=5.1' boto3
  rm -f "$WHEELS"/.complete-*; touch "$WHEELS/.complete-$key"
fi
# Served to the builds on the host's loopback (builds run with --network host), on a fixed port where it is free:
# the port is part of PIP_FIND_LINKS, a build argument, and the classic builder keys every RUN after an ARG by its
# value, so a new port each run rebuilt the dependency layers (torch included) every time.
port=${FLYWHEEL_COMPOSE_WHEEL_PORT:-18765}
if ! python3 -c "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', $port))" 2>/dev/null; then
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  say "port ${FLYWHEEL_COMPOSE_WHEEL_PORT:-18765} is taken: the wheelhouse is served on $port (the dependency layers rebuild)"
fi
python3 -m http.server --bind 127.0.0.1 --directory "$WHEELS" "$port" >/dev/null 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 1 50); do python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/', timeout=1)" 2>/dev/null && break; sleep 0.2; done
PIP_ARGS=(--build-arg PIP_NO_INDEX=1 --build-arg "PIP_FIND_LINKS=http://127.0.0.1:$port/")

build() {  # build TAG CONTEXT [docker build args...]
  local tag=$1 ctx=$2; shift 2
  local s=$(date +%s)
  docker build -q --network host --build-arg "BASE_IMAGE=$BASE" "$@" -t "$tag" "$ctx" >/dev/null
  say "built $tag ($(( $(date +%s) - s )) s)"
}

# ---- stand-ins for the third-party images (deploy/standins/README.md) ----------------------------------------
# Each is rebuilt when it is missing, when REBUILD_STANDINS is set, or when what it is built from changed: the image
# carries the digest of its inputs as the label flywheel.inputs (an image from before the label counts as changed).
inputs() { find "$@" -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16; }
stale() {  # stale IMAGE DIGEST: true when IMAGE must be built
  [ -n "${REBUILD_STANDINS:-}" ] && return 0
  local have
  have=$(docker image inspect -f '{{ index .Config.Labels "flywheel.inputs" }}' "$1" 2>/dev/null) || return 0
  [ "$have" != "$2" ]
}
KAFKA_INPUTS=$(inputs deploy/standins/kafka deploy/kafka/log4j2.properties deploy/kafka/pom.xml)
if stale apache/kafka:4.1.1 "$KAFKA_INPUTS"; then
  libs=$($PY -c 'from devstack.jars import ensure_kafka_jars; print(ensure_kafka_jars(print))' | tail -n 1)
  ctx=$(mktemp -d)
  mkdir -p "$ctx/libs"
  mvn -q -B -f deploy/standins/kafka/pom-tools.xml dependency:copy-dependencies -DoutputDirectory="$ctx/libs" -DincludeScope=runtime
  cp "$libs"/*.jar "$ctx/libs/"
  cp -r deploy/standins/kafka/Dockerfile deploy/standins/kafka/run.py deploy/standins/kafka/bin "$ctx/"
  cp deploy/kafka/log4j2.properties "$ctx/"
  build apache/kafka:4.1.1 "$ctx" --label "flywheel.inputs=$KAFKA_INPUTS"
  rm -rf "$ctx"
fi
MINIO=quay.io/minio/minio:RELEASE.2025-09-07T16-13-09Z
MC=quay.io/minio/mc:RELEASE.2025-08-13T08-35-41Z
MINIO_INPUTS=$(inputs deploy/standins/minio)
if stale "$MINIO" "$MINIO_INPUTS"; then
  build "$MINIO" deploy/standins/minio "${PIP_ARGS[@]}" --label "flywheel.inputs=$MINIO_INPUTS"
fi
docker tag "$MINIO" "$MC"     # one stand-in image holds both the server and `mc`
PROMETHEUS_INPUTS=$(inputs deploy/standins/prometheus)
if stale prom/prometheus:v3.5.0 "$PROMETHEUS_INPUTS"; then
  build prom/prometheus:v3.5.0 deploy/standins/prometheus --label "flywheel.inputs=$PROMETHEUS_INPUTS"
fi

# ---- the project's images: deploy/Dockerfile as shipped; only build arguments differ (the base image, the wheelhouse) --
# The sampler's target first (no torch; its build fails if torch is importable), then the default image: it shares
# the stages before the sampler's, from the layer cache. TORCH_CPU_ONLY=0: download.pytorch.org cannot be reached
# here, so the wheelhouse holds PyPI's torch, the CUDA build, which the default image's CPU-only check would refuse.
build flywheel-sampler:local . -f deploy/Dockerfile --target sampler --build-arg "PYTHON_IMAGE=$BASE" "${PIP_ARGS[@]}"
build flywheel:local . -f deploy/Dockerfile --build-arg "PYTHON_IMAGE=$BASE" "${PIP_ARGS[@]}" --build-arg TORCH_CPU_ONLY=0

# Earlier builds' images, untagged by these (the torch layers alone are ~8 GB each time the dependencies change):
# removed, so that the engine's disk holds one generation. The layer cache of this build stays (its intermediate
# images are the tagged images' parents, not dangling).
freed=$(docker image prune -f 2>/dev/null | sed -n 's/^Total reclaimed space: //p')
[ -z "$freed" ] || [ "$freed" = "0B" ] || say "earlier builds' dangling images removed ($freed)"

say "images:"
docker image ls --format '  {{.Repository}}:{{.Tag}}  {{.Size}}' | grep -v '<none>' | sort
