"""The kept windows and agent runs of real jobs (tests/data), each decoded and diagnosed once a session and
shared by the tests that judge them: diagnosing them all takes seconds, and several test files read the same
documents. Every caller gets its own deep copy, so no test changes what another reads."""
from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

from rankscope.analyzer.baseline import Baseline
from rankscope.analyzer.diagnosis import diagnose
from rankscope.analyzer.rules.hangs import DEFAULT_HANG_TIMEOUT_S
from rankscope.analyzer.stability import Confirmer
from rankscope.schema.wire import decode_patterns

DATA = Path(__file__).resolve().parents[1] / "data"
RUN_DIR = DATA / "agent-windows" / "runs"
MATRIX_HANG_TIMEOUT_S = 4.0  # as the accuracy matrix diagnoses its hang windows
HANGS = ("hang", "sigstop")

Docs = dict[str, dict[str, Any]]  # job -> its diagnosis document


def window_names(folder: str) -> list[str]:
    """The kept windows of tests/data/FOLDER, by name (NAME.msgpack)."""
    return sorted(p.stem for p in (DATA / folder).glob("*.msgpack"))


def run_names() -> list[str]:
    """The kept agent runs (tests/data/agent-windows/runs/NAME/N.msgpack), by name."""
    return sorted(p.name for p in RUN_DIR.iterdir() if p.is_dir())


@cache
def _faults(folder: str) -> dict[str, str | None]:
    listed = DATA / folder / "windows.json"
    return {n: w.get("fault") for n, w in json.loads(listed.read_text()).items()} if listed.exists() else {}


def matrix_hang_timeout(folder: str, name: str) -> float:
    """The hang timeout the accuracy matrix diagnoses the window with: 4 s where its fault is a hang."""
    return MATRIX_HANG_TIMEOUT_S if _faults(folder).get(name) in HANGS else DEFAULT_HANG_TIMEOUT_S


def window(folder: str, name: str, hang_timeout_s: float | None = None) -> Docs:
    """One look (`diagnose`) at the kept window, with the matrix's hang timeout unless told."""
    timeout = matrix_hang_timeout(folder, name) if hang_timeout_s is None else hang_timeout_s
    return copy.deepcopy(_window(folder, name, timeout))


@cache
def _window(folder: str, name: str, hang_timeout_s: float) -> Docs:
    return diagnose(decode_patterns((DATA / folder / f"{name}.msgpack").read_bytes()), hang_timeout_s)


def agent_run(name: str, hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S) -> list[Docs]:
    """Every window of the kept agent run in order, as the agent serves it: against the job's own baseline,
    each finding under `unconfirmed` until it held long enough (stability.Confirmer)."""
    return copy.deepcopy(_agent_run(name, hang_timeout_s))


@cache
def _agent_run(name: str, hang_timeout_s: float) -> list[Docs]:
    baselines: dict[str, Baseline] = {}
    confirmer = Confirmer()
    out = []
    for path in sorted((RUN_DIR / name).glob("*.msgpack"), key=lambda p: int(p.stem)):
        docs = diagnose(decode_patterns(path.read_bytes()), hang_timeout_s, baselines)
        confirmer.confirm(docs)
        out.append(copy.deepcopy(docs))  # as served then: a later window's baseline may hold its findings
    return out
