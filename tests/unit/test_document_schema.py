"""The diagnosis document's JSON Schema (rankscope/schema/diagnosis.schema.json) against the documents the
analyzer builds: every kept window of a real job, every kept agent run window after window (with its
baseline), and hand-built patterns of the kinds no kept window has (hangs, GPU views, links, nodes). Between
them every finding kind of the schema is produced; a document the schema refuses fails here, not in a reader."""
from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import check_document
from kept import agent_run, run_names, window, window_names
from test_analyzer import set_function, simulate
from test_analyzer_baseline import RANKS, warmed
from test_analyzer_gpu import gpu, health, with_health
from test_analyzer_hangs import rank as hung_rank
from test_analyzer_links import job as link_job
from test_analyzer_links import ring

from rankscope.agent.service.cluster_analyzer import AgentStatus
from rankscope.analyzer.cluster import diagnose_cluster
from rankscope.analyzer.diagnosis import diagnose_job
from rankscope.analyzer.rules.nodes import LostRanks
from rankscope.schema.document import diagnosis_schema

KINDS = set(diagnosis_schema()["$defs"]["kind"]["enum"])


def kept_windows() -> list[dict]:
    """One look (`diagnose`) at every kept window of a real job, with the hang timeout its fault needs."""
    return [doc for folder in ("windows", "agent-windows") for name in window_names(folder)
            for doc in window(folder, name).values()]


def kept_agent_runs() -> list[dict]:
    """Every window of every kept agent run, as the agent serves it: against the job's own baseline, each finding
    under `unconfirmed` until it held long enough."""
    return [doc for name in run_names() for docs in agent_run(name) for doc in docs.values()]


def hand_built() -> list[dict]:
    """Documents of the kinds only hand-built patterns produce (as the analyzer's own unit tests build them)."""
    docs = [
        diagnose_job([hung_rank(0, "waiting for ncclAllReduce (futex (futex_wait))"), hung_rank(1, "futex (futex_wait)"),
                      hung_rank(2, "clock_nanosleep (hrtimer_nanosleep)"), hung_rank(3, "futex (futex_wait)")]),
        diagnose_job([hung_rank(r, "futex (futex_wait)") for r in range(4)]),
        diagnose_job(with_health(simulate(8, sync_extra={5: 0.030}, seed=3), {5: health(5, 1395, 0x20 | 0x8, 88)})),
        diagnose_job(ring(link_job(), list(range(8)), slow={(3, 4): 5.0})),
        diagnose_job(simulate(RANKS, seed=42, sync_extra=dict.fromkeys(range(RANKS), 0.012)), baseline=warmed()),
        diagnose_job(simulate(8, sync_extra={4: 0.02, 5: 0.021}, ranks_per_host=2)),
    ]
    launching = simulate(4, seed=1)
    for p in launching:
        set_function(p, replace(p.functions["cuStreamSynchronize"], total_s=0.05))  # the host hardly waits for it
        p.gpu = gpu(busy_s=0.7, kernels=40_000, kernel_s=0.7)  # short kernels, the GPU idle most of the window
    docs.append(diagnose_job(launching))
    lost = {"job-a": [LostRanks("http://10.0.0.9:9464", "node9", (8, 9), 1.7e9, "connection refused")]}
    cluster = diagnose_cluster(simulate(8), lost)
    docs += [{**doc, "agents": [vars(AgentStatus("http://10.0.0.9:9464", "down", "connection refused"))]}
             for doc in cluster.values()]
    return docs


@pytest.fixture(scope="module")
def documents() -> list[dict]:
    return [*kept_windows(), *kept_agent_runs(), *hand_built()]


def test_every_document_the_analyzer_builds_is_valid(documents):
    for doc in documents:
        check_document(json.loads(json.dumps(doc, allow_nan=False)))  # as a reader gets it: strict JSON


