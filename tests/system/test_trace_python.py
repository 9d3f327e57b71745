"""The timeline's Python tracks on the simulated GPU job (real eBPF, needs root). Its ranks run under CPython
3.10, where every call enters the eval loop, so the sim's load_batch named with --trace-function is timed
exactly (and so is its `forward`, as every forward in deep detail): its calls are slices on the main thread,
one a step, none across the step's collective. The
sampled stacks are instant events on their thread whose `stackFrames` chain is the stack in their args."""
from __future__ import annotations

import json

import pytest
from conftest import run
from test_python_sampler import interpreter, needs_root

from rankscope.agent.views.trace import COLLECTIVE_TID

RANKS = 2
CAPTURE_S = 2.0


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> dict[int, dict]:
    from rankscope.sim.job import start_job

    job = start_job(RANKS, python=str(interpreter("3.10")))
    try:
        out = tmp_path_factory.mktemp("traces")
        result = run("trace", "--pid", ",".join(str(p) for p in job.pids), "--duration", str(CAPTURE_S),
                     "--trace-function", "rank:load_batch", "-o", str(out))
        assert result.returncode == 0, result.stderr
        return {r: json.loads((out / f"rank{r}.trace.json").read_text()) for r in range(RANKS)}
    finally:
        job.stop()


@needs_root
def test_a_timed_function_is_a_slice_of_every_step(traced):
    for doc in traced.values():
        pid, events = doc["rankscope"]["pid"], doc["traceEvents"]
        timed = [e for e in events if e.get("cat") == "python_function"]
        # The named function, and every `forward` (the trace records in deep detail).
        assert {e["name"] for e in timed} == {"rank.py:load_batch", "rank.py:forward"}
        assert {e["tid"] for e in timed} == {pid}
        loads = sorted((e for e in timed if e["name"] == "rank.py:load_batch"), key=lambda e: e["ts"])
        colls = sorted((e for e in events if e["tid"] >= COLLECTIVE_TID and e["ph"] == "X"), key=lambda e: e["ts"])
        assert len(colls) >= 10 and abs(len(loads) - len(colls)) <= 2, (len(loads), len(colls))
        # A step loads its batch, then reaches its collective: each load ends before the next collective starts.
        for load in loads[1:-1]:
            after = [c for c in colls if c["ts"] >= load["ts"] + load["dur"]]
            assert after and not [c for c in colls if load["ts"] < c["ts"] < load["ts"] + load["dur"]]
        assert all(e["dur"] > 0 for e in loads)


@needs_root
def test_sampled_stacks_are_samples_of_their_thread(traced):
    for doc in traced.values():
        pid, events, frames = doc["rankscope"]["pid"], doc["traceEvents"], doc["stackFrames"]
        samples = [e for e in events if e.get("cat") == "python_sample"]
        main = [e for e in samples if e["tid"] == pid]
        assert len(main) >= 5, len(main)
        assert any("rank.py:train_step" in e["args"]["stack"].split(";") for e in main)
        for e in samples:
            chain, sf = [], e["sf"]
            while sf is not None:
                chain.append(frames[sf]["name"])
                sf = frames[sf].get("parent")
            assert ";".join(reversed(chain)) == e["args"]["stack"] and e["name"] == chain[0]
        assert doc["rankscope"]["dropped_events"] == doc["rankscope"]["truncated_events"] == 0
