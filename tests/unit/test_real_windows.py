"""Windows of real torchrun jobs, kept by the accuracy matrix (scripts/bench accuracy --keep-all), each one
diagnosed again and held to what was injected into its job: the fault's finding (its kind from the matrix's
fault table, its rank the one the fault hit) and nothing else, nothing on a healthy window; the step time
within 5% of the job's own log; the cost within 30% of its truth (the what-if, or the injected share where the
fault is a known delay) where the host was not oversubscribed by the job, and within 30% of the injected share
on any host where the window gives that share (`injected_cost`); the component where the fault's place is known.

tests/data/windows/: NAME.msgpack (the window's patterns, as `diagnose --save-patterns` writes them) and
windows.json (per window: shape, fault, the rank it hit where the shape is no matrix shape, the component, the
job's own step time and cost, the injected delay's share of the step, and what the window shows). Where the
analyzer is knowingly wrong, `known_wrong` names the check (verdict, component, cost) and why: that check is
a strict xfail, so a fix shows as a pass and the window as right. A window added there is tested without a
line of code.
"""
import json

import pytest
from kept import DATA, HANGS, window
from test_accuracy_replay import bench_accuracy

WINDOWS = json.loads((DATA / "windows" / "windows.json").read_text())
# Jobs that oversubscribe their host's CPUs: there the job's own what-if parts from the straggler's extra work
# (what the cost reports) either way, the others' waiting lending it CPU (cnn-3's job lost about half of what
# was spun) or its spinning taking theirs; the matrix checks their cost against the delay injected.
OVERSUBSCRIBED = {"cnn-3", "pipe-4"}
BENCH = bench_accuracy()
FAULTS = {f.name: f for f in BENCH.FAULTS}
SHAPES = {s.name: s for s in BENCH.SHAPES}


def injected(name: str) -> list | None:
    """[kind, ranks] of the finding the window's fault must be named by (None: healthy): the matrix's kind for
    the fault, the rank the shape's fault hits (or the window's own `rank`, a GPU kit job's heavy rank)."""
    w = WINDOWS[name]
    fault = FAULTS[w["fault"]]
    if fault.expect is None:
        return None
    rank = w["rank"] if "rank" in w else SHAPES[w["shape"]].target(fault.injection)
    return [fault.expect, [rank]]


def cases(check: str, names=sorted(WINDOWS)) -> list:
    """The windows as parameters of one check, a strict xfail where `known_wrong` names it."""
    return [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=WINDOWS[n]["known_wrong"][check]))
            if check in WINDOWS[n].get("known_wrong", {}) else n for n in names]


def diagnosed(name: str) -> dict:
    """The window's document, diagnosed with the hang timeout the matrix gives its fault."""
    return next(iter(window("windows", name).values()))


def test_every_kept_window_names_a_fault_the_matrix_injects():
    # A healthy window of a job the matrix does not run (a checkpointing job) has no rank to hit.
    assert all(w["fault"] in FAULTS and ("rank" in w or w["shape"] in SHAPES or FAULTS[w["fault"]].expect is None)
               for w in WINDOWS.values())
    assert not any(set(w.get("known_wrong", {})) - {"verdict", "component", "cost"} for w in WINDOWS.values())


@pytest.mark.parametrize("name", cases("verdict"))
def test_a_kept_window_reports_what_was_injected_and_nothing_else(name):
    doc = diagnosed(name)
    truth = injected(name)
    assert [[f["kind"], f["ranks"]] for f in doc["findings"]] == ([truth] if truth else []), WINDOWS[name]["note"]
    if truth:  # a suspect seen but not yet confirmed names the faulty rank or none (a healthy rank may be one)
        assert all(u["ranks"] == truth[1] for u in doc.get("unconfirmed", [])), doc["unconfirmed"]


@pytest.mark.parametrize("name", [n for n in sorted(WINDOWS) if WINDOWS[n]["fault"] not in HANGS])
def test_a_kept_windows_step_time_is_the_jobs_own(name):
    assert diagnosed(name)["step_time_s"] == pytest.approx(WINDOWS[name]["step_s"], rel=0.05)


@pytest.mark.parametrize("name", [n for n in sorted(WINDOWS) if WINDOWS[n]["fault"] in HANGS])
def test_a_hung_window_reads_no_step_time(name):
    assert diagnosed(name)["step_time_s"] is None


@pytest.mark.parametrize("name", cases("component", [n for n in sorted(WINDOWS) if "component" in WINDOWS[n]]))
def test_a_kept_window_names_where_the_fault_lies(name):
    assert diagnosed(name)["findings"][0]["component"] == WINDOWS[name]["component"], WINDOWS[name]["note"]


def _costed(name: str) -> bool:
    w = WINDOWS[name]
    return bool(w.get("injected_cost") or (w.get("cost") and w["shape"] not in OVERSUBSCRIBED))


@pytest.mark.parametrize("name", cases("cost", [n for n in sorted(WINDOWS) if _costed(n)]))
def test_a_kept_windows_cost_is_its_truth(name):
    w = WINDOWS[name]
    cost = diagnosed(name)["findings"][0]["cost"]
    if w.get("cost") and w["shape"] not in OVERSUBSCRIBED:  # the job's own what-if
        assert cost == pytest.approx(w["cost"], rel=0.30), w["note"]
    if w.get("injected_cost"):  # the measure, the delay injected as a share of the step: any host
        assert cost == pytest.approx(w["injected_cost"], rel=0.30), w["note"]


def test_a_spinner_named_by_its_user_time_is_told_by_it():
    """Where a spinner's work reads no longer than its peers' (they waited for the CPU its spin took), what it
    is told to compute longer is what its cost takes, its time in user mode beyond theirs, and where it does so
    is its own code: not -0.8 ms, nor its peer's page faults."""
    name = "cnn-3-compute-small-beside-a-faulting-peer"
    doc = diagnosed(name)
    f = doc["findings"][0]
    rank = f["evidence"]["per_rank"][0]
    assert rank["work_s"] <= f["evidence"]["peers_work_s"]  # its work alone: no longer than the median rank's
    assert rank["excess_s"] == rank["cost_s"] == pytest.approx(f["cost"] * doc["step_time_s"], rel=1e-3)
    assert rank["excess_s"] == pytest.approx(WINDOWS[name]["injected_cost"] * doc["step_time_s"], rel=0.3)
    assert f["function"] == "sitecustomize.py:_Rank.before_step", f["summary"]
