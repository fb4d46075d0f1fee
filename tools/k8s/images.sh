#!/usr/bin/env bash
# The cluster's images, where no registry can be pulled from (called by cluster.sh up, once containerd runs):
# tools/compose/build.sh on the test Docker engine (tools/compose/engine.sh; started here if it is not up, and
# stopped again after), a pause image built here (tools/k8s/pause), then each image the local overlay runs streamed
# with `docker save` into the cluster's containerd (`ctr images import -`, namespace k8s.io) under the overlay's
# names. An import is keyed by the Docker image id (a marker beside containerd's root, which is kept between
# clusters), so a second run imports only what was rebuilt.
#
# The overlay's names: flywheel:dev and flywheel-sampler:dev (deploy/k8s/base; compose tags them :local), and the
# stand-ins compose uses for apache/kafka and quay.io/minio/{minio,mc} (deploy/standins/).
set -euo pipefail
cd "$(dirname "$0")/../.."
CACHE=${FLYWHEEL_K8S_CACHE:-/var/cache/flywheel-k8s}
SOCK=/run/flywheel-k8s/containerd.sock
PAUSE=flywheel.local/pause:3.10
# compose's name -> the name in the cluster
declare -A NAMES=(
  [flywheel:local]=docker.io/library/flywheel:dev
  [flywheel-sampler:local]=docker.io/library/flywheel-sampler:dev
  [apache/kafka:4.1.1]=docker.io/apache/kafka:4.1.1
  [quay.io/minio/minio:RELEASE.2025-09-07T16-13-09Z]=quay.io/minio/minio:RELEASE.2025-09-07T16-13-09Z
  [quay.io/minio/mc:RELEASE.2025-08-13T08-35-41Z]=quay.io/minio/mc:RELEASE.2025-08-13T08-35-41Z
  [$PAUSE]=$PAUSE
)
t0=$(date +%s)
say() { echo "k8s-images [$(( $(date +%s) - t0 )) s]: $*"; }
ctr=(ctr --address "$SOCK" --namespace k8s.io)

export DOCKER_HOST=unix:///run/flywheel-test-docker.sock DOCKER_CONFIG=/var/cache/flywheel-compose/docker-config
if ! docker version >/dev/null 2>&1; then
  tools/compose/engine.sh start
  trap 'tools/compose/engine.sh stop >/dev/null' EXIT
fi
tools/compose/build.sh

# The pause image: a static Go binary in an image of its own (tools/k8s/pause/pause.go).
ctx=$(mktemp -d)
(cd tools/k8s/pause && GOTOOLCHAIN=local GOWORK=off GOFLAGS=-buildvcs=false CGO_ENABLED=0 \
   go build -trimpath -ldflags "-s -w" -o "$ctx/pause" pause.go)
printf 'FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n' > "$ctx/Dockerfile"
DOCKER_BUILDKIT=0 docker build -q -t "$PAUSE" "$ctx" >/dev/null
rm -rf "$ctx"

ENGINE_ROOT=$(docker info --format '{{.DockerRootDir}}')
mkdir -p "$CACHE/containerd-imported"
have=$("${ctr[@]}" images ls -q)
for name in "${!NAMES[@]}"; do
  id=$(docker image inspect --format '{{.Id}}' "$name"); id=${id#sha256:}
  mark=$CACHE/containerd-imported/$(echo "$name" | tr '/:' '__')-${id:0:16}
  if [ -f "$mark" ] && grep -qxF "${NAMES[$name]}" <<< "$have"; then continue; fi
  # `docker save` stages the whole image under the engine's root before it streams a byte (flywheel:local is ~8 GB
  # with PyPI's CUDA torch): refuse here, naming the sizes, rather than fail half-way with "no space left on device".
  size_kb=$(( $(docker image inspect --format '{{.Size}}' "$name") / 1024 ))
  avail_kb=$(df -Pk "$ENGINE_ROOT" | awk 'NR == 2 {print $4}')
  if (( avail_kb < size_kb + 2 * 1024 * 1024 )); then
    say "cannot import $name: docker save needs its $(( size_kb / 1024 )) MiB plus 2 GiB free under $ENGINE_ROOT, which has $(( avail_kb / 1024 )) MiB free" >&2
    exit 1
  fi
  s=$(date +%s)
  docker save "$name" | nice "${ctr[@]}" images import - >/dev/null
  # containerd names an image as Docker does: the first part is a registry only with a dot, a colon or localhost.
  first=${name%%/*}
  if [[ $name == */* && ( $first == *.* || $first == *:* || $first == localhost ) ]]; then saved=$name
  elif [[ $name == */* ]]; then saved=docker.io/$name
  else saved=docker.io/library/$name; fi
  [ "$saved" = "${NAMES[$name]}" ] || "${ctr[@]}" images tag --force "$saved" "${NAMES[$name]}" >/dev/null
  rm -f "$CACHE/containerd-imported/$(echo "$name" | tr '/:' '__')"-*; touch "$mark"
  say "imported $name as ${NAMES[$name]} ($(( $(date +%s) - s )) s)"
done
