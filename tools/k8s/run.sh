#!/usr/bin/env bash
# make test-k8s: the binaries (build.sh), the cluster with the images imported (cluster.sh up), the suite
# (tests/k8s) against deploy/k8s/overlays/local, then the cluster torn down and checked for leftovers whatever
# happened. The report (what each test saw, the timings, what was left) is printed at the end and kept in
# $FLYWHEEL_K8S_REPORT (default .flywheel/k8s-report.md). Arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
export FLYWHEEL_K8S_REPORT=${FLYWHEEL_K8S_REPORT:-$PWD/.flywheel/k8s-report.md}
mkdir -p "$(dirname "$FLYWHEEL_K8S_REPORT")"
t0=$(date +%s)
rc=1
{ echo "# make test-k8s, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"; echo; } > "$FLYWHEEL_K8S_REPORT"
note() { echo "- $*" >> "$FLYWHEEL_K8S_REPORT"; echo "test-k8s: $*"; }
cleanup() {
  local s; s=$(date +%s)
  tools/k8s/cluster.sh down
  note "cluster down in $(( $(date +%s) - s )) s; $(tools/k8s/cluster.sh check-clean 2>&1 | tr '\n' ' ')"
  tools/k8s/cluster.sh check-clean >/dev/null || rc=1
  note "pytest exit $rc; $(( $(date +%s) - t0 )) s in all"
  echo; cat "$FLYWHEEL_K8S_REPORT"
  exit $rc
}
trap cleanup EXIT
s=$(date +%s); tools/k8s/build.sh || exit 1
note "binaries ready in $(( $(date +%s) - s )) s"
s=$(date +%s); tools/k8s/cluster.sh up || exit 1
note "cluster up (images imported) in $(( $(date +%s) - s )) s"
FLYWHEEL_TEST_K8S=1 $PY -m pytest tests/k8s -m k8s -s -p no:cacheprovider "$@"
rc=$?
