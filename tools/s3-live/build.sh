#!/usr/bin/env bash
# Build versitygw (the version pinned in go.mod, checked against go.sum) into
# .flywheel/cache/s3-live/versitygw, or into the path given as the only argument.
# tests/integration/test_s3_policies_live.py runs against that binary and skips without it.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-$root/.flywheel/cache/s3-live/versitygw}"

if ! command -v go >/dev/null 2>&1; then
  echo "build.sh: go is not on PATH; versitygw v1.8.0 needs Go >= 1.25 (https://go.dev/dl/)" >&2
  exit 1
fi
mkdir -p "$(dirname "$out")"
cd "$here"
# First build only: record the dependencies' checksums (checked against sum.golang.org), then commit go.sum.
[ -s go.sum ] || go mod tidy
# -mod=readonly: a go.sum that does not cover the build fails here instead of being rewritten.
CGO_ENABLED=0 go build -mod=readonly -trimpath -o "$out" github.com/versity/versitygw/cmd/versitygw
echo "built $("$out" --version 2>/dev/null | head -n 1 || true) -> $out"
