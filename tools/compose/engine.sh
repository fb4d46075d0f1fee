#!/usr/bin/env bash
# A Docker engine for `make test-compose` only: its own socket, data root, exec root and pid file, so the
# default socket (/var/run/docker.sock, which `make up` probes with `docker info`) never answers because of it.
#
#   tools/compose/engine.sh start    # installs Debian's docker.io if dockerd is missing, starts the engine
#   tools/compose/engine.sh stop     # compose projects down, engine stopped, its links, mounts and state gone
#   tools/compose/engine.sh env      # the DOCKER_HOST line to export
#
# --iptables=false: the engine writes no iptables rule and leaves the FORWARD policy alone (Docker otherwise
# sets it to DROP, which cuts other bridges such as the multi-host stack's fw-br0). Containers on one compose
# network reach each other over their bridge; published ports (127.0.0.1:8080) go through docker-proxy.
# What the FORWARD policy was is still recorded at start and put back at stop, in case anything changed it.
set -euo pipefail
NAME=flywheel-test-docker
SOCK=/run/$NAME.sock
DATA=${FLYWHEEL_TEST_DOCKER_DATA:-/var/lib/$NAME}
EXEC=/run/$NAME
PIDFILE=/run/$NAME.pid
STATE=/run/$NAME.state
LOG=${FLYWHEEL_TEST_DOCKER_LOG:-/var/log/$NAME.log}
BRIDGE=fwtd0                 # the default bridge, named so that it is ours (not docker0)
BIP=172.29.255.1/24
export DOCKER_HOST=unix://$SOCK

alive() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

start() {
  if [ "$(id -u)" != 0 ]; then echo "engine.sh: needs root (dockerd)" >&2; exit 2; fi
  if ! command -v dockerd >/dev/null || ! command -v containerd >/dev/null; then
    echo "engine.sh: installing Debian's docker.io (dockerd, containerd, runc)"
    # policy-rc.d keeps the package from starting an engine on the default socket.
    local made_policy=
    if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; made_policy=1; fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io >/dev/null
    [ -z "$made_policy" ] || rm -f /usr/sbin/policy-rc.d
  fi
  if alive && docker version >/dev/null 2>&1; then echo "engine.sh: engine already up on $SOCK"; return; fi
  iptables -S FORWARD 2>/dev/null | awk '$1=="-P"{print $3}' > "$STATE" || true
  mkdir -p "$DATA" "$EXEC"
  ip link show "$BRIDGE" >/dev/null 2>&1 || { ip link add "$BRIDGE" type bridge; ip addr add "$BIP" dev "$BRIDGE"; ip link set "$BRIDGE" up; }
  # setsid: the engine outlives this shell but not `stop`.
  setsid dockerd --host "unix://$SOCK" --data-root "$DATA" --exec-root "$EXEC" --pidfile "$PIDFILE" \
    --iptables=false --ip-masq=false --bridge "$BRIDGE" --storage-driver overlay2 \
    --default-address-pool base=172.30.0.0/16,size=24 >"$LOG" 2>&1 < /dev/null &
  for _ in $(seq 1 60); do
    if docker version >/dev/null 2>&1; then echo "engine.sh: engine up on $SOCK (data root $DATA, log $LOG)"; return; fi
    sleep 1
  done
  echo "engine.sh: dockerd did not answer within 60 s; last lines of $LOG:" >&2; tail -n 30 "$LOG" >&2; exit 1
}

stop() {
  if alive; then
    # Containers first (the engine would stop them anyway; removing them leaves no shim behind).
    ids=$(docker ps -aq 2>/dev/null || true)
    [ -z "$ids" ] || docker rm -f $ids >/dev/null 2>&1 || true
    nets=$(docker network ls -q --filter type=custom 2>/dev/null || true)
    [ -z "$nets" ] || docker network rm $nets >/dev/null 2>&1 || true
    pid=$(cat "$PIDFILE")
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -0 "$pid" 2>/dev/null && { echo "engine.sh: dockerd $pid ignored SIGTERM for 30 s: SIGKILL" >&2; kill -KILL "$pid" || true; }
  fi
  # What a killed engine can leave: its containerd and shims (found by our exec root on their command
  # line, never by name), mounts under our roots, its bridges and veths.
  for p in $(pgrep -f -- "$EXEC" || true); do [ "$p" != $$ ] && kill -KILL "$p" 2>/dev/null || true; done
  for m in $(awk -v d="$DATA" -v e="$EXEC" 'index($2, d)==1 || index($2, e)==1 {print $2}' /proc/mounts | sort -r); do umount -l "$m" 2>/dev/null || true; done
  ip link show "$BRIDGE" >/dev/null 2>&1 && ip link del "$BRIDGE"
  for l in $(ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E '^br-[0-9a-f]{12}$' || true); do
    # A br- bridge is Docker's user-defined network; ours are in 172.30.0.0/16.
    ip -4 addr show "$l" | grep -q 'inet 172\.30\.' && ip link del "$l" || true
  done
  if [ -s "$STATE" ]; then
    was=$(cat "$STATE"); now=$(iptables -S FORWARD 2>/dev/null | awk '$1=="-P"{print $3}')
    if [ -n "$was" ] && [ "$now" != "$was" ]; then iptables -P FORWARD "$was"; echo "engine.sh: FORWARD policy back to $was"; fi
  fi
  rm -f "$STATE" "$PIDFILE" "$SOCK"
  [ "${1:-}" = "--purge" ] && rm -rf "$DATA"
  rm -rf "$EXEC"
  echo "engine.sh: engine stopped"
}

case "${1:-}" in
  start) start ;;
  stop) shift; stop "$@" ;;
  env) echo "export DOCKER_HOST=unix://$SOCK" ;;
  *) echo "usage: $0 start|stop [--purge]|env" >&2; exit 2 ;;
esac
