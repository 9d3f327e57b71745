"""Trace captures of a real torch job (tests/jobs/mlp_regression.py under torchrun: DDP over gloo, one gradient
bucket, so one all-reduce a step): the traces validate, each rank's collectives are its steps, the scheduler
track covers the capture, sampled Python stacks are the training loop's, and HolisticTraceAnalysis loads the
set as one job whose temporal breakdown agrees with rankscope's own shares of the same window. Also the agent's
GET /v1/trace. Real eBPF: needs root.

HTA is no dependency of rankscope (it pulls JupyterLab) but one of its test extras, pinned with pandas < 3
(HTA 0.5 fails inside its own code under pandas 3); it runs in a process of its own.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest
from conftest import one_line_error, run, wait_until

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "jobs"))
import launch  # noqa: E402

from rankscope.agent.views.trace import COLLECTIVE_TID, SCHED_TID  # noqa: E402

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="eBPF needs root")

RANKS = 2
CAPTURE_S = 3.0
# HTA's shares of a rank against rankscope's, absolute. HTA spans the first collective to the last of the
# capture, rankscope the steps the window holds: a step cut at either end of the ~30 steps of CAPTURE_S moves
# a share by up to a thirtieth.
SHARE_TOLERANCE = 0.03


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    j = launch.start("mlp_regression.py", RANKS, [], tmp_path_factory.mktemp("job"))
    yield j
    j.kill()


@pytest.fixture(scope="module")
def traced(job, tmp_path_factory) -> tuple[Path, dict[int, dict]]:
    out = tmp_path_factory.mktemp("traces")
    result = run("trace", "--pid", ",".join(str(job.pids[r]) for r in range(RANKS)), "--duration", str(CAPTURE_S),
                 "-o", str(out))
    assert result.returncode == 0, result.stderr
    return out, {r: json.loads((out / f"rank{r}.trace.json").read_text()) for r in range(RANKS)}


def window(doc: dict) -> tuple[float, float]:
    """The capture's start and end, unix s."""
    start = doc["baseTimeNanoseconds"] / 1e9
    return start, start + doc["rankscope"]["seconds"]


def test_traces_validate(traced):
    _, docs = traced
    for rank, doc in docs.items():
        assert doc["distributedInfo"] == {"rank": rank, "world_size": RANKS, "backend": "gloo"}
        assert doc["rankscope"]["dropped_events"] == doc["rankscope"]["truncated_events"] == 0
        events = doc["traceEvents"]
        assert all({"ph", "ts", "pid", "tid"} <= e.keys() for e in events)
        assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")
        assert {e["pid"] for e in events} == {doc["rankscope"]["pid"]}


def test_a_ranks_collectives_are_its_steps(job, traced):
    _, docs = traced
    for rank, doc in docs.items():
        start, end = window(doc)
        job.wait_written(end)
        steps = sum(start <= t <= end for t in job.step_ends(rank))
        colls = [e for e in doc["traceEvents"] if e["tid"] >= COLLECTIVE_TID and e["ph"] == "X"]
        # One all-reduce a step; at each end of the capture a step and its all-reduce may fall on either side,
        # and where steps take milliseconds the step log's instants lag the probes' by a few of them.
        assert steps >= 0.5 * CAPTURE_S / 0.1 and abs(len(colls) - steps) <= max(2, 0.02 * steps), (len(colls), steps)
        assert {e["name"] for e in colls} == {"ncclKernel gloo_allreduce"}
        # Each is linked to its call on a gloo worker thread, and both are the same span.
        calls = {e["args"]["correlation"]: e for e in doc["traceEvents"]
                 if e.get("cat") == "gloo" and e["ph"] == "X" and "correlation" in e.get("args", {})}
        for c in colls:
            call = calls[c["args"]["correlation"]]
            assert (call["ts"], call["dur"]) == (c["ts"], c["dur"])
        # DDP's wait for them at the end of backward: on the training thread, once a step.
        waits = [e for e in doc["traceEvents"] if e.get("name") == "Reducer_finalize_backward"]
        assert abs(len(waits) - steps) <= max(2, 0.02 * steps) and {e["tid"] for e in waits} == {doc["rankscope"]["pid"]}, waits[:3]


def test_the_scheduler_track_covers_the_capture(traced):
    _, docs = traced
    for doc in docs.values():
        states = sorted((e["ts"], e["dur"], e["name"]) for e in doc["traceEvents"] if e["tid"] == SCHED_TID
                        and e["ph"] == "X")
        assert {name for _, _, name in states} >= {"running", "asleep"}
        assert all(t0 + d0 <= t1 + 0.001 for (t0, d0, _), (t1, _, _) in zip(states, states[1:]))  # no overlap
        covered = sum(d for _, d, _ in states) / 1e6
        # The state open when the capture ends is not closed yet: a step's worth at most.
        assert CAPTURE_S - 0.2 <= covered <= CAPTURE_S + 0.01, covered


