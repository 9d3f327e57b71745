"""Agent runs of real torchrun jobs, kept by the accuracy matrix (scripts/bench accuracy --keep-all): their
windows diagnosed in order and confirmed as the agent does (stability.Confirmer), each judged as its user
would: a faulty run names what was injected within CONFIRM_WITHIN windows of the onset and still names it in
its last window, and reports nothing before the onset nor anything else after it; a healthy run reports
nothing.

tests/data/agent-windows/: runs/NAME/N.msgpack (window N's patterns) and runs.json (per run: its shape, the
matrix's agent case, the window its fault was switched on in, and what the run shows). A run added there is
tested without a line of code.
"""
import json

import pytest
from kept import DATA, RUN_DIR, agent_run
from test_accuracy_replay import bench_accuracy

from rankscope.analyzer.rules.stragglers import SMALL_WINDOWS, STEADY_SPAN
from rankscope.analyzer.stability import OFTEN, SPAN

RUNS = json.loads((DATA / "agent-windows" / "runs.json").read_text())
BENCH = bench_accuracy()
FAULTS = {f.name: f for f in BENCH.FAULTS}
SHAPES = {s.name: s for s in BENCH.SHAPES}
# The most windows a finding's confirmation counts over (a steady straggler's span; a small straggler's, an
# often-seen one's): a fault seen in enough of the windows wholly after its onset (the onset's own window may
# begin before it) is reported by the last of them.
CONFIRM_WITHIN = max(STEADY_SPAN, SPAN * max(SMALL_WINDOWS, OFTEN))


def reported(name: str) -> list[tuple[int, str, list[int]]]:
    """(window, kind, ranks) of every finding the agent would report over the run's windows."""
    return [(i, f["kind"], f["ranks"]) for i, docs in enumerate(agent_run(name))
            for doc in docs.values() for f in doc["findings"]]


def names_the_fault(run: dict, kind: str, ranks: list[int]) -> bool:
    """Whether a finding names the run's injected fault: its kind, and the rank the fault hit (a regression is
    the job's: any ranks, as the matrix scores it)."""
    fault = FAULTS[run["fault"]]
    if kind != fault.expect:
        return False
    return fault.expect == "regression" or ranks == [SHAPES[run["shape"]].target(fault.injection)]


@pytest.mark.parametrize("name", sorted(n for n in RUNS if FAULTS[RUNS[n]["fault"]].expect is None))
def test_a_healthy_agent_run_reports_nothing(name):
    assert reported(name) == [], RUNS[name]["note"]


@pytest.mark.parametrize("name", sorted(n for n in RUNS if FAULTS[RUNS[n]["fault"]].expect is not None))
def test_an_agent_run_names_its_fault_soon_after_the_onset_and_nothing_else(name):
    run = RUNS[name]
    onset, last = run["onset"], len(list((RUN_DIR / name).glob("*.msgpack"))) - 1
    found = reported(name)
    assert [f for f in found if f[0] < onset] == [], run["note"]  # nothing before the fault
    assert [f for f in found if not names_the_fault(run, f[1], f[2])] == [], run["note"]
    named_in = [w for w, _, _ in found]
    assert named_in and named_in[0] <= onset + CONFIRM_WITHIN, (named_in, run["note"])
    assert named_in[-1] == last, (named_in, run["note"])  # the fault lasts: still named at the run's end
