"""Several node agents, each in its own network namespace, each watching some ranks of one simulated job;
the cluster analyzer pulls them over the namespaces' addresses and makes one diagnosis of the whole job.

Agents enter only the namespace's network (`nsenter --net`): `ip netns exec` would also remount /sys, hiding
the tracefs that uprobes need. Each namespace has a veth pair to the root namespace: 10.77.X.(4i+1) on the
root side, 10.77.X.(4i+2) on the agent's, with X from this test run's PID so that parallel runs do not clash.
"""
from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from conftest import RANKSCOPE, free_port, wait_until

TOKEN = "netns-test-token"
PORT = 9464
NODES = 3
RANKS_PER_NODE = 2
SLOW_RANK = 3  # on node 1


@dataclass
class Node:
    name: str  # the namespace, also the agent's NODE_NAME
    veth: str  # root-side interface
    address: str  # the agent's address inside the namespace


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def nodes() -> Iterator[list[Node]]:
    tag = os.getpid() % 250
    made: list[Node] = []
    try:
        for i in range(NODES):
            node = Node(f"rs{os.getpid()}-n{i}", f"rsv{os.getpid() % 100000}x{i}", f"10.77.{tag}.{4 * i + 2}")
            _ip("netns", "add", node.name)
            made.append(node)
            _ip("link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", node.name)
            _ip("addr", "add", f"10.77.{tag}.{4 * i + 1}/30", "dev", node.veth)
            _ip("link", "set", node.veth, "up")
            for cmd in (["addr", "add", f"{node.address}/30", "dev", "eth0"], ["link", "set", "eth0", "up"],
                        ["link", "set", "lo", "up"]):
                _ip("-n", node.name, *cmd)
        yield made
    finally:
        for node in made:  # deleting the namespace deletes its veth end, and with it the pair
            subprocess.run(["ip", "netns", "del", node.name], capture_output=True)
            subprocess.run(["ip", "link", "del", node.veth], capture_output=True)


def _get(url: str, token: str | None = TOKEN):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def test_one_diagnosis_over_agents_in_network_namespaces(sim_job, nodes, procs, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    job = sim_job(NODES * RANKS_PER_NODE, faults=(f"slow-gpu:{SLOW_RANK}:2.5",))
    for i, node in enumerate(nodes):
        pids = job.pids[i * RANKS_PER_NODE:(i + 1) * RANKS_PER_NODE]
        procs.append(subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{node.name}", *RANKSCOPE, "agent", "--listen", f"{node.address}:{PORT}",
             "--pid", ",".join(map(str, pids)), "--token-file", str(token_file), "--window", "1.5"],
            env={**os.environ, "NODE_NAME": node.name}, stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / f"{node.name}.log", "w"), text=True))  # a file: a full pipe would block it
    # From the root namespace the agents answer over the veth pairs, and only with the token.
    for node in nodes:
        wait_until(lambda: _get(f"http://{node.address}:{PORT}/v1/targets"), 60, f"the agent of {node.name}")
    assert _get(f"http://{nodes[0].address}:{PORT}/v1/targets", token=None) is None
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(f"http://{nodes[0].address}:{PORT}/v1/targets", timeout=5)

    port = free_port()
    silent = f"http://{nodes[0].address}:{PORT + 1}"  # nothing listens there
    agents = ",".join([f"http://{n.address}:{PORT}" for n in nodes] + [silent])
    procs.append(subprocess.Popen(
        [*RANKSCOPE, "cluster", "--agents", agents, "--listen", f"127.0.0.1:{port}", "--token-file", str(token_file),
         "--window", "1", "--timeout", "2"], stdout=subprocess.DEVNULL, stderr=open(tmp_path / "cluster.log", "w"),
        text=True))
    url = f"http://127.0.0.1:{port}/v1/diagnosis?job={job.job_id}"

    def named() -> dict | None:
        doc = _get(url)
        if not doc or len(doc["ranks"]) != NODES * RANKS_PER_NODE:
            return None
        stragglers = [f for f in doc["findings"] if f["kind"] == "compute_straggler"]
        return doc if stragglers and stragglers[0]["ranks"] == [SLOW_RANK] else None

    doc = wait_until(named, 60, "one diagnosis naming the slow rank over every agent")
    host_of = {r["rank"]: r["host"] for r in doc["ranks"]}
    assert host_of[SLOW_RANK] == nodes[SLOW_RANK // RANKS_PER_NODE].name
    assert set(host_of.values()) == {n.name for n in nodes}
    assert doc["findings"][0]["kind"] == "compute_straggler"  # the largest cost
    states = {a["url"]: a["state"] for a in doc["agents"]}
    assert states[silent] == "down" and sum(s == "up" for s in states.values()) == NODES

    # An agent that goes away: its ranks' absence is reported, naming its node; the analyzer keeps serving.
    procs[2].terminate()
    procs[2].wait(timeout=20)

    def lost() -> list | None:
        doc = _get(url)
        return doc and [f for f in doc["findings"] if f["kind"] == "node_unreachable"]

    gone = wait_until(lost, 30, "the lost node to be reported")
    assert [(f["ranks"], f["evidence"]["host"]) for f in gone] == [([4, 5], nodes[2].name)]
    assert procs[-1].poll() is None
