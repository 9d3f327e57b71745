"""The README's held-out accuracy table is what scripts/gen_accuracy_table.py makes of the kept held-out runs,
and the generator tallies runs as the matrix scores them."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import gen_accuracy_table  # noqa: E402


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    return gen_accuracy_table


def run(shape: str, fault: str, right: bool, job: str, **figures) -> dict:
    return {"shape": shape, "fault": fault, "right": right, "false": figures.pop("false", []), "findings": [],
            "step_s": None, "truth_step_s": None, "cost": None, "lost": None, "error": "", "job": job, **figures}


def test_the_readmes_table_is_the_kept_runs_table(gen):
    runs = json.loads(gen.KEPT.read_text())
    doc = gen.README.read_text()
    assert gen.with_table(doc, runs, gen.bench_accuracy()) == doc, \
        "README.md is out of date: run scripts/gen_accuracy_table.py"


def test_a_familys_row_tallies_its_runs_against_the_jobs_own_figures(gen):
    runs = [
        run("static-3", "healthy", True, "a", step_s=0.101, truth_step_s=0.100),
        run("static-3", "healthy", False, "b", false=["compute_straggler[1]"], step_s=0.096, truth_step_s=0.100),
        run("static-3", "compute", True, "c", step_s=0.120, truth_step_s=0.120, cost=0.30, lost=0.25),
        run("static-3", "compute", True, "d", cost=0.18, lost=0.20),
        run("static-3", "hang", False, "e"),
        run("static-3", "hang", False, "f", error="RuntimeError: the job did not start"),
    ]
    bench = gen.bench_accuracy()
    [f] = gen.families(runs, bench)
    assert (f.faulty_right, f.faulty, f.healthy_clean, f.healthy, f.false) == (2, 3, 1, 2, 1)
    assert f.step_errs == pytest.approx([0.01, 0.04, 0.0])
    assert f.cost_errs == pytest.approx([0.2, -0.1])
    table = gen.table(runs, bench)
    assert "3 cases (1 families x healthy, compute, hang as each takes them) x 2 fresh jobs each, 5 runs " \
           "(1 more failed to run):" in table
    assert f.wrong == ["healthy 1/2", "hang 0/1"]
    assert "| DDP `static_graph` | `static-3` | 2/3 | 1/2 | 1 | 1.0% (4.0%) | +5% (-10% to +20%) | healthy 1/2, " \
           "hang 0/1 |" in table
