"""The multi-host local stack (``python -m devstack up --hosts``, ``make up HOSTS=1``): every Kafka node, the S3
server, every trainer rank, paramsync, admin and each sampler in a network namespace of its own, with its own
address on one bridge, so a link between two parts can be cut (``iptables`` inside a namespace) like a link
between two machines.

The network, all of it named with the ``fw-`` prefix (one such stack per machine)::

    root namespace   fw-br0 10.77.0.1/24  (alias: the owning stack's home)     FORWARD -i fw-br0 -o fw-br0 ACCEPT
                       |-- fwv-kafka-1  <veth>  eth0 10.77.0.11/24 in netns fw-kafka-1     (kafka)
                       |-- fwv-s3       <veth>  eth0 10.77.0.20/24 in netns fw-s3          (s3)
                       |-- fwv-trainer-0 ...    eth0 10.77.0.30/24 in netns fw-trainer-0   (trainer, rank 0)
                       ...

The root namespace holds the bridge's address, so it reaches every part (``flywheel status``, the readiness
checks, ``flywheel verify``); the supervisor starts each part with ``ip netns exec <netns>`` (recorded in its
launch record, so a restart lands in the same namespace). ``<home>/hosts.json`` lists what was made, written
before each thing is made, so ``down`` removes all of it, after a crash too; ``down`` also removes ``fw-``
leftovers whose owner (the bridge's alias) is gone.

The first half of this module is pure (names, addresses, command lines, the clean-up plan: unit-tested); the
second runs ``ip`` and ``iptables``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from devstack.errors import StackError
from devstack.slowlink import SLOW_COMMENT, redirect_commands

PREFIX = "fw-"
"""Every namespace and link this module makes starts with it (and nothing else on the machine should)."""
BRIDGE = "fw-br0"
VETH_PREFIX = "fwv-"
"""The root namespace's end of a part's veth pair: ``fwv-<part>`` (the namespace's end is ``eth0``)."""
NS_IFACE = "eth0"
NET = "10.77.0"
PREFIX_LEN = 24
SUBNET = f"{NET}.0/{PREFIX_LEN}"
GATEWAY = f"{NET}.1"
"""The bridge's address, in the root namespace."""
RULE_COMMENT = "flywheel-hosts"
"""Tags the FORWARD rule that lets the bridge's traffic through (Docker sets FORWARD to DROP)."""
CUT_COMMENT = "flywheel-cut"
"""Tags the DROP rules of :func:`cut` inside a namespace."""
STATE_FILE = "hosts.json"
MAX_IFNAME = 15  # IFNAMSIZ - 1
MAX_KAFKA = 5
MAX_TRAINERS = 20
MAX_SAMPLERS = 150
NETNS_DIR = Path("/run/netns")
SYS_NET = Path("/sys/class/net")
INSTALL_HINT = "apt-get install -y iproute2 iptables"

# Where each part lives in 10.77.0.0/24: fixed by its name alone, so any module can tell a part's address.
_BASE = {"kafka": 10, "s3": 20, "paramsync": 21, "admin": 22, "trainer": 30, "sampler": 100}
_PART = re.compile(r"(?P<kind>kafka|trainer|sampler)(?:-(?P<index>[0-9]+))?|(?P<single>s3|paramsync|admin)")


# ---- pure: names and addresses ------------------------------------------------------------------------
def parse_part(name: str) -> tuple[str, int]:
    """A process name -> (kind, index): ``kafka`` -> (kafka, 1) (node 1 is ``kafka``), ``kafka-3`` -> (kafka, 3),
    ``trainer`` -> (trainer, 0) (rank 0), ``trainer-1``, ``sampler-0`` (sampler, 0), ``s3`` / ``paramsync`` /
    ``admin`` -> (name, 0)."""
    m = _PART.fullmatch(name)
    if m is None:
        raise ValueError(f"{name!r} is not a part of the multi-host stack (kafka[-i], s3, trainer[-r], paramsync, "
                         "admin, sampler-<i>)")
    if m["single"]:
        return m["single"], 0
    kind, index = m["kind"], m["index"]
    if kind == "kafka":
        i = 1 if index is None else int(index)
        if not 1 <= i <= MAX_KAFKA or index == "1":  # node 1's process is "kafka"
            raise ValueError(f"{name!r}: Kafka nodes are kafka, kafka-2 .. kafka-{MAX_KAFKA}")
        return kind, i
    if kind == "trainer":
        r = 0 if index is None else int(index)
        if r >= MAX_TRAINERS or index == "0":  # rank 0's process is "trainer"
            raise ValueError(f"{name!r}: trainer ranks are trainer, trainer-1 .. trainer-{MAX_TRAINERS - 1}")
        return kind, r
    if index is None or int(index) >= MAX_SAMPLERS:
        raise ValueError(f"{name!r}: samplers are sampler-0 .. sampler-{MAX_SAMPLERS - 1}")
    return kind, int(index)


def netns_name(name: str) -> str:
    """``fw-kafka-1``, ``fw-s3``, ``fw-trainer-0``, ``fw-paramsync``, ``fw-admin``, ``fw-sampler-<i>``."""
    kind, index = parse_part(name)
    return f"{PREFIX}{kind}" if kind in ("s3", "paramsync", "admin") else f"{PREFIX}{kind}-{index}"


def address(name: str) -> str:
    """The part's address: kafka-i 10.77.0.(10+i), s3 .20, paramsync .21, admin .22, trainer rank r .(30+r),
    sampler-i .(100+i)."""
    kind, index = parse_part(name)
    return f"{NET}.{_BASE[kind] + index}"


def veth_name(name: str) -> str:
    """The root namespace's end of the part's veth pair (at most 15 characters)."""
    veth = VETH_PREFIX + netns_name(name).removeprefix(PREFIX)
    assert len(veth) <= MAX_IFNAME, veth
    return veth


@dataclass(frozen=True)
class Host:
    """One part of the stack on its own test host."""

    name: str
    """The process name (``kafka``, ``kafka-2``, ``s3``, ``trainer``, ``trainer-1``, ``admin``, ``sampler-0``)."""
    netns: str
    address: str
    veth: str


def host(name: str) -> Host:
    return Host(name, netns_name(name), address(name), veth_name(name))


def kafka_names(brokers: int) -> list[str]:
    return ["kafka" if i == 1 else f"kafka-{i}" for i in range(1, brokers + 1)]


def plan(brokers: int, trainers: int, samplers: Iterable[int]) -> list[Host]:
    """Every part's host, in start order: Kafka nodes, S3, trainer ranks, paramsync, admin, samplers."""
    samplers = list(samplers)
    if not 1 <= brokers <= MAX_KAFKA:
        raise StackError(f"the multi-host stack runs 1..{MAX_KAFKA} Kafka nodes, got {brokers}")
    if not 1 <= trainers <= MAX_TRAINERS:
        raise StackError(f"the multi-host stack runs 1..{MAX_TRAINERS} trainer ranks, got {trainers}")
    if any(not 0 <= i < MAX_SAMPLERS for i in samplers):
        raise StackError(f"the multi-host stack runs samplers 0..{MAX_SAMPLERS - 1}, got {samplers}")
    names = [*kafka_names(brokers), "s3", *("trainer" if r == 0 else f"trainer-{r}" for r in range(trainers)),
             "paramsync", "admin", *(f"sampler-{i}" for i in samplers)]
    return [host(n) for n in names]


# ---- pure: command lines -----------------------------------------------------------------------------
def netns_exec(netns: str | None, cmd: Sequence[str]) -> list[str]:
    """``cmd`` run in ``netns`` (``ip netns exec`` execs it: the process keeps ``cmd`` as its command line)."""
    return list(cmd) if netns is None else ["ip", "netns", "exec", netns, *cmd]


FORWARD_RULE = ("FORWARD", "-i", BRIDGE, "-o", BRIDGE, "-m", "comment", "--comment", RULE_COMMENT, "-j", "ACCEPT")
"""Bridged traffic between the parts (with br_netfilter it goes through FORWARD, which Docker sets to DROP)."""


def bridge_commands(owner: str) -> list[list[str]]:
    """Make the bridge, owned by ``owner`` (its alias: the home of the stack that made it), with the gateway."""
    return [["ip", "link", "add", BRIDGE, "type", "bridge"],
            ["ip", "link", "set", BRIDGE, "alias", owner],
            ["ip", "addr", "replace", f"{GATEWAY}/{PREFIX_LEN}", "dev", BRIDGE],
            ["ip", "link", "set", BRIDGE, "up"]]


def host_commands(h: Host, *, netns_exists: bool = False, veth_exists: bool = False) -> list[list[str]]:
    """Make one host: its namespace with loopback up, a veth pair from the bridge, its address (idempotent:
    ``addr replace``; what exists already is not made again)."""
    cmds: list[list[str]] = []
    if not netns_exists:
        cmds.append(["ip", "netns", "add", h.netns])
    cmds.append(["ip", "-n", h.netns, "link", "set", "lo", "up"])
    if not veth_exists:
        cmds.append(["ip", "link", "add", h.veth, "type", "veth", "peer", "name", NS_IFACE, "netns", h.netns])
    cmds += [["ip", "link", "set", h.veth, "master", BRIDGE, "up"],
             ["ip", "-n", h.netns, "addr", "replace", f"{h.address}/{PREFIX_LEN}", "dev", NS_IFACE],
             ["ip", "-n", h.netns, "link", "set", NS_IFACE, "up"]]
    return cmds


DIRECTIONS = ("both", "out", "in")
"""How :func:`cut` drops: ``both`` every packet between the host and the peer; ``out`` only what the host sends
(the peer's packets still arrive); ``in`` only what the peer sends (the host's packets still arrive: the peer
receives and acts on its requests, and the host never sees a reply). A one-way cut breaks a TCP connection in
both directions, but not alike: with ``in`` the peer applies what the host asked (a write, a commit) and the
host, hearing nothing, retries it."""


def cut_commands(netns: str, peers: Iterable[str], action: str = "-A", direction: str = "both") -> list[list[str]]:
    """DROP the packets between ``netns`` and each address of ``peers`` (``direction``: see :data:`DIRECTIONS`),
    inside ``netns``; ``action`` ``-D`` deletes the same rules."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction {direction!r}: one of {', '.join(DIRECTIONS)}")
    tag = ["-m", "comment", "--comment", CUT_COMMENT, "-j", "DROP"]
    cmds = []
    for peer in peers:
        if direction in ("both", "out"):
            cmds.append(["ip", "netns", "exec", netns, "iptables", "-w", action, "OUTPUT", "-d", peer, *tag])
        if direction in ("both", "in"):
            cmds.append(["ip", "netns", "exec", netns, "iptables", "-w", action, "INPUT", "-s", peer, *tag])
    return cmds


def delete_rule_commands(rules: Iterable[str], comment: str, prefix: Sequence[str] = (),
                         table: str | None = None) -> list[list[str]]:
    """``iptables [-t table] -D`` for each line of ``iptables [-t table] -S`` output that carries
    ``--comment <comment>``."""
    t = ["-t", table] if table else []
    out = []
    for line in rules:
        args = shlex.split(line)
        if len(args) > 2 and args[0] == "-A" and _comment(args) == comment:
            out.append([*prefix, "iptables", "-w", *t, "-D", *args[1:]])
    return out


def _comment(args: Sequence[str]) -> str | None:
    for flag, value in zip(args, args[1:], strict=False):
        if flag == "--comment":
            return value
    return None


@dataclass(frozen=True)
class Observed:
    """What of the multi-host network exists on the machine now."""

    netns: tuple[str, ...] = ()
    """Namespaces named ``fw-*``."""
    links: tuple[str, ...] = ()
    """Links of the root namespace named ``fw-*`` / ``fwv-*`` (the bridge, the root ends of the veths)."""
    forward_rules: tuple[str, ...] = ()
    """``iptables -S FORWARD`` lines."""
    owner: str | None = None
    """The bridge's alias: the home of the stack that made it (None: no bridge, or no alias)."""

    @property
    def anything(self) -> bool:
        return bool(self.netns or self.links or any(_comment(shlex.split(r)) == RULE_COMMENT
                                                    for r in self.forward_rules))


def may_clean(home: str, observed: Observed, owner_alive: Callable[[str], bool]) -> bool:
    """Whether the stack in ``home`` may remove the ``fw-`` network it sees: it made it, or the stack that did
    is gone (``owner_alive(owner)`` false: its home has no hosts.json), or nobody owns it (a crash between
    making the namespaces and the bridge's alias, or half a clean-up)."""
    return observed.owner is None or observed.owner == home or not owner_alive(observed.owner)


def cleanup_plan(state: dict[str, Any], observed: Observed) -> list[list[str]]:
    """The commands that remove every namespace, link and rule of the network: those ``state`` (hosts.json)
    records and those ``observed`` on the machine with the ``fw-`` prefix. Namespaces first (a veth goes
    with its namespace), then the root ends still there, the bridge last (its alias tells who
    owns what is left if this is interrupted), then the FORWARD rules."""
    recorded = {h.get("netns") for h in state.get("hosts") or [] if isinstance(h, dict)}
    netns = sorted(n for n in observed.netns if n.startswith(PREFIX) or n in recorded)
    cmds = [["ip", "netns", "del", n] for n in netns]
    links = [x for x in observed.links if x != BRIDGE and x.startswith((PREFIX, VETH_PREFIX))]
    cmds += [["ip", "link", "del", x] for x in sorted(links)]
    if BRIDGE in observed.links:
        cmds.append(["ip", "link", "del", BRIDGE])
    cmds += delete_rule_commands(observed.forward_rules, RULE_COMMENT)
    return cmds


# ---- effects -----------------------------------------------------------------------------------------
Progress = Callable[[str], None]


def state_path(home: Path) -> Path:
    return home / STATE_FILE


def active(home: Path) -> bool:
    """Whether ``home``'s stack is (or was, until its ``down``) a multi-host one: its hosts.json exists."""
    return state_path(home).is_file()


def load_state(home: Path) -> dict[str, Any]:
    try:
        data = json.loads(state_path(home).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_state(home: Path, state: dict[str, Any]) -> None:
    home.mkdir(parents=True, exist_ok=True)
    tmp = state_path(home).with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    tmp.replace(state_path(home))


def tool(name: str) -> str | None:
    """``ip`` / ``iptables``: on PATH, else in /usr/sbin or /sbin (not always on a plain user's PATH)."""
    found = shutil.which(name)
    if found:
        return found
    for d in ("/usr/sbin", "/sbin"):
        if os.access(f"{d}/{name}", os.X_OK):
            return f"{d}/{name}"
    return None


def run(cmd: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    exe = tool(cmd[0]) or cmd[0]
    try:
        out = subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StackError(f"`{shlex.join(cmd)}` failed: {exc}") from None
    if check and out.returncode != 0:
        raise StackError(f"`{shlex.join(cmd)}` failed (exit {out.returncode}): {(out.stderr or out.stdout).strip()}")
    return out


def preflight() -> None:
    """Refuse, saying why, where this machine cannot run test hosts: not root, no ``ip`` / ``iptables``, network
    namespaces that cannot be made, iptables that does not answer, or 10.77.0.0/24 already in use."""
    if os.geteuid() != 0:
        raise StackError("the multi-host stack (--hosts, HOSTS=1) makes network namespaces, veth links, a bridge "
                         "and iptables rules: it must run as root; refusing (run the plain stack without HOSTS)")
    missing = [t for t in ("ip", "iptables") if tool(t) is None]
    if missing:
        raise StackError(f"the multi-host stack needs {' and '.join(missing)}, not found on this machine; "
                         f"install them ({INSTALL_HINT}) and try again")
    probe = f"{PREFIX}probe-{os.getpid()}"
    made = run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        raise StackError("network namespaces cannot be made on this machine (`ip netns add` said: "
                         f"{(made.stderr or made.stdout).strip()}); the multi-host stack cannot run here, refusing")
    gone = run(["ip", "netns", "del", probe], check=False)
    if gone.returncode != 0:
        raise StackError(f"could not remove the probe namespace {probe}: {gone.stderr.strip()}")
    ipt = run(["iptables", "-w", "-S", "FORWARD"], check=False)
    if ipt.returncode != 0:
        raise StackError(f"iptables does not work here (`iptables -S FORWARD` said: {ipt.stderr.strip()}); "
                         "the multi-host stack needs it for its FORWARD rule and to cut links; refusing")
    used = run(["ip", "-o", "-4", "addr", "show"], check=False).stdout
    for line in used.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[1] != BRIDGE and fields[3].startswith(f"{NET}."):
            raise StackError(f"{SUBNET} is already in use on this machine ({fields[1]} has {fields[3]}): the "
                             "multi-host stack needs it for its bridge; refusing")


def observe() -> Observed:
    """The ``fw-`` namespaces and links, the FORWARD rules and the bridge's owner, as they are now."""
    try:
        netns = tuple(sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(PREFIX)))
    except OSError:
        netns = ()
    try:
        links = tuple(sorted(n for n in os.listdir(SYS_NET) if n.startswith((PREFIX, VETH_PREFIX))))
    except OSError:
        links = ()
    rules: tuple[str, ...] = ()
    if tool("iptables") is not None and os.geteuid() == 0:
        out = run(["iptables", "-w", "-S", "FORWARD"], check=False)
        rules = tuple(out.stdout.splitlines()) if out.returncode == 0 else ()
    owner = None
    with contextlib.suppress(OSError):
        owner = (SYS_NET / BRIDGE / "ifalias").read_text().strip() or None
    return Observed(netns, links, rules, owner)


def leftovers_possible() -> bool:
    """Cheap (two directory reads, no process): whether any ``fw-`` namespace or link exists at all."""
    with contextlib.suppress(OSError):
        if any(n.startswith(PREFIX) for n in os.listdir(NETNS_DIR)):
            return True
    with contextlib.suppress(OSError):
        return any(n.startswith((PREFIX, VETH_PREFIX)) for n in os.listdir(SYS_NET))
    return False


def _owner_alive(owner: str) -> bool:
    return active(Path(owner))


def netns_inode(netns: str) -> int | None:
    try:
        return (NETNS_DIR / netns).stat().st_ino
    except OSError:
        return None


def pid_netns_inode(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def root_netns_inode() -> int | None:
    """The namespace this process runs in (the root one, where ``devstack`` runs; pid 1's may not be readable)."""
    return pid_netns_inode(os.getpid())


def ensure_network(home: Path, hosts: Sequence[Host], progress: Progress) -> None:
    """Make (or keep) the bridge, its FORWARD rule and a namespace per host, recording each in hosts.json
    before it is made. Refuses while another stack's network is up. On a failure, removes what it made."""
    home = home.resolve()
    preflight()
    seen = observe()
    if seen.owner is not None and seen.owner != str(home) and _owner_alive(seen.owner):
        raise StackError(f"another multi-host stack (home {seen.owner}) runs on this machine and owns {BRIDGE} and "
                         f"the {PREFIX}* namespaces (one per machine): stop it first with "
                         f"`python -m devstack down --home {seen.owner}`")
    if seen.anything and seen.owner != str(home):
        progress(f"removing leftovers of an earlier multi-host stack (owner {seen.owner or 'unknown'})")
        _clean(load_state(home), seen, progress)
    state = load_state(home)
    state.update(owner=str(home), bridge=BRIDGE, gateway=f"{GATEWAY}/{PREFIX_LEN}", rule=list(FORWARD_RULE))
    recorded = {h["name"]: h for h in state.get("hosts") or [] if isinstance(h, dict)}
    recorded.update({h.name: asdict(h) for h in hosts})
    state["hosts"] = [recorded[n] for n in sorted(recorded, key=lambda n: address(n).split(".")[-1].zfill(3))]
    _save_state(home, state)  # before anything is made: a crash from here on leaves a list to clean up
    started = time.monotonic()
    try:
        if not (SYS_NET / BRIDGE).exists():
            for cmd in bridge_commands(str(home)):
                run(cmd)
        else:
            run(["ip", "link", "set", BRIDGE, "alias", str(home)])
            run(["ip", "addr", "replace", f"{GATEWAY}/{PREFIX_LEN}", "dev", BRIDGE])
            run(["ip", "link", "set", BRIDGE, "up"])
        if run(["iptables", "-w", "-C", *FORWARD_RULE], check=False).returncode != 0:
            run(["iptables", "-w", "-I", *FORWARD_RULE])
        made = 0
        for h in hosts:
            ns_there, veth_there = (NETNS_DIR / h.netns).exists(), (SYS_NET / h.veth).exists()
            for cmd in host_commands(h, netns_exists=ns_there, veth_exists=veth_there):
                run(cmd)
            made += not (ns_there and veth_there)
    except StackError:
        progress("making the multi-host network failed; removing what was made")
        with contextlib.suppress(StackError):
            teardown(home, progress)
        raise
    progress(f"network: bridge {BRIDGE} {GATEWAY}/{PREFIX_LEN}, {len(hosts)} hosts ({made} made) in "
             f"{time.monotonic() - started:.1f} s; `python -m devstack hosts` lists them")


def prune(home: Path, keep: Sequence[Host], progress: Progress) -> list[str]:
    """Remove the hosts ``home``'s hosts.json records beyond ``keep`` (samplers or ranks scaled down, their
    processes stopped already): namespace, veth, record. Returns their names."""
    state = load_state(home)
    wanted = {h.name for h in keep}
    gone = [h for h in state.get("hosts") or [] if isinstance(h, dict) and h.get("name") not in wanted]
    for h in gone:
        ns, veth = str(h["netns"]), str(h["veth"])
        if (NETNS_DIR / ns).exists():
            _end_processes(ns, progress)
            run(["ip", "netns", "del", ns])
        if (SYS_NET / veth).exists():
            run(["ip", "link", "del", veth], check=False)
    if gone:
        state["hosts"] = [h for h in state.get("hosts") or [] if isinstance(h, dict) and h.get("name") in wanted]
        _save_state(home, state)
        progress(f"removed the hosts of {', '.join(str(h['name']) for h in gone)} (scaled down)")
    return [str(h["name"]) for h in gone]


def teardown(home: Path, progress: Progress, *, force: bool = False, orphans_only: bool = False) -> bool:
    """Remove every namespace, link and rule of the multi-host network (hosts.json's and any ``fw-`` leftover),
    ending whatever still runs in those namespaces (every process there is this stack's), then hosts.json.
    Another live stack's network is left alone unless ``force`` (silently with ``orphans_only``: a plain stack's
    ``down`` removes only leftovers nobody owns). True when something was removed."""
    home = home.resolve()
    state, seen = load_state(home), observe()
    if not seen.anything:
        state_path(home).unlink(missing_ok=True)
        return False
    if not force and not may_clean(str(home), seen, _owner_alive):
        if not orphans_only:
            progress(f"the {PREFIX}* network belongs to the stack in {seen.owner}: left alone "
                     f"(`python -m devstack down --home {seen.owner}` removes it)")
        return False
    if orphans_only:
        progress(f"removing leftovers of a multi-host stack (owner {seen.owner or 'unknown'})")
    _clean(state, seen, progress)
    state_path(home).unlink(missing_ok=True)
    return True


def _clean(state: dict[str, Any], seen: Observed, progress: Progress) -> None:
    if os.geteuid() != 0:
        raise StackError(f"removing the {PREFIX}* network needs root (it was made as root)")
    for ns in seen.netns:
        _end_processes(ns, progress)
    errors = []
    for cmd in cleanup_plan(state, seen):
        out = run(cmd, check=False)
        if out.returncode != 0 and "Cannot find device" not in out.stderr and "No such file" not in out.stderr:
            errors.append(f"`{shlex.join(cmd)}`: {out.stderr.strip()}")
    after = observe()
    if after.anything:
        errors.append(f"still there: namespaces {list(after.netns)}, links {list(after.links)}, rules "
                      f"{[r for r in after.forward_rules if RULE_COMMENT in r]}")
    if errors:
        raise StackError("removing the multi-host network: " + "; ".join(errors))
    rules = sum(_comment(shlex.split(r)) == RULE_COMMENT for r in seen.forward_rules)
    bridge = f"bridge {BRIDGE} and " if BRIDGE in seen.links else ""
    progress(f"network removed: {len(seen.netns)} namespace(s), {bridge}{len(seen.links) - bool(bridge)} other "
             f"link(s) of the root namespace, {rules} FORWARD rule(s)")


def _end_processes(netns: str, progress: Progress, timeout_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL, whatever still runs in one of this stack's namespaces (``down`` stopped the
    parts by pid already; this is what a crash left)."""
    out = run(["ip", "netns", "pids", netns], check=False)
    pids = [int(p) for p in out.stdout.split() if p.isdigit()]
    if not pids:
        return
    progress(f"{netns}: ending {len(pids)} process(es) still in it: {pids}")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            if not pids:
                return
            time.sleep(0.1)


def _alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


# ---- cutting links ----------------------------------------------------------------------------------
def cut(name: str, peers: Iterable[str], direction: str = "both") -> list[str]:
    """Inside ``name``'s namespace, DROP everything to and from each of ``peers`` (part names; ``direction``
    ``out`` / ``in``: one way only, see :data:`DIRECTIONS`); returns their addresses. :func:`heal` undoes it."""
    h = host(name)
    addrs = [address(p) for p in peers]
    for cmd in cut_commands(h.netns, addrs, "-A", direction):
        run(cmd)
    return addrs


SLOW_PORT = 15999
"""The slow-link proxy's port inside a slowed part's namespace (``devstack.slowlink``)."""


def slow_commands(netns: str, peers: Sequence[str], port: int = SLOW_PORT) -> list[list[str]]:
    """The commands of :func:`slow`: new connections to ``peers`` REDIRECTed to the proxy, then the sockets already
    connected to them destroyed (``ss -K``: the process sees its connection aborted at once and reconnects,
    through the proxy)."""
    return [*redirect_commands(netns, peers, port),
            *(["ip", "netns", "exec", netns, "ss", "-K", "dst", peer] for peer in peers)]


def slow(name: str, peers: Iterable[str], delay_ms: float, rate_kbps: float, log: Path) -> list[str]:
    """Make ``name``'s links to ``peers`` slow: a ``devstack.slowlink`` proxy in its namespace adds ``delay_ms``
    each way and caps each connection at ``rate_kbps`` kB/s a direction; its open connections to them are aborted
    and reopened through it. :func:`heal` undoes it. Returns the peers' addresses."""
    h = host(name)
    addrs = [address(p) for p in peers]
    with log.open("ab") as out:
        subprocess.Popen(["ip", "netns", "exec", h.netns, sys.executable, "-m", "devstack.slowlink", "--port",
                          str(SLOW_PORT), "--delay-ms", str(delay_ms), "--rate-kbps", str(rate_kbps)],
                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 20
    probe = f"import socket; socket.create_connection(('127.0.0.1', {SLOW_PORT}), timeout=1).close()"
    while run(["ip", "netns", "exec", h.netns, sys.executable, "-c", probe], check=False).returncode != 0:
        if time.monotonic() > deadline:
            raise StackError(f"the slow-link proxy in {h.netns} did not listen on {SLOW_PORT} (see {log})")
        time.sleep(0.3)
    for cmd in slow_commands(h.netns, addrs):
        run(cmd, check=cmd[-3:-1] != ["-K", "dst"])  # ss may find nothing to abort
    return addrs


def heal(name: str) -> int:
    """Remove every :func:`cut` and :func:`slow` rule inside ``name``'s namespace and stop its slow-link proxy;
    the number of rules removed."""
    h = host(name)
    prefix = ["ip", "netns", "exec", h.netns]
    n = 0
    for table, chains, comment in ((None, ("OUTPUT", "INPUT"), CUT_COMMENT), ("nat", ("OUTPUT",), SLOW_COMMENT)):
        t = ["-t", table] if table else []
        for chain in chains:
            rules = run([*prefix, "iptables", "-w", *t, "-S", chain]).stdout.splitlines()
            for cmd in delete_rule_commands(rules, comment, prefix, table):
                run(cmd)
                n += 1
    for pid in (int(p) for p in run(["ip", "netns", "pids", h.netns], check=False).stdout.split() if p.isdigit()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"devstack.slowlink" in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    return n


@dataclass(frozen=True)
class Row:
    """One line of ``python -m devstack hosts``."""

    name: str
    netns: str
    address: str
    pid: int | None
    where: str = field(default="")
    """Empty when the pid lives in ``netns``; else where it does (``root namespace!``, ``other namespace!``)."""


def rows(home: Path, pids: dict[str, int | None]) -> list[Row]:
    """Each recorded host with the live pid of its part (``pids``: process name -> pid) and whether that
    process really lives in the part's namespace."""
    root = root_netns_inode()
    out = []
    for h in load_state(home).get("hosts") or []:
        if not isinstance(h, dict):
            continue
        pid = pids.get(h["name"])
        where = ""
        if pid is not None:
            ino = pid_netns_inode(pid)
            if ino is None:
                where = "gone"
            elif ino == root:
                where = "root namespace!"
            elif ino != netns_inode(h["netns"]):
                where = "other namespace!"
        out.append(Row(h["name"], h["netns"], h["address"], pid, where))
    return out


def format_rows(table: Sequence[Row]) -> list[str]:
    lines = [f"{'NAME':<11} {'NETNS':<15} {'ADDRESS':<12} PID"]
    for r in table:
        pid = "-" if r.pid is None else str(r.pid)
        lines.append(f"{r.name:<11} {r.netns:<15} {r.address:<12} {pid}{f'  ({r.where})' if r.where else ''}")
    return lines
