"""The diagnosis document as text: what a person at a terminal reads after `rankscope diagnose`."""
from pathlib import Path

from rankscope.agent.report import render
from rankscope.analyzer.diagnosis import diagnose
from rankscope.schema.wire import decode_patterns

WINDOWS = Path(__file__).resolve().parents[1] / "data" / "windows"


def one_look(name: str) -> dict:
    return next(iter(diagnose(decode_patterns((WINDOWS / f"{name}.msgpack").read_bytes())).values()))


def test_a_small_stragglers_suspect_is_shown_with_what_would_confirm_it():
    """cnn-3, healthy, rank 0 late by a tenth of the step in 59% of the steps but not all through the window: no
    finding held in one look, the suspect and its summary shown"""
    text = render(one_look("cnn-3-healthy-suspect"))
    assert "healthy: no rank" not in text and "no finding held" in text
    suspect = next(line for line in text.splitlines() if line.startswith("suspect:"))
    assert "compute_straggler of rank 0" in suspect and "4 of 8 windows" in suspect
    assert "rank 0 computes" in text


def test_a_steady_stragglers_suspect_is_shown_with_the_span_that_would_confirm_it():
    """pipe-4, a 2 s agent window of 30 steps after rank 3 began to spin: working longer, not late in most steps"""
    path = WINDOWS.parent / "agent-windows" / "runs" / "pipe-4-compute-small-steady" / "6.msgpack"
    doc = next(iter(diagnose(decode_patterns(path.read_bytes())).values()))
    assert [(u["kind"], u["ranks"], u["needs"], u["of"]) for u in doc["unconfirmed"]] == [
        ("compute_straggler", [3], 8, 10)]
    suspect = next(line for line in render(doc).splitlines() if line.startswith("suspect:"))
    assert "compute_straggler of rank 3" in suspect and "8 of 10 windows" in suspect


def test_a_finding_is_listed_without_suspects():
    text = render(one_look("lm-2-compute-small"))  # late in 82% of the steps: named from one window
    assert "1. compute_straggler: rank 1 (" in text and "suspect" not in text


def test_the_agents_findings_not_yet_held_are_shown_as_suspects():
    """`diagnose --agent` soon after the agent started: a straggler seen in its first window, not yet held."""
    doc = {**one_look("lm-2-compute-small"), "findings": [],
           "unconfirmed": [{"kind": "compute_straggler", "ranks": [1], "windows": 1}]}
    text = render(doc)
    assert "healthy: no rank" not in text and "no finding held" in text
    assert ("suspect: compute_straggler of rank 1, seen in 1 of the agent's windows; reported once it holds over 6 s "
            "and 2 windows running, or in 4 of 8") in text
    regressed = render({**doc, "unconfirmed": [{"kind": "regression", "ranks": [0, 1], "windows": 2}]})
    assert "suspect: regression of ranks 0, 1, seen in 2 of the agent's windows; reported once it holds over 6 s and " \
           "3 windows running" in regressed
