"""`rankscope profile` against py-spy (the test extras) on one running Python process over the same window
(scripts/compare_pyspy.py): the flame graph's shares agree, stack by stack and function by function. Real
eBPF: needs root.

Both sample on-CPU time at RATE for SECONDS, about 500 samples each: a share p of them varies by
sqrt(p(1-p)/500), 2.2 percentage points at most, so the two tools' shares of one function differ by 3.2 pp
at one sigma. FUNCTION_PP allows 2.5 sigma. py-spy reads the stacks without stopping the process
(--nonblocking, as rankscope does) and tears some of them (a generator's frame alone at the root: 5% of its
samples in one window), so the stacks' overlap is allowed that much below the sampling noise's.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="eBPF and /proc/PID/mem need root")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compare_pyspy.py"
SECONDS = 5
RATE = 99  # Hz
TOP = 6  # py-spy's largest functions compared: 2% of its samples and more
FUNCTION_PP = 8.0  # a function's self share, percentage points apart at most
STACKS_OVERLAP = 0.80  # of the samples on the same stacks in both, at least


def compare_pyspy():
    spec = importlib.util.spec_from_file_location("compare_pyspy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def shares() -> tuple[dict, dict, object]:
    tool = compare_pyspy()
    assert Path(tool.pyspy()).exists(), "py-spy is not installed: scripts/install installs the test extras"
    spy, ours = tool.record(sys.executable, SECONDS, RATE)
    return spy, ours, tool


def test_the_flame_graphs_stacks_are_py_spys(shares):
    spy, ours, tool = shares
    assert sum(ours.values()) == pytest.approx(1.0)
    assert tool.overlap(spy, ours) >= STACKS_OVERLAP, (spy, ours)


def test_each_functions_self_share_is_py_spys(shares):
    spy, ours, tool = shares
    spy_self, ours_self = tool.self_shares(spy), tool.self_shares(ours)
    top = sorted(spy_self, key=lambda k: -spy_self[k])[:TOP]
    assert {"<genexpr> (workload.py)", "augment (workload.py)", "tokenize (workload.py)"} <= set(top), top
    apart = {k: 100 * (ours_self.get(k, 0.0) - spy_self[k]) for k in top}
    assert max(abs(d) for d in apart.values()) <= FUNCTION_PP, apart
