"""Agent runs of real torchrun jobs, kept by the accuracy matrix (scripts/bench accuracy --keep-all): their
windows diagnosed in order and confirmed as the agent does (stability.Confirmer), each run a case the rules
once got wrong or a case of the agent's hysteresis. A faulty run must report its straggler in the windows
runs.json names and in no other; a healthy one nothing.

tests/data/agent-windows/: runs/NAME/N.msgpack (window N's patterns) and runs.json (per run: the expected finding,
the windows that report it, and why the run is here). A run added there is tested without a line of code.
"""
import json
from pathlib import Path

import pytest

from rankscope.analyzer.baseline import Baseline
from rankscope.analyzer.diagnosis import diagnose
from rankscope.analyzer.rules.hangs import DEFAULT_HANG_TIMEOUT_S
from rankscope.analyzer.stability import Confirmer
from rankscope.schema.wire import decode_patterns

DATA = Path(__file__).resolve().parents[1] / "data" / "agent-windows"
RUNS = json.loads((DATA / "runs.json").read_text())


def reported(name: str) -> list[tuple[int, str, list[int]]]:
    """(window, kind, ranks) of every finding the agent would report over the run's windows."""
    baselines: dict[str, Baseline] = {}
    confirmer = Confirmer()
    out = []
    windows = sorted((DATA / "runs" / name).glob("*.msgpack"), key=lambda p: int(p.stem))
    for i, path in enumerate(windows):
        docs = diagnose(decode_patterns(path.read_bytes()), DEFAULT_HANG_TIMEOUT_S, baselines)
        confirmer.confirm(docs)
        out += [(i, f["kind"], f["ranks"]) for doc in docs.values() for f in doc["findings"]]
    return out


@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_agent_verdict_on_a_kept_run_of_a_real_job(name):
    run = RUNS[name]
    expected = [(w, *run["expect"]) for w in run["reported_in"]]  # none before the onset, none on a healthy job
    assert reported(name) == expected, run["note"]