def test_an_agents_unconfirmed_findings_are_valid(documents):
    assert any(doc.get("unconfirmed") and "needs" not in doc["unconfirmed"][0] for doc in documents)


def test_the_documents_cover_every_finding_kind_of_the_schema(documents):
    seen = {f["kind"] for doc in documents for f in doc["findings"]}
    assert seen == KINDS


def test_the_document_before_any_window_and_an_agent_document_are_valid():
    from rankscope.agent.service.http import empty_diagnosis
    check_document(empty_diagnosis())
    doc = diagnose_job(simulate(4))
    check_document({**doc, "mode": {"level": "deep", "since": 1.7e9, "until": 1.7e9 + 60, "job": doc["job"],
                                    "reason": "step time 68.7 ms is 43% above the job's baseline 47.9 ms"}})


def straggler_document() -> dict:
    doc = diagnose_job(simulate(4, sync_extra={2: 0.03}))
    assert doc["findings"] and doc["findings"][0]["kind"] == "compute_straggler"
    return doc


def test_a_finding_explains_itself_with_criterion_why_and_outranked():
    doc = straggler_document()
    doc["findings"][0] |= {
        "criterion": "arrives_last",
        "why": [{"measure": "late_share", "value": 0.97, "threshold": 0.85, "unit": "share of steps", "op": ">="},
                {"measure": "work_excess", "value": None, "threshold": 0.05, "unit": "share of step", "op": ">"}],
        "outranked": [{"kind": "slow_link", "ranks": [2, 3], "criterion": None,
                       "reason": "the rank computes longer than its peers: its links wait for it"}],
    }
    check_document(doc)


@pytest.mark.parametrize("break_it, where", [
    (lambda f: f.pop("kind"), "'kind' is a required property"),
    (lambda f: f.update(cost="0.37"), "'0.37' is not of type 'number'"),
    (lambda f: f.update(kind="slow_gpu"), "is not one of"),
    (lambda f: f.update(ranks=["2"]), "'2' is not of type 'integer'"),
    (lambda f: f.update(why=[{"measure": "late_share", "value": 0.9, "threshold": 0.85, "unit": "", "op": "=>"}]),
     "'=>' is not one of"),
    (lambda f: f.update(outranked=[{"kind": "slow_link", "ranks": [2]}]), "'criterion' is a required property"),
])
def test_a_broken_document_fails(break_it, where):
    doc = copy.deepcopy(straggler_document())
    break_it(doc["findings"][0])
    with pytest.raises(AssertionError, match=where):
        check_document(doc)


@pytest.mark.parametrize("outside, where", [
    ({"seconds": 1.5, "share": 0.3}, "'longest_s' is a required property"),
    ({"seconds": "1.5", "share": 0.3, "longest_s": 1.5}, "'1.5' is not of type 'number'"),
    ({"seconds": -1.0, "share": 0.3, "longest_s": 1.5}, "less than the minimum"),
])
def test_time_outside_steps_is_an_object_of_three_numbers_or_null(outside, where):
    doc = straggler_document()
    check_document({**doc, "outside_steps": None})
    check_document({**doc, "outside_steps": {"seconds": 1.5, "share": 0.3, "longest_s": 1.5}})
    with pytest.raises(AssertionError, match=where):
        check_document({**doc, "outside_steps": outside})


def test_a_document_extended_with_fields_it_does_not_know_stays_valid():
    doc = straggler_document()
    doc["findings"][0]["a_later_field"] = {"any": "shape"}
    check_document({**doc, "a_later_section": [1, 2]})


def test_the_schema_ships_with_the_package():
    import tomllib
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert "*.json" in project["tool"]["setuptools"]["package-data"]["rankscope.schema"]


def test_the_readmes_example_document_is_valid():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## The diagnosis document", 1)[1]
    example = section.split("```json\n", 1)[1].split("```", 1)[0]
    doc = check_document(json.loads(example))
    assert {"criterion", "why", "outranked"} <= set(doc["findings"][0])