def test_sampled_python_stacks_name_the_training_loop(traced):
    _, docs = traced
    for doc in docs.values():
        pid = doc["rankscope"]["pid"]
        main = [e["args"]["stack"].split(";") for e in doc["traceEvents"]
                if e.get("cat") == "python_sample" and e["tid"] == pid]
        # A sample reads the frame chain while the interpreter runs (never stopped, as py-spy --nonblocking):
        # one can catch a frame mid-push. Seen once in a full suite run (one stack of ~550 not rooted in the
        # script); in 1,700 samples of three reruns, none.
        rooted = sum(stack[0] == "mlp_regression.py:<module>" for stack in main)
        assert main and rooted >= 0.99 * len(main), (rooted, len(main))
        assert any("mlp_regression.py:main" in stack for stack in main)


HTA_BREAKDOWN = r'''
import json, sys
from hta.trace_analysis import TraceAnalysis
df = TraceAnalysis(trace_dir=sys.argv[1]).get_temporal_breakdown(visualize=False)
print(json.dumps({int(r["rank"]): {k: r[f"{k}_time(us)"] / r["kernel_time(us)"] for k in ("idle", "compute", "non_compute")}
                  for _, r in df.iterrows()}))
'''


def test_hta_loads_the_job_and_agrees_on_each_ranks_shares(traced):
    """HTA's temporal breakdown of each rank's collective stream: no compute (a CPU job's collectives are
    communication to it), its communication share rankscope's comm share of the step, its idle share the rest."""
    out, docs = traced
    result = subprocess.run([sys.executable, "-c", HTA_BREAKDOWN, str(out)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    hta = {int(r): shares for r, shares in json.loads(result.stdout.splitlines()[-1]).items()}
    assert sorted(hta) == list(range(RANKS))
    for rank, doc in docs.items():
        own = doc["rankscope"]["summary"]
        comm = own["comm_s"] / own["step_time_s"]  # the diagnosis of the capture's own window
        print(f"rank {rank}: HTA {hta[rank]}, rankscope comm share {comm:.3f}")
        assert hta[rank]["compute"] == 0
        assert hta[rank]["non_compute"] == pytest.approx(comm, abs=SHARE_TOLERANCE), (hta[rank], comm)
        assert hta[rank]["idle"] == pytest.approx(1 - comm, abs=SHARE_TOLERANCE), (hta[rank], comm)


def _get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, "", e.read()


def test_agent_serves_one_capture_at_a_time_then_cools_down(job, agent):
    a = agent("--pid", ",".join(str(p) for p in job.pids.values()))
    wait_until(lambda: len(a.get("/v1/diagnosis")["ranks"]) == RANKS, 60, "the agent's first window")
    answers: list[tuple[int, str, bytes]] = []
    both = [threading.Thread(target=lambda: answers.append(_get(f"{a.url}/v1/trace?seconds=2"))) for _ in range(2)]
    for t in both:
        t.start()
    for t in both:
        t.join()
    assert sorted(status for status, _, _ in answers) == [200, 409], answers
    _, ctype, body = next(a for a in answers if a[0] == 200)
    assert ctype == "application/zip"
    with zipfile.ZipFile(io.BytesIO(body)) as z:
        assert sorted(z.namelist()) == [f"rank{r}.trace.json" for r in range(RANKS)]
        doc = json.loads(z.read("rank1.trace.json"))
    assert doc["distributedInfo"]["rank"] == 1 and doc["rankscope"]["seconds"] == pytest.approx(2, abs=0.2)
    assert any(e["tid"] >= COLLECTIVE_TID for e in doc["traceEvents"])
    # The first is over, but the next waits as long as it took: a trace costs the ranks at most half the time.
    status, _, _ = _get(f"{a.url}/v1/trace?seconds=1&rank=0")
    assert status == 429
    status, _, body = wait_until(lambda: (r := _get(f"{a.url}/v1/trace?seconds=1&rank=0"))[0] != 429 and r, 30,
                                 "the captures' cool-down", interval=0.5)
    assert status == 200 and json.loads(body)["distributedInfo"]["rank"] == 0
    assert _get(f"{a.url}/v1/trace?seconds=600")[0] == 400


@pytest.mark.parametrize("args,message", [
    (("--duration", "0"), "--duration must be positive and at most 60"),
    (("--duration", "61"), "--duration must be positive and at most 60"),
    (("-o", "/proc/no-such-dir"), "-o: cannot write to /proc/no-such-dir"),
    ((), "no such process"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path):
    error = one_line_error(run("trace", "--pid", "999999999", "-o", str(tmp_path / "t"), *args))
    assert message in error, error
