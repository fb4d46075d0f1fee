#!/usr/bin/env bash
# A single-node Kubernetes cluster of its own, for `make test-k8s` (tests/k8s/): etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubelet on containerd + runc with a bridge CNI, kube-proxy (iptables)
# and CoreDNS, every process in network namespace flywheel-k8s and under cgroup /flywheel-k8s, with binaries and
# images from tools/k8s/build.sh (cached outside the clone).
#
#   tools/k8s/cluster.sh up       # starts it (build.sh first); the API server answers inside the namespace
#   tools/k8s/cluster.sh down     # pods deleted, processes stopped, mounts, namespace, cgroups, state gone
#   tools/k8s/cluster.sh kubectl ARGS...    # kubectl against it (run inside the namespace)
#   tools/k8s/cluster.sh exec CMD...        # any command inside the namespace (reaches Services, pod IPs)
#   tools/k8s/cluster.sh check-clean        # exit 1 naming what a `down` left behind
#
# Addresses exist only inside the namespace: the node 10.201.0.1 (a veth end: API server, kubelet, CoreDNS),
# pods 10.202.0.0/24 (bridge fwk8sbr0), Services 10.203.0.0/24. The host's own network, iptables and routes are
# never touched: kube-proxy's and the CNI's rules live in the namespace and go with it.
#
# What this cluster is not: one node, so no rescheduling elsewhere; no volume provisioner (tests/k8s makes hostPath
# PersistentVolumes for the overlay's claims); the bridge CNI enforces no NetworkPolicy; CoreDNS runs on the node,
# not as a pod (no registry serves its image).
set -euo pipefail
cd "$(dirname "$0")/../.."
CACHE=${FLYWHEEL_K8S_CACHE:-/var/cache/flywheel-k8s}
STATE=${FLYWHEEL_K8S_STATE:-/var/lib/flywheel-k8s}
RUN=/run/flywheel-k8s
NS=flywheel-k8s
CG=flywheel-k8s
NODE=flywheel-k8s-node
NODE_IP=10.201.0.1
POD_CIDR=10.202.0.0/24
SVC_CIDR=10.203.0.0/24
BIN=$CACHE/bin/current
PKI=$STATE/pki
SOCK=$RUN/containerd.sock
SUBSYS=(cpu cpuacct cpuset memory devices freezer blkio pids systemd)
export KUBECONFIG=$PKI/admin.kubeconfig
t0=$(date +%s)
say() { echo "k8s-cluster [$(( $(date +%s) - t0 )) s]: $*"; }

in_ns() { nsenter --net=/run/netns/$NS -- "$@"; }   # the net namespace only: /sys and cgroups stay the host's
kc() { in_ns "$BIN/kubectl" --kubeconfig "$KUBECONFIG" "$@"; }

