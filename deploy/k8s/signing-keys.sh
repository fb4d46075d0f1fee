#!/usr/bin/env bash
# The signing keys' Secrets for one namespace (docs/kubernetes.md, "Signing keys"): `flywheel keys init` in a
# temporary directory, then flywheel-signing-public (every role), flywheel-trainer-signing-key and
# flywheel-paramsync-signing-key (one role each). Refuses to replace Secrets that exist. Needs kubectl and the
# project's virtualenv (make install) or FLYWHEEL=<a flywheel command>.
set -euo pipefail
ns=${1:?usage: deploy/k8s/signing-keys.sh NAMESPACE}
cd "$(dirname "$0")/../.."
flywheel=${FLYWHEEL:-.venv/bin/flywheel}
for name in flywheel-signing-public flywheel-trainer-signing-key flywheel-paramsync-signing-key; do
  if kubectl -n "$ns" get secret "$name" >/dev/null 2>&1; then
    echo "signing-keys: secret $name exists in namespace $ns; not replaced (rotate with flywheel keys rotate)" >&2
    exit 1
  fi
done
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$flywheel" keys init --dir "$dir" >/dev/null
kubectl -n "$ns" create secret generic flywheel-signing-public --from-file=public.keys="$dir/public/public.keys"
kubectl -n "$ns" create secret generic flywheel-trainer-signing-key --from-file=trainer.key="$dir/trainer/trainer.key"
kubectl -n "$ns" create secret generic flywheel-paramsync-signing-key \
  --from-file=paramsync.key="$dir/paramsync/paramsync.key"
echo "signing-keys: the three Secrets are in namespace $ns"
