"""The multi-host local stack's pure parts (devstack.hosts): names, the address plan, command lines, the clean-up
plan, the refusals; and how the plain stack's pieces take an address (127.0.0.1 unless hosts). Nothing here makes a
namespace: tests/hosts/ runs the real thing (root, `-m hosts`)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from devstack import forward, kafka, s3
from devstack import hosts as mh
from devstack.config import InfraConfig, InfraEndpoints, StackError
from devstack.procs import Proc
from devstack.stack import LocalStack

# ---- names and addresses ------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "netns", "addr", "veth"), [
    ("kafka", "fw-kafka-1", "10.77.0.11", "fwv-kafka-1"),
    ("kafka-3", "fw-kafka-3", "10.77.0.13", "fwv-kafka-3"),
    ("s3", "fw-s3", "10.77.0.20", "fwv-s3"),
    ("paramsync", "fw-paramsync", "10.77.0.21", "fwv-paramsync"),
    ("admin", "fw-admin", "10.77.0.22", "fwv-admin"),
    ("trainer", "fw-trainer-0", "10.77.0.30", "fwv-trainer-0"),
    ("trainer-1", "fw-trainer-1", "10.77.0.31", "fwv-trainer-1"),
    ("sampler-0", "fw-sampler-0", "10.77.0.100", "fwv-sampler-0"),
    ("sampler-149", "fw-sampler-149", "10.77.0.249", "fwv-sampler-149"),
])
def test_each_part_has_its_namespace_address_and_link(name: str, netns: str, addr: str, veth: str) -> None:
    assert mh.host(name) == mh.Host(name, netns, addr, veth)


@pytest.mark.parametrize("name", ["kafka-1", "kafka-6", "trainer-0", "trainer-20", "sampler", "sampler-150",
                                  "prometheus", "kafka-x", ""])
def test_names_that_are_no_part_are_refused(name: str) -> None:
    with pytest.raises(ValueError):
        mh.host(name)


def test_the_largest_plan_has_distinct_addresses_namespaces_and_short_link_names() -> None:
    hosts = mh.plan(mh.MAX_KAFKA, mh.MAX_TRAINERS, range(mh.MAX_SAMPLERS))
    assert len(hosts) == mh.MAX_KAFKA + 1 + mh.MAX_TRAINERS + 2 + mh.MAX_SAMPLERS
    for attr in ("name", "netns", "address", "veth"):
        values = [getattr(h, attr) for h in hosts]
        assert len(set(values)) == len(values), attr
    assert all(len(h.veth) <= 15 and h.veth.startswith(mh.VETH_PREFIX) for h in hosts)
    assert all(h.netns.startswith(mh.PREFIX) for h in hosts)
    last = [int(h.address.rsplit(".", 1)[1]) for h in hosts]
    assert all(1 < octet < 255 for octet in last) and mh.GATEWAY == "10.77.0.1"


def test_the_plan_lists_every_part_in_start_order() -> None:
    names = [h.name for h in mh.plan(3, 2, [0, 1])]
    assert names == ["kafka", "kafka-2", "kafka-3", "s3", "trainer", "trainer-1", "paramsync", "admin",
                     "sampler-0", "sampler-1"]


@pytest.mark.parametrize(("brokers", "trainers", "samplers"), [(0, 1, [0]), (6, 1, [0]), (1, 0, [0]),
                                                               (1, 21, [0]), (1, 1, [150])])
def test_the_plan_refuses_what_the_subnet_cannot_hold(brokers: int, trainers: int, samplers: list[int]) -> None:
    with pytest.raises(StackError):
        mh.plan(brokers, trainers, samplers)


# ---- command lines ------------------------------------------------------------------------------------


def test_netns_exec_prefixes_only_with_a_namespace() -> None:
    assert mh.netns_exec(None, ["java", "-x"]) == ["java", "-x"]
    assert mh.netns_exec("fw-s3", ["moto"]) == ["ip", "netns", "exec", "fw-s3", "moto"]


def test_bridge_commands_make_an_owned_bridge_with_the_gateway() -> None:
    assert mh.bridge_commands("/h") == [
        ["ip", "link", "add", "fw-br0", "type", "bridge"],
        ["ip", "link", "set", "fw-br0", "alias", "/h"],
        ["ip", "addr", "replace", "10.77.0.1/24", "dev", "fw-br0"],
        ["ip", "link", "set", "fw-br0", "up"],
    ]


def test_host_commands_make_a_namespace_a_veth_and_the_address() -> None:
    h = mh.host("kafka-2")
    assert mh.host_commands(h) == [
        ["ip", "netns", "add", "fw-kafka-2"],
        ["ip", "-n", "fw-kafka-2", "link", "set", "lo", "up"],
        ["ip", "link", "add", "fwv-kafka-2", "type", "veth", "peer", "name", "eth0", "netns", "fw-kafka-2"],
        ["ip", "link", "set", "fwv-kafka-2", "master", "fw-br0", "up"],
        ["ip", "-n", "fw-kafka-2", "addr", "replace", "10.77.0.12/24", "dev", "eth0"],
        ["ip", "-n", "fw-kafka-2", "link", "set", "eth0", "up"],
    ]
    again = mh.host_commands(h, netns_exists=True, veth_exists=True)
    assert not any(c[:3] in (["ip", "netns", "add"], ["ip", "link", "add"]) for c in again)


def test_the_forward_rule_accepts_the_bridges_traffic_and_is_tagged() -> None:
    rule = list(mh.FORWARD_RULE)
    assert rule[0] == "FORWARD" and rule[-2:] == ["-j", "ACCEPT"]
    assert rule[rule.index("-i") + 1] == rule[rule.index("-o") + 1] == "fw-br0"
    assert rule[rule.index("--comment") + 1] == mh.RULE_COMMENT


def test_cut_drops_both_ways_inside_the_namespace_and_heal_deletes_the_same_rules() -> None:
    cut = mh.cut_commands("fw-trainer-0", ["10.77.0.11"])
    assert cut == [
        ["ip", "netns", "exec", "fw-trainer-0", "iptables", "-w", "-A", "OUTPUT", "-d", "10.77.0.11",
         "-m", "comment", "--comment", "flywheel-cut", "-j", "DROP"],
        ["ip", "netns", "exec", "fw-trainer-0", "iptables", "-w", "-A", "INPUT", "-s", "10.77.0.11",
         "-m", "comment", "--comment", "flywheel-cut", "-j", "DROP"],
    ]
    assert [c[6] for c in mh.cut_commands("fw-trainer-0", ["10.77.0.11"], "-D")] == ["-D", "-D"]


def test_a_one_way_cut_drops_one_chain_only() -> None:
    out = mh.cut_commands("fw-trainer-0", ["10.77.0.11", "10.77.0.12"], direction="out")
    assert [(c[7], c[8], c[9]) for c in out] == [("OUTPUT", "-d", "10.77.0.11"), ("OUTPUT", "-d", "10.77.0.12")]
    into = mh.cut_commands("fw-trainer-0", ["10.77.0.11"], "-D", direction="in")
    assert [(c[6], c[7], c[8], c[9]) for c in into] == [("-D", "INPUT", "-s", "10.77.0.11")]
    assert all(c[-4:] == ["--comment", "flywheel-cut", "-j", "DROP"] for c in out + into)  # heal finds them
    with pytest.raises(ValueError, match="direction"):
        mh.cut_commands("fw-trainer-0", ["10.77.0.11"], direction="sideways")


def test_rules_are_deleted_by_their_comment_only() -> None:
    rules = ["-P FORWARD DROP",
             "-A FORWARD -j DOCKER-USER",
             '-A FORWARD -i fw-br0 -o fw-br0 -m comment --comment flywheel-hosts -j ACCEPT',
             '-A FORWARD -i br-x -m comment --comment "someone else" -j ACCEPT']
    assert mh.delete_rule_commands(rules, mh.RULE_COMMENT) == [
        ["iptables", "-w", "-D", "FORWARD", "-i", "fw-br0", "-o", "fw-br0", "-m", "comment", "--comment",
         "flywheel-hosts", "-j", "ACCEPT"]]
    assert mh.delete_rule_commands(rules, "flywheel-cut", ["ip", "netns", "exec", "fw-x"]) == []
    nat = ["-A OUTPUT -p tcp -d 10.77.0.11 -m comment --comment flywheel-slow -j REDIRECT --to-ports 15999"]
    assert mh.delete_rule_commands(nat, "flywheel-slow", ["ip", "netns", "exec", "fw-x"], "nat") == [
        ["ip", "netns", "exec", "fw-x", "iptables", "-w", "-t", "nat", "-D", "OUTPUT", "-p", "tcp", "-d", "10.77.0.11",
         "-m", "comment", "--comment", "flywheel-slow", "-j", "REDIRECT", "--to-ports", "15999"]]


# ---- the clean-up plan --------------------------------------------------------------------------------

FWD = "-A FORWARD -i fw-br0 -o fw-br0 -m comment --comment flywheel-hosts -j ACCEPT"


def test_cleanup_removes_namespaces_then_root_links_then_the_bridge_then_the_rule() -> None:
    seen = mh.Observed(netns=("fw-kafka-1", "fw-s3"), links=("fw-br0", "fwv-kafka-1", "fwv-s3"),
                       forward_rules=("-P FORWARD ACCEPT", FWD), owner="/h")
    state = {"hosts": [{"name": "kafka", "netns": "fw-kafka-1"}, {"name": "sampler-0", "netns": "fw-sampler-0"}]}
    assert mh.cleanup_plan(state, seen) == [
        ["ip", "netns", "del", "fw-kafka-1"],
        ["ip", "netns", "del", "fw-s3"],  # not recorded (a crash before hosts.json was written): by its prefix
        ["ip", "link", "del", "fwv-kafka-1"],
        ["ip", "link", "del", "fwv-s3"],
        ["ip", "link", "del", "fw-br0"],
        ["iptables", "-w", "-D", "FORWARD", "-i", "fw-br0", "-o", "fw-br0", "-m", "comment", "--comment",
         "flywheel-hosts", "-j", "ACCEPT"],
    ]  # fw-sampler-0 is recorded but gone: nothing to do for it


def test_nothing_to_clean_is_an_empty_plan() -> None:
    seen = mh.Observed(forward_rules=("-P FORWARD ACCEPT", "-A FORWARD -j DOCKER-USER"))
    assert not seen.anything
    assert mh.cleanup_plan({}, seen) == []
    assert mh.Observed(forward_rules=(FWD,)).anything


@pytest.mark.parametrize(("owner", "alive", "may"), [(None, False, True), ("/h", True, True), ("/other", True, False),
                                                     ("/other", False, True)])
def test_another_live_stacks_network_is_not_ours_to_clean(owner: str | None, alive: bool, may: bool) -> None:
    seen = mh.Observed(netns=("fw-s3",), owner=owner)
    assert mh.may_clean("/h", seen, lambda _o: alive) is may


class FakeMachine:
    """``ip`` / ``iptables`` as a list of calls, with the namespaces, links and rules they act on."""

    def __init__(self, seen: mh.Observed) -> None:
        self.seen = seen
        self.calls: list[list[str]] = []

    def run(self, cmd: list[str], *, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(cmd))
        if cmd[:3] == ["ip", "netns", "del"]:
            self.seen = mh.Observed(tuple(n for n in self.seen.netns if n != cmd[3]), self.seen.links,
                                    self.seen.forward_rules, self.seen.owner)
        elif cmd[:3] == ["ip", "link", "del"]:
            self.seen = mh.Observed(self.seen.netns, tuple(x for x in self.seen.links if x != cmd[3]),
                                    self.seen.forward_rules, None if cmd[3] == mh.BRIDGE else self.seen.owner)
        elif cmd[:3] == ["iptables", "-w", "-D"]:
            self.seen = mh.Observed(self.seen.netns, self.seen.links, (), self.seen.owner)
        return subprocess.CompletedProcess(cmd, 0, "", "")


def test_teardown_after_a_crash_removes_everything_and_the_state_file(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / mh.STATE_FILE).write_text(json.dumps({"owner": str(tmp_path), "hosts": [
        {"name": "s3", "netns": "fw-s3", "address": "10.77.0.20", "veth": "fwv-s3"}]}))
    machine = FakeMachine(mh.Observed(("fw-s3",), ("fw-br0", "fwv-s3"), (FWD,), str(tmp_path)))
    monkeypatch.setattr(mh, "run", machine.run)
    monkeypatch.setattr(mh, "observe", lambda: machine.seen)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    said: list[str] = []
    assert mh.teardown(tmp_path, said.append) is True
    assert ["ip", "netns", "pids", "fw-s3"] in machine.calls  # what a crash left running there is ended first
    assert not machine.seen.anything and not (tmp_path / mh.STATE_FILE).exists()
    assert any("network removed" in s for s in said)


def test_a_plain_down_leaves_a_live_stacks_network_alone_silently(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / mh.STATE_FILE).write_text("{}")
    machine = FakeMachine(mh.Observed(("fw-s3",), ("fw-br0",), (FWD,), str(other)))
    monkeypatch.setattr(mh, "run", machine.run)
    monkeypatch.setattr(mh, "observe", lambda: machine.seen)
    said: list[str] = []
    assert mh.teardown(tmp_path / "mine", said.append, orphans_only=True) is False
    assert machine.calls == [] and said == []
    assert mh.teardown(tmp_path / "mine", said.append) is False and "left alone" in said[0]


# ---- refusals -----------------------------------------------------------------------------------------


def test_refuses_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(StackError, match="must run as root; refusing"):
        mh.preflight()


def test_refuses_without_ip_or_iptables_and_says_how_to_install_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(mh, "tool", lambda name: None if name == "iptables" else "/usr/sbin/ip")
    with pytest.raises(StackError, match=r"needs iptables, not found.*apt-get install -y iproute2 iptables"):
        mh.preflight()


def test_refuses_where_namespaces_cannot_be_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(mh, "tool", lambda name: f"/usr/sbin/{name}")

    def run(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        failed = cmd[:3] == ["ip", "netns", "add"]
        return subprocess.CompletedProcess(cmd, 1 if failed else 0, "", "mount --make-shared /run/netns failed: "
                                           "Operation not permitted" if failed else "")

    monkeypatch.setattr(mh, "run", run)
    with pytest.raises(StackError, match="network namespaces cannot be made on this machine.*Operation not permitted"):
        mh.preflight()


def test_refuses_when_the_subnet_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(mh, "tool", lambda name: f"/usr/sbin/{name}")

    def run(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        out = "3: eth1    inet 10.77.0.5/24 brd 10.77.0.255 scope global eth1\n" if "addr" in cmd else ""
        return subprocess.CompletedProcess(cmd, 0, out, "")

    monkeypatch.setattr(mh, "run", run)
    with pytest.raises(StackError, match="already in use.*eth1"):
        mh.preflight()


def test_another_live_stack_owning_the_network_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / mh.STATE_FILE).write_text("{}")
    monkeypatch.setattr(mh, "preflight", lambda: None)
    monkeypatch.setattr(mh, "observe", lambda: mh.Observed(("fw-s3",), ("fw-br0",), (), str(other)))
    with pytest.raises(StackError, match=f"another multi-host stack \\(home {other}\\)"):
        mh.ensure_network(tmp_path / "mine", mh.plan(1, 1, [0]), lambda _m: None)


# ---- where the plain stack's pieces listen ------------------------------------------------------------


def test_infra_listens_on_loopback_unless_hosts(tmp_path: Path) -> None:
    plain = InfraConfig.resolve(tmp_path, brokers=3, hosts=False)
    assert plain.endpoints.kafka_bootstrap == "127.0.0.1:9092,127.0.0.1:9094,127.0.0.1:9096"
    assert plain.netns("kafka") is None and "-H 127.0.0.1 " in " ".join(s3.command(plain)) + " "
    props = kafka.server_properties(plain, plain.kafka_nodes[1])
    assert "listeners=PLAINTEXT://127.0.0.1:9094,CONTROLLER://127.0.0.1:9095" in props
    assert "KRaft on 127.0.0.1." in props


def test_each_broker_listens_on_and_advertises_its_hosts_address(tmp_path: Path) -> None:
    cfg = InfraConfig.resolve(tmp_path, brokers=3, hosts=True)
    assert cfg.endpoints.kafka_bootstrap == "10.77.0.11:9092,10.77.0.12:9094,10.77.0.13:9096"
    assert cfg.endpoints.s3_endpoint == "http://10.77.0.20:9000"
    assert [cfg.netns(n.name) for n in cfg.kafka_nodes] == ["fw-kafka-1", "fw-kafka-2", "fw-kafka-3"]
    props = kafka.server_properties(cfg, cfg.kafka_nodes[1])
    assert "listeners=PLAINTEXT://10.77.0.12:9094,CONTROLLER://10.77.0.12:9095\n" in props
    assert "advertised.listeners=PLAINTEXT://10.77.0.12:9094\n" in props
    assert "controller.quorum.voters=1@10.77.0.11:9093,2@10.77.0.12:9095,3@10.77.0.13:9097\n" in props
    cmd = s3.command(cfg)
    assert cmd[cmd.index("-H") + 1] == "10.77.0.20"


def test_a_home_with_hosts_json_is_a_multi_host_one(tmp_path: Path) -> None:
    assert InfraConfig.resolve(tmp_path).hosts is False
    (tmp_path / mh.STATE_FILE).write_text("{}")
    assert InfraConfig.resolve(tmp_path).hosts is True


def _hosts_stack(tmp_path: Path, trainers: int) -> LocalStack:
    stack = LocalStack(tmp_path, hosts=True, trainers=trainers, progress=lambda _m: None)
    stack._infra = InfraEndpoints("10.77.0.11:9092", "http://10.77.0.20:9000", "flywheel")  # noqa: SLF001
    return stack


def test_services_listen_on_their_hosts_and_ranks_rendezvous_at_rank_0s(tmp_path: Path) -> None:
    stack = _hosts_stack(tmp_path, trainers=2)
    env1 = stack.service_env("trainer", 1)
    assert env1["FLYWHEEL_HTTP_HOST"] == "10.77.0.31" and env1["FLYWHEEL_TRAINER_RENDEZVOUS"] == "10.77.0.30:29500"
    assert env1["GLOO_SOCKET_IFNAME"] == "eth0" and env1["FLYWHEEL_KAFKA_BOOTSTRAP"] == "10.77.0.11:9092"
    assert stack.service_env("sampler", 3)["FLYWHEEL_HTTP_HOST"] == "10.77.0.103"
    assert stack.netns("sampler", 3) == "fw-sampler-3" and stack.netns("trainer") == "fw-trainer-0"
    assert stack.admin_url == "http://10.77.0.22:8080"


def test_the_plain_stack_keeps_loopback(tmp_path: Path) -> None:
    stack = LocalStack(tmp_path, trainers=2, infra=InfraEndpoints("127.0.0.1:1", "http://127.0.0.1:2", "flywheel"),
                       progress=lambda _m: None)
    env = stack.service_env("trainer", 1)
    assert stack.hosts is False and stack.netns("trainer") is None
    assert env["FLYWHEEL_HTTP_HOST"] == "127.0.0.1" and env["FLYWHEEL_TRAINER_RENDEZVOUS"] == "127.0.0.1:29500"
    assert env.get("GLOO_SOCKET_IFNAME") == os.environ.get("GLOO_SOCKET_IFNAME")  # as the caller's, untouched
    assert stack.admin_url == "http://127.0.0.1:8080"


def test_hosts_needs_the_stacks_own_infra(tmp_path: Path) -> None:
    with pytest.raises(StackError, match="its own Kafka and S3"):
        LocalStack(tmp_path, hosts=True, infra=InfraEndpoints("a:1", "http://b:2", "flywheel"))


# ---- launch records -----------------------------------------------------------------------------------


def test_a_plain_launch_record_is_as_before_and_a_namespaced_one_runs_ip_netns_exec(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = Proc(tmp_path, "sleeper")
    pid = plain.spawn(["sleep", "30"], cwd=tmp_path)
    try:
        assert "netns" not in json.loads(plain.record_path.read_text())
        assert plain.pid() == pid and plain.record().netns is None  # type: ignore[union-attr]
    finally:
        plain.stop(timeout_s=5)

    started: list[list[str]] = []

    class Popen:
        def __init__(self, argv: list[str], **_: Any) -> None:
            started.append(argv)
            self.pid, self.returncode = 2**22 + 7, None

    monkeypatch.setattr("devstack.procs.subprocess.Popen", Popen)
    monkeypatch.setattr("devstack.procs.SPAWN_SETTLE_S", 0.0)
    boxed = Proc(tmp_path, "boxed")
    boxed.spawn(["sleep", "30"], cwd=tmp_path, netns="fw-s3")
    assert started[0][1:] == ["netns", "exec", "fw-s3", "sleep", "30"] and started[0][0].endswith("ip")
    record = boxed.record()
    assert record is not None and record.cmd == ["sleep", "30"] and record.netns == "fw-s3"  # respawn: same netns


# ---- hosts table and the admin forwarder --------------------------------------------------------------


def test_the_hosts_table_flags_a_part_outside_its_namespace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / mh.STATE_FILE).write_text(json.dumps({"hosts": [mh.host("admin").__dict__, mh.host("s3").__dict__]}))
    monkeypatch.setattr(mh, "pid_netns_inode", lambda pid: {11: 500, 12: 100}.get(pid))
    monkeypatch.setattr(mh, "root_netns_inode", lambda: 100)
    monkeypatch.setattr(mh, "netns_inode", lambda ns: 500 if ns == "fw-admin" else 600)
    lines = mh.format_rows(mh.rows(tmp_path, {"admin": 11, "s3": 12}))
    assert lines[0].split() == ["NAME", "NETNS", "ADDRESS", "PID"]
    assert lines[1].split() == ["admin", "fw-admin", "10.77.0.22", "11"]
    assert lines[2].split()[:4] == ["s3", "fw-s3", "10.77.0.20", "12"] and "root namespace!" in lines[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_forwarder_carries_bytes_both_ways() -> None:
    async def main() -> bytes:
        async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            w.write(b"echo:" + await r.readline())
            await w.drain()
            w.close()

        target = await asyncio.start_server(echo, "127.0.0.1", 0)
        tport = target.sockets[0].getsockname()[1]
        lport, stop = _free_port(), asyncio.Event()
        task = asyncio.create_task(forward.serve(("127.0.0.1", lport), ("127.0.0.1", tport), stop))
        await asyncio.sleep(0.2)
        r, w = await asyncio.open_connection("127.0.0.1", lport)
        w.write(b"hello\n")
        await w.drain()
        got = await asyncio.wait_for(r.read(), 5)
        w.close()
        stop.set()
        await task
        target.close()
        return got

    assert asyncio.run(main()) == b"echo:hello\n"
    assert forward.parse_addr("10.77.0.22:8080") == ("10.77.0.22", 8080)
    with pytest.raises(ValueError):
        forward.parse_addr("8080")


def test_scaling_down_removes_the_hosts_no_longer_wanted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    netns_dir, sys_net = tmp_path / "netns", tmp_path / "net"
    netns_dir.mkdir()
    sys_net.mkdir()
    hosts = mh.plan(1, 1, [0, 1, 2])
    for h in hosts:
        (netns_dir / h.netns).touch()
        (sys_net / h.veth).touch()
    home = tmp_path / "home"
    home.mkdir()
    (home / mh.STATE_FILE).write_text(json.dumps({"hosts": [h.__dict__ for h in hosts]}))
    calls: list[list[str]] = []
    monkeypatch.setattr(mh, "NETNS_DIR", netns_dir)
    monkeypatch.setattr(mh, "SYS_NET", sys_net)
    monkeypatch.setattr(mh, "run", lambda cmd, **_: calls.append(list(cmd)) or subprocess.CompletedProcess(cmd, 0, "",
                                                                                                             ""))
    assert mh.prune(home, mh.plan(1, 1, [0]), lambda _m: None) == ["sampler-1", "sampler-2"]
    assert ["ip", "netns", "del", "fw-sampler-1"] in calls and ["ip", "link", "del", "fwv-sampler-2"] in calls
    assert not any("fw-sampler-0" in c or "fw-trainer-0" in c for c in calls)
    kept = [h["name"] for h in json.loads((home / mh.STATE_FILE).read_text())["hosts"]]
    assert kept == ["kafka", "s3", "trainer", "paramsync", "admin", "sampler-0"]
