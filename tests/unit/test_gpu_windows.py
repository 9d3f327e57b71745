"""Windows of real NCCL and gloo jobs on an H200 (the GPU kit's gpu_accuracy): four or two ranks
time-sharing the GPU, one of them with 8x the matrix products (a GPU straggler) or reading its batches half the
healthy step longer (an input straggler). Under NCCL every host blocks in the same synchronization for as long,
so only the GPU's own work tells the GPU straggler (gpu_straggler); the input straggler enqueues its collectives
last, and waits least in that synchronization.

tests/data/gpu-windows/: NAME.msgpack and windows.json (the kit's case the window is of, whose fault and faulty
rank give the expected finding as kind, ranks and component (gpu_kit/accuracy.py: CASES, EXPECTED); the job's
own step; the share the fault cost it, and the delay's share of the step where one was injected). The
gloo-4-gpu window's patterns are an older agent's, without NCCL's kernel time: it is 0 there (no NCCL kernel
among its ranks' top ones)."""
import json
import sys
from pathlib import Path

import pytest
from kept import window

from rankscope.analyzer.diagnosis import diagnose
from rankscope.schema.wire import decode_patterns

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from gpu_kit.accuracy import CASES, EXPECTED  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu-windows"
WINDOWS = json.loads((DATA / "windows.json").read_text())


def injected(name: str) -> list | None:
    """[kind, ranks, component] of the finding the window's case injected (None: a healthy case)."""
    case = next(c for c in CASES if c.name == WINDOWS[name]["case"])
    if case.fault is None:
        return None
    kind, component = EXPECTED[case.fault]
    return [kind, [case.rank], component]


def _diagnosed(name: str) -> dict:
    return next(iter(window("gpu-windows", name).values()))


@pytest.mark.parametrize("name", sorted(WINDOWS))
def test_the_verdict_and_step_on_a_real_gpu_window(name):
    w = WINDOWS[name]
    doc = _diagnosed(name)
    found = [[f["kind"], f["ranks"], f["component"]] for f in doc["findings"]]
    truth = injected(name)
    assert found == ([truth] if truth else []), w["note"]
    assert doc["step_time_s"] == pytest.approx(w["step_s"], rel=0.05)
    if "injected_cost" in w:  # the bar: within 30% of the delay's share of the step
        assert doc["findings"][0]["cost"] == pytest.approx(w["injected_cost"], rel=0.3), w["note"]


def test_the_gpu_rule_reads_each_ranks_own_gpu_work():
    f = _diagnosed("nccl-4-gpu-0")["findings"][0]
    assert f["function"] == "Kernel2"  # cutlass's matrix product, the heavy rank's extra work
    per_rank = {r["rank"]: r["gpu_work_s"] for r in f["evidence"]["per_rank"]}
    assert per_rank[2] > 10 * max(per_rank[r] for r in (0, 1, 3))
    # What its extra GPU work takes of the step: 13%. The job lost 33% to it, its kernels time-sharing the GPU
    # with three ranks spinning in NCCL's (with a GPU of its own per rank they would not).
    assert f["cost"] == pytest.approx(f["evidence"]["excess_s"] / f["evidence"]["step_time_s"], abs=1e-5)
    assert "than its peers'" in f["summary"]
    assert "than its peer's" in _diagnosed("nccl-2-gpu-0")["findings"][0]["summary"]


def test_without_nccls_kernel_time_the_gpu_rule_stays_silent():
    """Patterns of an older agent (no comm_kernel_s): the NCCL kernels' waiting would read as GPU work."""
    patterns = decode_patterns((DATA / "nccl-4-gpu-0.msgpack").read_bytes())
    for p in patterns:
        p.gpu.comm_kernel_s = None
    assert next(iter(diagnose(patterns).values()))["findings"] == []
