#!/usr/bin/env bash
# The binaries `tools/k8s/cluster.sh up` runs, on a machine that reaches no container registry and no release
# download: Kubernetes' six (kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy,
# kubectl) and CoreDNS built from the Go module proxy into $FLYWHEEL_K8S_CACHE (default /var/cache/flywheel-k8s,
# outside the clone), keyed by version so that a second run does nothing; Debian's etcd, containerd, runc and CNI
# plugins where missing. The images are tools/k8s/images.sh's.
#
# k8s.io/kubernetes is not meant to be a dependency: its go.mod replaces its 31 staging modules (k8s.io/api,
# client-go, ...) with ./staging/src/..., which the module's zip leaves out. Pointed at the published v0.<minor>
# modules of the same release instead (GOWORK=off, -mod=mod), the commands build as they are.
set -euo pipefail
cd "$(dirname "$0")/../.."
CACHE=${FLYWHEEL_K8S_CACHE:-/var/cache/flywheel-k8s}
K8S_VERSION=${K8S_VERSION:-v1.34.2}
COREDNS_VERSION=${COREDNS_VERSION:-v1.12.4}
BIN=$CACHE/bin/$K8S_VERSION
t0=$(date +%s)
say() { echo "k8s-build [$(( $(date +%s) - t0 )) s]: $*"; }
mkdir -p "$CACHE"
export GOTOOLCHAIN=local GOWORK=off GOFLAGS="-mod=mod -buildvcs=false" CGO_ENABLED=0

# ---- Debian packages: etcd, containerd, runc, the CNI plugins (bridge, host-local, loopback, portmap) -------------
need=()
command -v etcd >/dev/null || need+=(etcd-server)
command -v containerd >/dev/null || need+=(containerd)
command -v runc >/dev/null || need+=(runc)
[ -x /usr/lib/cni/bridge ] || need+=(containernetworking-plugins)
command -v iptables >/dev/null || need+=(iptables)
command -v conntrack >/dev/null || need+=(conntrack)
if [ ${#need[@]} -gt 0 ]; then
  say "apt-get install ${need[*]}"
  # policy-rc.d keeps the packages from starting daemons of their own (etcd, containerd) on the default paths.
  made_policy=
  if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; made_policy=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; }
  [ -z "$made_policy" ] || rm -f /usr/sbin/policy-rc.d
fi

# ---- Kubernetes from the Go module proxy ---------------------------------------------------------------------
CMDS=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl)
if [ ! -f "$BIN/.complete" ]; then
  say "building ${CMDS[*]} $K8S_VERSION from the Go module proxy (first run only)"
  src=$(cd /tmp && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  work=$(mktemp -d /tmp/flywheel-k8s-src.XXXXXX)
  cp -r "$src/." "$work"; chmod -R u+w "$work"
  staging_version=v0.${K8S_VERSION#v1.}
  (cd "$work"
   for m in $(go mod edit -json | python3 -c 'import json,sys; print(" ".join(r["Old"]["Path"] for r in json.load(sys.stdin)["Replace"] or [] if r["New"]["Path"].startswith("./staging/")))'); do
     go mod edit -replace "$m=$m@$staging_version"
   done
   ld="-s -w"
   minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
   for v in gitVersion=$K8S_VERSION gitMajor=1 gitMinor=$minor gitTreeState=clean; do
     ld="$ld -X k8s.io/component-base/version.$v"
   done
   mkdir -p "$BIN.partial"
   pkgs=(); for c in "${CMDS[@]}"; do pkgs+=("./cmd/$c"); done
   nice go build -trimpath -ldflags "$ld" -o "$BIN.partial/" "${pkgs[@]}")
  rm -rf "$work" "$BIN"; mv "$BIN.partial" "$BIN"; touch "$BIN/.complete"
  say "built: $(cd "$BIN" && ls | tr '\n' ' ')"
fi

# CoreDNS (the cluster's DNS, run on the node by cluster.sh): `go install` of the published module.
DNS=$CACHE/bin/coredns-$COREDNS_VERSION
if [ ! -x "$DNS" ]; then
  say "building CoreDNS $COREDNS_VERSION from the Go module proxy (first run only)"
  gobin=$(mktemp -d)
  GOBIN=$gobin nice go install -trimpath -ldflags "-s -w" "github.com/coredns/coredns@$COREDNS_VERSION"
  mv "$gobin/coredns" "$DNS"; rmdir "$gobin"
fi
ln -sfn "$BIN" "$CACHE/bin/current"
ln -sfn "$DNS" "$CACHE/bin/coredns"
say "binaries in $BIN"