# ---- cgroups: /flywheel-k8s in every v1 hierarchy (the kubelet's cgroupRoot), the control plane in /flywheel-k8s/system
cgroup_dirs() { for s in "${SUBSYS[@]}"; do [ -d /sys/fs/cgroup/$s ] && echo /sys/fs/cgroup/$s/$CG; done; [ -d /sys/fs/cgroup/unified ] && echo /sys/fs/cgroup/unified/$CG; return 0; }
make_cgroups() {
  for d in $(cgroup_dirs); do
    mkdir -p "$d/system"
    if [[ $d == */cpuset/* ]]; then
      for f in cpuset.cpus cpuset.mems; do cat "/sys/fs/cgroup/cpuset/$f" > "$d/$f"; cat "$d/$f" > "$d/system/$f"; done
    fi
  done
}
# start NAME CMD...: in the namespace, in cgroup /flywheel-k8s/system, logs in $STATE/logs/NAME.log, pid in $RUN.
start() {
  local name=$1; shift
  ( for d in $(cgroup_dirs); do echo $BASHPID > "$d/system/cgroup.procs"; done
    exec setsid nsenter --net=/run/netns/$NS -- nice "$@" >"$STATE/logs/$name.log" 2>&1 </dev/null ) &
  echo $! > "$RUN/$name.pid"
}
wait_for() {  # wait_for WHAT SECONDS CMD...
  local what=$1 secs=$2; shift 2
  for _ in $(seq 1 "$secs"); do "$@" >/dev/null 2>&1 && return 0; sleep 1; done
  say "$what did not come up within $secs s; last lines of its log:" >&2
  tail -n 25 "$STATE/logs/$what.log" >&2 || true
  return 1
}

# ---- certificates: one CA, a serving certificate for the API server, a client certificate per component --------
cert() {  # cert NAME SUBJECT [SANS]
  local name=$1 subj=$2 sans=${3:-}
  openssl genrsa -out "$PKI/$name.key" 2048 2>/dev/null
  openssl req -new -key "$PKI/$name.key" -subj "$subj" -out "$PKI/$name.csr" 2>/dev/null
  local ext=$PKI/$name.ext
  { echo "basicConstraints=CA:FALSE"; echo "keyUsage=critical,digitalSignature,keyEncipherment"
    if [ -n "$sans" ]; then echo "extendedKeyUsage=serverAuth,clientAuth"; echo "subjectAltName=$sans"; else echo "extendedKeyUsage=clientAuth"; fi
  } > "$ext"
  openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial -days 2 \
    -extfile "$ext" -out "$PKI/$name.crt" 2>/dev/null
  rm -f "$PKI/$name.csr" "$ext"
}
kubeconfig() {  # kubeconfig NAME: $PKI/NAME.kubeconfig with NAME's client certificate
  local name=$1
  cat > "$PKI/$name.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: flywheel-k8s, cluster: {server: "https://$NODE_IP:6443", certificate-authority: "$PKI/ca.crt"}}]
users: [{name: $name, user: {client-certificate: "$PKI/$name.crt", client-key: "$PKI/$name.key"}}]
contexts: [{name: flywheel-k8s, context: {cluster: flywheel-k8s, user: $name}}]
current-context: flywheel-k8s
EOF
}
make_pki() {
  mkdir -p "$PKI"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$PKI/ca.key" -out "$PKI/ca.crt" -days 2 \
    -subj "/CN=flywheel-k8s-ca" 2>/dev/null
  cert apiserver "/CN=kube-apiserver" \
    "IP:$NODE_IP,IP:10.203.0.1,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
  cert admin "/O=system:masters/CN=flywheel-k8s-admin"
  cert controller-manager "/CN=system:kube-controller-manager"
  cert scheduler "/CN=system:kube-scheduler"
  cert kubelet "/O=system:nodes/CN=system:node:$NODE"
  cert kube-proxy "/CN=system:kube-proxy"
  cert coredns "/CN=flywheel-k8s-coredns"
  for n in admin controller-manager scheduler kubelet kube-proxy coredns; do kubeconfig "$n"; done
  openssl genrsa -out "$PKI/sa.key" 2048 2>/dev/null
  openssl rsa -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
}

# ---- configuration files ---------------------------------------------------------------------------------------
write_configs() {
  mkdir -p "$STATE/cni/net.d" "$STATE/cni/ipam" "$STATE/etc"
  cat > "$STATE/etc/containerd.toml" <<EOF
version = 2
root = "$CACHE/containerd"
state = "$RUN/containerd"
[grpc]
  address = "$SOCK"
[plugins."io.containerd.internal.v1.opt"]
  path = "$STATE/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "flywheel.local/pause:3.10"
  # The kubelet asks for oom_score_adj -998 for a pod's sandbox and -997 for Guaranteed containers; lowering it needs
  # CAP_SYS_RESOURCE, which this machine's root lacks (runc then fails: "can't get final child's PID from pipe").
  # Restricted, no container goes below containerd's own.
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$STATE/cni/net.d"
EOF
  cat > "$STATE/cni/net.d/10-flywheel.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "flywheel-k8s", "plugins": [
  {"type": "bridge", "bridge": "fwk8sbr0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "dataDir": "$STATE/cni/ipam", "ranges": [[{"subnet": "$POD_CIDR"}]],
            "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}
]}
EOF
  cat > "$STATE/etc/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: "$PKI/ca.crt"}
authorization: {mode: Webhook}
cgroupDriver: cgroupfs
cgroupRoot: /$CG
containerRuntimeEndpoint: unix://$SOCK
clusterDNS: [$NODE_IP]
clusterDomain: cluster.local
resolvConf: ""
podLogsDir: $STATE/pod-logs
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
failSwapOn: false
failCgroupV1: false
# The machine's disk is shared with other work: evict only when it is really full.
evictionHard: {memory.available: 200Mi, nodefs.available: 1Gi, imagefs.available: 1Gi}
imageGCHighThresholdPercent: 99
imageGCLowThresholdPercent: 98
EOF
  cat > "$STATE/etc/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: "$PKI/kube-proxy.kubeconfig"}
mode: iptables
hostnameOverride: $NODE
clusterCIDR: $POD_CIDR
bindAddress: $NODE_IP
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
# Every Service connection leaves with the node's address, so a reply from a pod on the same bridge comes back
# through the node's conntrack entry.
iptables: {masqueradeAll: true}
# 0: leave the conntrack sysctls (some of them global, not per namespace) as they are.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
  cat > "$STATE/etc/Corefile" <<EOF
.:53 {
    bind $NODE_IP
    errors
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $PKI/coredns.kubeconfig
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 5
}
EOF
}

# The kubelet sets these global (not per-namespace) sysctls at start; `down` puts back what they were.
KERNEL_SYSCTLS=(vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops kernel.keys.root_maxkeys kernel.keys.root_maxbytes)

up() {
  [ "$(id -u)" = 0 ] || { echo "cluster.sh: needs root" >&2; exit 2; }
  if ip netns list | grep -qw "$NS"; then echo "cluster.sh: namespace $NS exists: tools/k8s/cluster.sh down first" >&2; exit 1; fi
  tools/k8s/build.sh
  rm -rf "$STATE"; mkdir -p "$STATE/logs" "$RUN"
  ip netns list | awk '{print $1}' | grep '^cni-' > "$RUN/netns-before" || true
  for s in "${KERNEL_SYSCTLS[@]}"; do echo "$s=$(sysctl -n "$s")"; done > "$RUN/sysctls"

  # The network namespace: loopback, the node's address on one end of a veth pair whose both ends stay inside
  # (this kernel has no dummy interfaces), a default route into it (no way out).
  ip netns add "$NS"
  in_ns ip link set lo up
  in_ns ip link add fwk8s0 type veth peer name fwk8s1
  in_ns ip addr add "$NODE_IP/24" dev fwk8s0
  in_ns ip link set fwk8s1 up
  in_ns ip link set fwk8s0 up
  in_ns ip route add default dev fwk8s0
  in_ns sysctl -qw net.ipv4.ip_forward=1
  in_ns sysctl -qw net.bridge.bridge-nf-call-iptables=1 2>/dev/null || true
  make_cgroups
  make_pki
  write_configs
  say "namespace $NS, cgroup /$CG, certificates in $PKI"

  start containerd containerd --config "$STATE/etc/containerd.toml"
  wait_for containerd 30 ctr --address "$SOCK" version
  tools/k8s/images.sh
  start etcd etcd --name flywheel-k8s --data-dir "$STATE/etcd" --listen-client-urls http://127.0.0.1:2379 \
    --advertise-client-urls http://127.0.0.1:2379 --listen-peer-urls http://127.0.0.1:2380 \
    --initial-advertise-peer-urls http://127.0.0.1:2380 --initial-cluster flywheel-k8s=http://127.0.0.1:2380
  wait_for etcd 30 in_ns python3 -c 'import urllib.request; urllib.request.urlopen("http://127.0.0.1:2379/health", timeout=2)'
  start kube-apiserver "$BIN/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 \
    --advertise-address="$NODE_IP" --bind-address=0.0.0.0 --secure-port=6443 \
    --service-cluster-ip-range="$SVC_CIDR" --allow-privileged=true --authorization-mode=Node,RBAC \
    --client-ca-file="$PKI/ca.crt" --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
    --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" --kubelet-client-key="$PKI/apiserver-kubelet-client.key" \
    --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local --profiling=false \
    --kubelet-preferred-address-types=InternalIP
  wait_for kube-apiserver 90 kc get --raw /readyz
  say "API server ready"
  # CoreDNS's identity may read what it serves (the rules of CoreDNS's own system:coredns ClusterRole).
  kc apply -f - >/dev/null <<EOF
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: flywheel-k8s-coredns}
rules:
  - {apiGroups: [""], resources: [endpoints, services, pods, namespaces], verbs: [list, watch]}
  - {apiGroups: [discovery.k8s.io], resources: [endpointslices], verbs: [list, watch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: flywheel-k8s-coredns}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: flywheel-k8s-coredns}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: flywheel-k8s-coredns}]
EOF
  start kube-controller-manager "$BIN/kube-controller-manager" --kubeconfig="$PKI/controller-manager.kubeconfig" \
    --authentication-kubeconfig="$PKI/controller-manager.kubeconfig" --authorization-kubeconfig="$PKI/controller-manager.kubeconfig" \
    --bind-address=127.0.0.1 --leader-elect=false --use-service-account-credentials=true \
    --service-account-private-key-file="$PKI/sa.key" --root-ca-file="$PKI/ca.crt" \
    --service-cluster-ip-range="$SVC_CIDR" --profiling=false
  start kube-scheduler "$BIN/kube-scheduler" --kubeconfig="$PKI/scheduler.kubeconfig" \
    --authentication-kubeconfig="$PKI/scheduler.kubeconfig" --authorization-kubeconfig="$PKI/scheduler.kubeconfig" \
    --bind-address=127.0.0.1 --leader-elect=false --profiling=false
  start kubelet "$BIN/kubelet" --config="$STATE/etc/kubelet.yaml" --kubeconfig="$PKI/kubelet.kubeconfig" \
    --root-dir="$STATE/kubelet" --cert-dir="$STATE/kubelet/pki" --hostname-override="$NODE" --node-ip="$NODE_IP"
  start kube-proxy "$BIN/kube-proxy" --config="$STATE/etc/kube-proxy.yaml"
  start coredns "$CACHE/bin/coredns" -conf "$STATE/etc/Corefile"
  wait_for kubelet 120 node_ready
  say "up: node $NODE Ready ($(kc get node "$NODE" -o jsonpath='{.status.nodeInfo.kubeletVersion}'), containerd $(containerd --version | awk '{print $3}'))"
}

node_ready() { [ "$(kc get node "$NODE" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ]; }

stop_pid() {  # stop_pid NAME [SECONDS]
  local f=$RUN/$1.pid pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 "${2:-20}"); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

down() {
  # Pods first, through the API, so the kubelet unmounts their volumes and the CNI releases their addresses.
  if [ -f "$RUN/kube-apiserver.pid" ] && kc get --raw /readyz >/dev/null 2>&1; then
    kc delete namespace flywheel --ignore-not-found --wait=true --timeout=120s >/dev/null 2>&1 || true
    kc delete pods --all -A --grace-period=10 --timeout=60s >/dev/null 2>&1 || true
  fi
  for c in coredns kube-proxy kube-scheduler kube-controller-manager; do stop_pid $c; done
  stop_pid kubelet 30
  # Containers the kubelet did not remove: killed through containerd, then the shims (found by our socket on their
  # command line, never by name).
  if [ -S "$SOCK" ]; then
    local ctr=(ctr --address "$SOCK" --namespace k8s.io) t
    for t in $("${ctr[@]}" tasks ls -q 2>/dev/null); do "${ctr[@]}" tasks kill -s SIGKILL "$t" >/dev/null 2>&1 || true; done
    sleep 1
    for t in $("${ctr[@]}" tasks ls -q 2>/dev/null); do "${ctr[@]}" tasks delete -f "$t" >/dev/null 2>&1 || true; done
    for t in $("${ctr[@]}" containers ls -q 2>/dev/null); do "${ctr[@]}" containers delete "$t" >/dev/null 2>&1 || true; done
  fi
  stop_pid kube-apiserver; stop_pid etcd
  stop_pid containerd 30
  for p in $(pgrep -f -- "-address $SOCK" || true); do kill -KILL "$p" 2>/dev/null || true; done
  # Mounts under our roots (pod volumes, overlay snapshots, the shims' rootfs, netns handles), deepest first.
  for m in $(awk -v s="$STATE" -v r="$RUN" -v c="$CACHE/containerd" 'index($2, s)==1 || index($2, r)==1 || index($2, c)==1 {print $2}' /proc/mounts | sort -r); do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
  done
  ip netns list | grep -qw "$NS" && ip netns delete "$NS"
  # Pod network namespaces containerd made (/run/netns/cni-*) and left: only those that were not there before `up`.
  for n in $(ip netns list | awk '{print $1}' | grep '^cni-' || true); do
    grep -qxF "$n" "$RUN/netns-before" 2>/dev/null || ip netns delete "$n" 2>/dev/null || true
  done
  for d in $(cgroup_dirs | sort -r); do
    [ -d "$d" ] && find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null || true
  done
  if [ -f "$RUN/sysctls" ]; then
    while IFS== read -r k v; do [ "$(sysctl -n "$k")" = "$v" ] || sysctl -qw "$k=$v"; done < "$RUN/sysctls"
  fi
  rm -rf "$RUN" "$STATE"
  say "down"
}

check_clean() {
  local left=()
  ip netns list | grep -qw "$NS" && left+=("network namespace $NS")
  for f in "$RUN"/*.pid; do [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && left+=("process $(basename "$f" .pid) $(cat "$f")"); done
  [ -z "$(pgrep -f -- "$SOCK" || true)" ] || left+=("processes naming $SOCK: $(pgrep -f -- "$SOCK" | tr '\n' ' ')")
  local m; m=$(awk -v s="$STATE" -v r="$RUN" -v c="$CACHE/containerd" 'index($2, s)==1 || index($2, r)==1 || index($2, c)==1 {print $2}' /proc/mounts)
  [ -z "$m" ] || left+=("mounts: $m")
  for d in $(cgroup_dirs); do [ -d "$d" ] && left+=("cgroup $d"); done
  [ -e "$STATE" ] && left+=("state $STATE")
  iptables-save 2>/dev/null | grep -qE 'KUBE-|CNI-' && left+=("KUBE-/CNI- iptables rules in the host namespace")
  ip link show fwk8sbr0 >/dev/null 2>&1 && left+=("bridge fwk8sbr0 in the host namespace")
  if [ ${#left[@]} -gt 0 ]; then printf 'left behind: %s\n' "${left[@]}"; return 1; fi
  echo "nothing left: no namespace $NS, process, mount, cgroup, state or iptables rule"
}

[ "${BASH_SOURCE[0]}" = "$0" ] || return 0   # sourced: the functions only
case "${1:-}" in
  up) up ;;
  down) down ;;
  kubectl) shift; kc "$@" ;;
  exec) shift; in_ns "$@" ;;
  check-clean) check_clean ;;
  *) echo "usage: $0 up|down|kubectl ARGS...|exec CMD...|check-clean" >&2; exit 2 ;;
esac
