"""The Helm chart's PrometheusRule (alerts.enabled=true): every expression parses as PromQL and names only
metrics a live agent's or cluster analyzer's /metrics serves (test_dashboard's check), each alert is routed
by the labels it promises; and the metrics the alerts read: windows a finding held, each rank's node, and
when the last window closed."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

import promql_parser
import pytest
import yaml
from test_dashboard import _metric_names, _served
from test_metrics import _scrape, _values
from test_server import SNAP

from rankscope.agent.service.history import StepHistory
from rankscope.agent.service.snapshot import AgentHealth

ROOT = Path(__file__).resolve().parents[2]
HELM = ROOT / ".tools" / "helm"  # scripts/install fetches it
CHART = ROOT / "deploy" / "helm" / "rankscope"
TOKENS = ("--set", "token.value=read-token", "--set", "token.captureValue=capture-token")  # the chart needs both
ROUTED = {"RankscopeFinding": {"job", "kind", "rank", "node"}, "RankscopeRegression": {"job", "kind"},
          "RankscopeHang": {"job", "kind", "rank", "node"}, "RankscopeStalled": {"component", "node"}}


def _render(*values: str) -> list[dict]:
    if not HELM.exists():
        pytest.skip("helm is missing: scripts/install fetches it into .tools/")
    out = subprocess.run([str(HELM), "template", "rankscope", str(CHART), *TOKENS, *values], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _rules() -> list[dict]:
    (rule,) = [d for d in _render("--set", "alerts.enabled=true", "--set", "alerts.labels.team=ml")
               if d["kind"] == "PrometheusRule"]
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def _grouping(node) -> set[str]:
    """The labels an expression's outermost aggregation keeps (what its alerts carry)."""
    while not isinstance(node, promql_parser.AggregateExpr):
        node = node.lhs if isinstance(node, promql_parser.BinaryExpr) and not _is_scalar(node.lhs) else node.rhs
    return set(node.modifier.labels)


def _is_scalar(node) -> bool:
    return isinstance(node, promql_parser.NumberLiteral) or isinstance(node, promql_parser.Call)


def test_no_rule_is_rendered_unless_alerts_are_enabled():
    assert not [d for d in _render() if d["kind"] == "PrometheusRule"]


def test_every_alert_reads_served_metrics_and_carries_its_routing_labels():
    served = _served()
    rules = _rules()
    assert {r["alert"] for r in rules} == set(ROUTED)
    for r in rules:
        names = _metric_names(r["expr"])
        assert names and names <= served, (r["alert"], names - served)
        assert _grouping(promql_parser.parse(r["expr"])) == ROUTED[r["alert"]], r["alert"]
        assert r["labels"]["team"] == "ml" and r["labels"]["severity"] in ("critical", "warning")
        assert "{{ $labels." in r["annotations"]["summary"] and r["annotations"]["page"].startswith("http")


def test_chart_refuses_a_bad_alert_value():
    if not HELM.exists():
        pytest.skip("helm is missing")
    out = subprocess.run([str(HELM), "template", "rankscope", str(CHART), "--set", "alerts.finding.minCost=2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "minCost" in out.stderr


def _doc(end: float, kinds: list[str]) -> dict:
    return {"job": "job-a", "window": {"start": end - 5, "end": end}, "step_time_s": 0.1, "baseline": None,
            "ranks": [{"rank": r, "host": f"node{r // 2}", "step_time_s": 0.1} for r in range(4)],
            "findings": [{"kind": k, "ranks": [1, 2], "cost": 0.3, "summary": "", "evidence": {}} for k in kinds]}


def test_held_windows_count_the_windows_in_a_row_for_each_named_rank_and_its_node():
    history = StepHistory()
    kinds = [["python_gc"], [], ["python_gc", "compute_straggler"], ["python_gc", "compute_straggler"],
             ["python_gc"]]
    for i, window in enumerate(kinds):
        history.record({"job-a": _doc(1000.0 + 5 * i, window)})
    last = _doc(1020.0, kinds[-1])
    closed = time.time()
    snap = SNAP.__class__(diagnoses={"job-a": last}, history=history, health=AgentHealth(last_window=closed))
    _, families = _scrape(snap)
    held = {tuple(v for _, v in k): n for k, n in _values(families["rankscope_finding_held_windows"]).items()}
    assert held == {("job-a", "python_gc", "node0", "1"): 3, ("job-a", "python_gc", "node1", "2"): 3}
    (stamp,) = _values(families["rankscope_last_window_timestamp_seconds"], component="agent").values()
    assert stamp == closed
