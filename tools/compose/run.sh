#!/usr/bin/env bash
# make test-compose: the test engine (engine.sh, its own socket), the images (build.sh), the compose suite
# (tests/compose), then the engine stopped and cleaned whatever happened. Arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
t0=$(date +%s)
cleanup() {
  echo "test-compose: stopping the test engine"
  tools/compose/engine.sh stop
  echo "test-compose: took $(( $(date +%s) - t0 )) s in all"
}
trap cleanup EXIT
tools/compose/engine.sh start || exit 1
export DOCKER_HOST=unix:///run/flywheel-test-docker.sock
export DOCKER_CONFIG=${FLYWHEEL_COMPOSE_CACHE:-/var/cache/flywheel-compose}/docker-config
tools/compose/build.sh || exit 1
echo "test-compose: engine and images ready in $(( $(date +%s) - t0 )) s"
FLYWHEEL_TEST_COMPOSE=1 $PY -m pytest tests/compose -m compose -s "$@"
