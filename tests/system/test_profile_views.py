"""Flame graphs and stack dumps of real processes: full stacks with the right shares in every format, a
differential profile naming the frame that grew on a slowed process, every thread's stack now (the hang
view), and the agent's GET /v1/profile and /v1/stacks on a simulated job. Real eBPF: needs root.

The only waiting on the clock is each profile's measurement window; shares are ratios of the samples a
process got, so a busy machine gives fewer samples, not other shares.
"""
from __future__ import annotations

import json
import os
import urllib.error

import jsonschema
import pytest
from conftest import one_line_error, run, wait_until
from pprof_decoder import decode
from speedscope_schema import SPEEDSCOPE_SCHEMA
from test_python_sampler import TARGET, interpreter, start

from rankscope.agent.capture import capture
from rankscope.agent.views.folded import folded
from rankscope.agent.views.pprof import pprof
from rankscope.agent.views.speedscope import speedscope

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="eBPF and /proc/PID/mem need root")
pytestmark = needs_root

RATE = 199  # Hz
SPLIT = ["<module>", "main", "outer"]  # hot_a gets 70 % of outer's calls, hot_b 30 %


@pytest.fixture(scope="module")
def split_profile(tmp_path_factory):
    """One window of the sampler test's target, with hot_a 70 % and hot_b 30 % of its CPU."""
    script = tmp_path_factory.mktemp("split") / "target.py"
    script.write_text(TARGET)
    procs: list = []
    p, _ = start(procs, [str(interpreter("3.12")), str(script)])
    try:
        (prof,) = capture([p.pid], 4.0, RATE)  # the measurement window
    finally:
        p.kill()
        p.wait()
    return prof, script


def _share_of_hot_a(counts: dict[tuple[str, ...], float]) -> float:
    a = sum(v for s, v in counts.items() if list(s) == SPLIT + ["hot_a"])
    b = sum(v for s, v in counts.items() if list(s) == SPLIT + ["hot_b"])
    assert a + b >= 0.85 * sum(counts.values()), counts
    return a / (a + b)


def test_folded_has_the_full_stack_and_its_share(split_profile):
    prof, script = split_profile
    counts: dict[tuple[str, ...], float] = {}
    for line in folded([prof], "cpu").splitlines():
        stack, _, n = line.rpartition(" ")
        names = tuple(f.split(" (")[0] for f in stack.split(";"))
        counts[names] = counts.get(names, 0) + int(n)
        if names[-1] == "hot_a":
            assert f"hot_a ({script}:" in stack
    assert sum(counts.values()) >= 50, counts
    assert abs(_share_of_hot_a(counts) - 0.7) <= 0.12, counts


def test_speedscope_validates_and_keeps_the_share(split_profile):
    prof, _ = split_profile
    doc = json.loads(json.dumps(speedscope([prof], "cpu")))
    jsonschema.validate(doc, SPEEDSCOPE_SCHEMA)
    frames = doc["shared"]["frames"]
    (sampled,) = doc["profiles"]
    counts = {tuple(frames[i]["name"] for i in s): w for s, w in zip(sampled["samples"], sampled["weights"])}
    assert abs(_share_of_hot_a(counts) - 0.7) <= 0.12, counts


def test_pprof_decodes_with_the_stacks_and_their_samples(split_profile):
    prof, _ = split_profile
    got = decode(pprof([prof], "cpu"))
    assert got["default"] == "cpu"
    counts = {tuple(s["stack"]): s["values"][0] for s in got["samples"]}
    assert sum(counts.values()) == sum(t.samples for t in prof.stacks.values())
    assert abs(_share_of_hot_a(counts) - 0.7) <= 0.12, counts
    assert all(abs(s["values"][1] - s["values"][0] * 1e9 / RATE) <= 1 for s in got["samples"])  # cpu ns


# A step: load (asleep 4 ms), then forward (a fixed amount of work: ~4 ms of CPU here). The slowed process
# does three times the work. Per second of wall time, whatever CPU the machine leaves them, the slowed one
# spends a larger share in forward and a smaller one asleep in load (its steps hold more work per sleep).
STEP_TARGET = r'''
import sys, time

def forward(n):
    while n:
        n -= 1

def load():
    time.sleep(0.004)

def step(n):
    load()
    forward(n)

print("ready", flush=True)
n = int(sys.argv[1])
while True:
    step(n)
'''


