"""The GPU rows of the accuracy matrix are scored as the bench scores a run: a healthy run names nothing, a
straggler run names its faulty rank first (a heavy rank as a compute straggler on the GPU, a slow reader as an
input straggler), and any finding naming another rank is false."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from gpu_kit.accuracy import CASES, GpuCase, Scored, score, table  # noqa: E402

STRAGGLER = {"kind": "compute_straggler", "ranks": [2], "component": "gpu", "cost": 0.3}


def test_a_healthy_run_is_right_only_with_no_finding():
    assert score(GpuCase("gloo", 4), {"findings": []}) == (True, 0, {})
    assert score(GpuCase("gloo", 4), {"findings": [STRAGGLER]}) == (False, 1, {})


def test_a_straggler_run_needs_its_rank_first_on_the_gpu():
    case = GpuCase("nccl", 4, "gpu", 2)
    assert case.name == "nccl-4-gpu" and case.shape == "nccl-4"
    assert score(case, {"findings": [STRAGGLER]}) == (True, 0, STRAGGLER)
    on_cpu = {**STRAGGLER, "component": "cpu"}
    assert score(case, {"findings": [on_cpu]}) == (False, 0, {})
    other = {**STRAGGLER, "ranks": [1]}
    assert score(case, {"findings": [other, STRAGGLER]}) == (False, 1, {})
    assert score(case, {"findings": []}) == (False, 0, {})


def test_a_slow_reader_is_right_only_as_an_input_straggler():
    case = GpuCase("nccl", 2, "loader", 1)
    assert case.name == "nccl-2-loader"
    reader = {"kind": "input_straggler", "ranks": [1], "component": "input", "cost": 0.3}
    assert score(case, {"findings": [reader]}) == (True, 0, reader)
    assert score(case, {"findings": [{**STRAGGLER, "ranks": [1]}]}) == (False, 0, {})


def test_every_shape_is_measured_healthy_before_its_faults():
    shapes = {c.shape for c in CASES}
    for shape in shapes:
        mine = [c for c in CASES if c.shape == shape]
        assert mine[0].fault is None and {c.fault for c in mine[1:]} == {"gpu", "loader"}


def test_the_table_counts_runs_and_errors_per_case():
    rows = [Scored("gloo-4-gpu", 0, True, 0, [STRAGGLER], 22.0, 20.0, cost=0.3, truth_cost=0.25),
            Scored("gloo-4-gpu", 1, False, 1, [], None, 20.0, cost=None, truth_cost=0.25),
            Scored("gloo-4-healthy", 0, True, 0, [], 15.0, 15.0)]
    got = table(rows)
    assert got["gloo-4-gpu"] == {"case": "gloo-4-gpu", "runs": 2, "right": 1, "false_findings": 1,
                                 "step_error": [0.1], "cost_error": [0.2]}
    assert got["gloo-4-healthy"]["step_error"] == [0.0] and got["gloo-4-healthy"]["cost_error"] == []
    # A delay injected is the share the cost is held to, not what the job happened to lose
    slow = [Scored("nccl-2-loader", 0, True, 0, [], 30.0, 30.0, cost=0.36, truth_cost=0.1, injected_cost=0.3)]
    assert table(slow)["nccl-2-loader"]["cost_error"] == [0.2]
