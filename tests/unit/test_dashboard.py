"""deploy/grafana/rankscope.json: every query parses as PromQL (a real parser) and names only metrics that a
live agent's or cluster analyzer's /metrics serves, so a renamed metric cannot leave an empty panel."""
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import promql_parser
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families
from test_metrics import _scrape, _snapshot

from rankscope.agent.service.cluster_analyzer import AgentStatus, ClusterSnapshot, make_cluster_app

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "rankscope.json"
# Grafana's own syntax around PromQL: its range variables, and label_values(SELECTOR, LABEL) of a variable.
GRAFANA_RANGES = {"$__rate_interval": "1m", "$__range": "1h", "$__interval": "1m"}
LABEL_VALUES = re.compile(r"^label_values\((.*),\s*\w+\)$")


def _queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert panels and all(p["targets"] for p in panels)
    queries = [t["expr"] for p in panels for t in p["targets"]]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            queries.append(LABEL_VALUES.match(var["query"]["query"]).group(1))
    return queries


def _metric_names(expr: str) -> set[str]:
    for variable, duration in GRAFANA_RANGES.items():
        expr = expr.replace(variable, duration)
    return _selected(promql_parser.parse(expr))


def _selected(node) -> set[str]:
    if isinstance(node, promql_parser.VectorSelector):
        return {node.name}
    children = [getattr(node, a, None) for a in ("expr", "lhs", "rhs", "param", "vector_selector")]
    children += getattr(node, "args", None) or []
    return set().union(*(_selected(c) for c in children if c is not None))


def _served() -> set[str]:
    """Metric names in one agent's and one cluster analyzer's exposition: the families each declares (a
    family without samples now, e.g. the baseline before three windows, included), counters with _total."""
    snap = _snapshot()
    agent_text, _ = _scrape(snap)
    cluster = ClusterSnapshot(agents=[AgentStatus("http://agent-0:9464", state="up")], diagnoses=snap.diagnoses)

    async def go():
        async with TestClient(TestServer(make_cluster_app(lambda: cluster, None))) as c:
            return await (await c.get("/metrics")).text()

    texts = (agent_text, asyncio.run(go()))
    families = [f for text in texts for f in text_string_to_metric_families(text)]
    return {f.name + "_total" if f.type == "counter" else f.name for f in families}


def test_parser_finds_every_selected_metric():
    expr = ('sum by (job) (rate(a_total{job=~"$job"}[$__rate_interval])) / on (job) group_left '
            'max(b{phase="comm"} offset 5m) + count(-(c)) * max_over_time(d[1h:1m]) > bool 1e6')
    assert _metric_names(expr) == {"a_total", "b", "c", "d"}


def test_every_query_names_a_served_metric():
    served = _served()
    assert {"rankscope_windows_total", "DCGM_FI_DEV_SM_CLOCK", "rankscope_cluster_jobs"} <= served
    for expr in _queries():
        names = _metric_names(expr)
        assert names and names <= served, (expr, names - served)