def test_differential_names_the_frame_that_grew(procs, tmp_path):
    script = tmp_path / "steps.py"
    script.write_text(STEP_TARGET)
    pids = [start(procs, [str(interpreter("3.12")), str(script), n])[0].pid for n in ("100000", "100000", "300000")]
    out = tmp_path / "diff.json"
    result = run("profile", "--pid", ",".join(map(str, pids)), "--duration", "3", "--diff", "2", "--format", "json",
                 "-o", str(out))
    assert result.returncode == 0, result.stderr
    listing = json.loads(out.read_text())
    assert listing["rank"] == 2 and listing["peers"] == [0, 1] and listing["unit"] == "seconds per second"
    by_name = {row["function"].split(" (")[0]: row for row in listing["self"]}
    assert listing["self"][0]["function"].startswith(f"forward ({script}:"), listing["self"][:3]
    # Idle, the peers spend about half of each second in forward and the slowed one three quarters; a busy
    # machine narrows that (preempted time is neither on nor off CPU), never reverses it.
    assert by_name["forward"]["delta_s"] > 0 > by_name["load"]["delta_s"], (by_name["forward"], by_name["load"])
    assert "forward" in result.stderr.splitlines()[-1] and "grew most" in result.stderr


# Three "ranks" of a hung job: ranks 0 and 2 wait in the collective, rank 1 never got there; each has a
# loader thread blocked on an empty queue.
HUNG_TARGET = r'''
import queue, sys, threading

def wait_for_batch(q):
    return q.get()

def all_reduce(done):
    done.wait()

def read_checkpoint(done):
    done.wait()

q, done = queue.Queue(), threading.Event()
threading.Thread(target=wait_for_batch, args=(q,), name="loader", daemon=True).start()
while not q.not_empty._waiters:  # the loader is about to block
    pass
print("ready", flush=True)
(all_reduce if sys.argv[1] == "collective" else read_checkpoint)(done)
'''


@pytest.mark.parametrize("version", ["3.10", "3.13"])
def test_dump_groups_every_thread_by_its_stack(procs, tmp_path, version):
    script = tmp_path / "hung.py"
    script.write_text(HUNG_TARGET)
    pids = [start(procs, [str(interpreter(version)), str(script), where])[0].pid
            for where in ("collective", "io", "collective")]

    def dumped():
        result = run("dump", "--pid", ",".join(map(str, pids)), "--json")
        assert result.returncode == 0, result.stderr
        doc = json.loads(result.stdout)
        # Blocked, not merely between two lines: every thread asleep in a futex.
        return doc if all(t["state"].startswith("futex") for g in doc["groups"] for t in g["threads"]) else None

    doc = wait_until(dumped, 20, "every thread to block")
    assert doc["errors"] == []
    def waits_in(group) -> str:
        return next(f["name"] for f in group["stack"] if f["name"] in ("all_reduce", "read_checkpoint",
                                                                       "wait_for_batch"))

    by_function = {waits_in(g): g for g in doc["groups"]}
    assert len(by_function) == len(doc["groups"]) == 3, doc["groups"]
    assert by_function["all_reduce"]["ranks"] == [0, 2] and by_function["read_checkpoint"]["ranks"] == [1]
    assert by_function["wait_for_batch"]["ranks"] == [0, 1, 2] and len(by_function["wait_for_batch"]["threads"]) == 3
    assert [f["name"] for f in by_function["all_reduce"]["stack"][:2]] == ["<module>", "all_reduce"]
    assert {t["pid"]: t["tid"] for t in by_function["all_reduce"]["threads"]} == {pids[0]: pids[0], pids[2]: pids[2]}
    text = run("dump", "--pid", str(pids[1])).stdout
    assert "read_checkpoint" in text and "wait_for_batch" in text and "all_reduce" not in text


def _get(a, path: str):
    try:
        return a.get(path)
    except urllib.error.HTTPError:  # 404 until the first window with profiles
        return None


def test_agent_serves_profiles_differentials_and_stacks(sim_job, agent):
    job = sim_job(3, faults=("slow-cpu:1:5",), host_cpu_s=0.004)  # +16 ms of CPU a step in _decode_samples
    a = agent("--pid", ",".join(map(str, job.pids)), "--window", "1.5")

    def grown():
        listing = _get(a, "/v1/profile?rank=1&against=peers&format=json")
        return listing if listing and listing["unit"] == "seconds per step" and listing["self"] else None

    listing = wait_until(grown, 30, "a differential profile per step")
    assert listing["peers"] == [0, 2]
    grown = listing["self"][0]
    assert grown["function"].split(" (")[0] == "_decode_samples" and grown["delta_s"] > 0, listing["self"][:3]
    stacks = a.get("/v1/stacks")
    assert stacks["errors"] == []
    mains = [(t["rank"], g["stack"]) for g in stacks["groups"] for t in g["threads"] if t["tid"] == t["pid"]]
    assert sorted(rank for rank, _ in mains) == [0, 1, 2]
    assert all(any(f["file"].endswith("sim/rank.py") for f in stack) for _, stack in mains), mains


@pytest.mark.parametrize("args,message", [
    (("profile", "--format", "json"), "listing of a --diff"),
    (("profile", "--diff", "0", "--format", "pprof"), "a --diff is written as folded"),
    (("profile", "--duration", "0"), "--duration must be positive"),
    (("dump",), "no such process"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    error = one_line_error(run(*args[:1], "--pid", "999999999", *args[1:]))
    assert message in error, error
