"""Every finding says why: the test that named it (`criterion`), the figures it compared, each past its
threshold (`why`), and the candidates it replaced (`outranked`). Checked on every kept real window and agent
run, and on hand-built jobs with one fault of each kind the rules report; a rule that forgets them fails here."""
from __future__ import annotations

import json
import shutil
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from kept import agent_run, run_names, window, window_names
from test_analyzer import set_function, simulate
from test_analyzer_baseline import RANKS, _stage_baseline, _stages, _window, warmed
from test_analyzer_contention import HOG, with_sched
from test_analyzer_gpu import gpu, health, with_health
from test_analyzer_hangs import rank as hung_rank
from test_analyzer_links import job, ring
from test_analyzer_python import with_python

from rankscope.agent.report import render
from rankscope.analyzer.baseline import MIN_WINDOWS, Baseline
from rankscope.analyzer.diagnosis import diagnose_job
from rankscope.analyzer.rules.nodes import LostRanks, unreachable
from rankscope.schema.finding import Finding, Why
from rankscope.schema.patterns import FunctionStats, Role

# The tests each kind's rules can name a finding by (docs/api.md lists them with their figures).
CRITERIA = {
    "compute_straggler": {"arrives_last", "arrives_last_far_behind", "arrives_last_often", "always_late",
                          "late_all_through", "longer_in_user_mode", "small_straggler", "steady_straggler",
                          "works_longer", "gpu_works_longer", "stage_work_grew"},
    "cpu_contention": {"cpu_contended"},
    "gpu_throttle": {"gpu_clock_drop"},
    "launch_bound": {"launch_bound"},
    "node_fault": {"every_rank_of_node_straggles"},
    "node_unreachable": {"agent_not_answering"},
    "slow_link": {"link_matrix_slow", "link_matrix_slow_rank", "late_finish_low_bandwidth",
                  "late_finish_bandwidth_unknown"},
    "regression": {"step_slower_than_baseline", "slower_waiting_for_cpu"},
    "noncomm_hang": {"blocked_outside_comm", "stopped", "minority_state"},
    "comm_hang": {"all_in_collective"},
}
CRITERIA["input_straggler"] = CRITERIA["python_gc"] = CRITERIA["compute_straggler"] - {"gpu_works_longer",
                                                                                       "stage_work_grew"}
WHY_KEYS = {"measure", "value", "threshold", "unit", "op"}


def check(f: dict[str, Any]) -> None:
    """A finding (or a suspect of one) that says why, every figure past its threshold."""
    where = (f["kind"], f["ranks"])
    assert f["criterion"] in CRITERIA[f["kind"]], where
    assert f["why"], where
    for w in f["why"]:
        assert WHY_KEYS <= set(w) <= WHY_KEYS | {"rank"}, (where, w)
        assert isinstance(w["measure"], str) and w["measure"] and isinstance(w["unit"], str), (where, w)
        assert w.get("rank", f["ranks"][0]) in f["ranks"], (where, w)
        assert Why(**w).crossed(), (where, f["criterion"], w)
    for o in f.get("outranked", []):
        assert set(o) == {"kind", "ranks", "criterion", "reason"}, (where, o)
        assert o["kind"] in CRITERIA and o["ranks"] and all(isinstance(r, int) for r in o["ranks"]), (where, o)
        assert o["criterion"] is None or o["criterion"] in CRITERIA[o["kind"]], (where, o)
        assert isinstance(o["reason"], str) and o["reason"], (where, o)


def checked(docs: dict[str, dict]) -> list[dict]:
    """Every finding and suspect of the documents, each checked, and the findings returned."""
    out = []
    for doc in docs.values():
        json.dumps(doc, allow_nan=False)  # strict JSON, figures included
        for f in doc["findings"]:
            check(f)
            assert {"criterion", "why", "outranked"} <= set(f)
            out.append(f)
        for u in doc.get("unconfirmed", []):
            if "criterion" in u or "needs" in u:  # a look's suspects always say; the agent's, where it knew
                check(u)
    return out


def test_every_finding_of_the_kept_real_windows_says_why():
    """Each window with the hang timeout its test diagnoses it with (the matrix's 4 s for hangs)."""
    seen = [f for folder in ("windows", "gpu-windows", "agent-windows") for name in window_names(folder)
            for f in checked(window(folder, name))]
    assert {f["kind"] for f in seen} >= {"compute_straggler", "input_straggler", "cpu_contention", "slow_link",
                                         "noncomm_hang"}


def test_every_finding_of_the_kept_agent_runs_says_why_and_so_do_their_suspects():
    """Windows in order with the job's baseline, confirmed as the agent does: its held and pending ones too."""
    seen = []
    for name in run_names():
        for docs in agent_run(name, 30.0):
            seen += checked(docs)
            assert all(u["criterion"] and u["why"] for doc in docs.values() for u in doc["unconfirmed"])
    assert {f["kind"] for f in seen} >= {"compute_straggler", "regression"}


def _starved() -> list[dict]:
    """mlp-2's agent windows: its baseline the job before its neighbours' load came on, then a window beside it."""
    b = Baseline()
    for _ in range(MIN_WINDOWS):
        diagnose_job(_window(0, attached=False), baseline=b)
    return checked({"j": diagnose_job(_window(3), baseline=b)})


def _hangs() -> list[dict]:
    """The four ways a hang is told (test_analyzer_hangs' ranks: stalled 40 s against a 30 s timeout)."""
    jobs = [
        [hung_rank(0, "waiting for ncclAllReduce (futex (futex_wait))"), hung_rank(1, "futex (futex_wait)"),
         hung_rank(2, "clock_nanosleep (hrtimer_nanosleep)")],
        [hung_rank(0, "futex (futex_wait_queue)"), hung_rank(1, "futex (do_signal_stop)")],
        [hung_rank(r, "futex (futex_wait)") for r in range(3)] + [hung_rank(3, "poll (do_sys_poll)")],
        [hung_rank(r, "futex (futex_wait)") for r in range(4)],
    ]
    return [f for ps in jobs for f in checked({"j": diagnose_job(ps, 30.0)})]


def _launch_bound() -> list[dict]:
    """17.5 us kernels, the GPU busy 35% of the window, its host hardly waiting for it."""
    ps = simulate(4, seed=1)
    for p in ps:
        set_function(p, replace(p.functions["cuStreamSynchronize"], total_s=0.05))
        p.gpu = gpu(busy_s=0.7, kernels=40_000, kernel_s=0.7)
    return checked({"j": diagnose_job(ps)})


def _gc_pauses() -> list[dict]:
    """Rank 0 collects garbage 15 ms a step longer than its peers."""
    ps = simulate(4, host_extra={0: 0.015})
    steps = ps[0].window_s / 0.048
    for p in ps:
        gc_s = (0.001 + (0.015 if p.rank == 0 else 0.0)) * steps
        set_function(p, FunctionStats("gc_collect_main", Role.GC, 40, gc_s, 0.02, 0.01, 0.02))
    return checked({"j": diagnose_job(ps)})


def _regression_restated_by_its_straggler() -> list[dict]:
    b = Baseline()
    for seed in range(8):
        diagnose_job(simulate(2, seed=seed), baseline=b)
    return checked({"j": diagnose_job(simulate(2, seed=42, host_extra={0: 0.004, 1: 0.012}), baseline=b)})


SCENARIOS: dict[str, Callable[[], list[dict]]] = {
    "hangs": _hangs,
    "gpu throttle": lambda: checked({"j": diagnose_job(with_health(simulate(8, sync_extra={5: 0.030}, seed=3),
                                                                   {5: health(5, 1395, 0x20 | 0x8, 88)}))}),
    "launch bound": _launch_bound,
    "node fault": lambda: checked({"j": diagnose_job(simulate(8, sync_extra={4: 0.02, 5: 0.021},
                                                              ranks_per_host=2))}),
    "cpu contention": lambda: checked({"j": diagnose_job(with_sched(simulate(4, host_extra={3: 0.015}),
                                                                    runq_extra={3: 0.014}, neighbour=HOG))}),
    "python gc": _gc_pauses,
    "input straggler": lambda: checked({"j": diagnose_job(with_python(simulate(4, host_extra={1: 0.02}),
                                                                      {1: ("train.py:load_batch", 0.02)}))}),
    "slow link pair": lambda: checked({"j": diagnose_job(ring(job(), list(range(8)), slow={(3, 4): 5.0}))}),
    "slow link node beside the timing rule": lambda: checked({"j": diagnose_job(
        ring(job(link_extra={5: 0.015}), list(range(8)), slow={(4, 5): 4.0, (5, 6): 4.0}))}),
    "slow link by timing": lambda: checked({"j": diagnose_job(job(link_extra={5: 0.015}))}),
    "regression": lambda: checked({"j": diagnose_job(
        simulate(RANKS, seed=42, sync_extra=dict.fromkeys(range(RANKS), 0.012)), baseline=warmed())}),
    "regression restated": _regression_restated_by_its_straggler,
    "regression waiting for a cpu": _starved,
    "pipeline stage grown": lambda: checked({"j": diagnose_job(_stages(21, grown={1: 0.03}),
                                                               baseline=_stage_baseline())}),
    "node unreachable": lambda: checked({"j": {"findings": [unreachable(LostRanks(
        "http://agent-3:9464", "node3", (6, 7), 1.7e9, "connection refused")).to_dict()]}}),
}


@pytest.fixture(scope="module")
def scenarios() -> dict[str, list[dict]]:
    return {name: make() for name, make in SCENARIOS.items()}


def test_every_kind_the_rules_report_says_why(scenarios):
    kinds = {f["kind"] for fs in scenarios.values() for f in fs}
    assert kinds == set(CRITERIA)
    assert {f["criterion"] for f in scenarios["hangs"]} == {"blocked_outside_comm", "stopped", "minority_state",
                                                            "all_in_collective"}


def test_a_hang_says_how_long_against_its_timeout(scenarios):
    for f in scenarios["hangs"]:
        stalled = next(w for w in f["why"] if w["measure"] == "stalled_for_s")
        assert stalled["value"] == f["evidence"]["stalled_for_s"] and stalled["threshold"] == 30.0


def test_a_throttled_gpu_outranks_its_ranks_gpu_straggling(scenarios):
    """Rank 5's GPU is slowed by a thermal reason and its rank straggles on the GPU side (the injected sync)."""
    f, = scenarios["gpu throttle"]
    assert f["kind"] == "gpu_throttle" and f["criterion"] == "gpu_clock_drop"
    drop = next(w for w in f["why"] if w["measure"] == "clock_drop")
    clocks = [1395 if r == 5 else 1980 - 5 * r for r in range(8)]  # as injected: every rank's, rank 5's slowed
    assert drop["value"] == pytest.approx((statistics.median(clocks) - 1395) / 1980)
    assert [(o["kind"], o["ranks"]) for o in f["outranked"]] == [("compute_straggler", [5])]
    assert "throttled GPU" in f["outranked"][0]["reason"]


def test_the_link_matrix_outranks_the_timing_rules_slow_link_of_its_ranks(scenarios):
    f, = scenarios["slow link node beside the timing rule"]
    assert f["criterion"] == "link_matrix_slow_rank" and f["ranks"] == [5]
    assert [(o["kind"], o["ranks"], o["criterion"]) for o in f["outranked"]] == [
        ("slow_link", [5], "late_finish_low_bandwidth")]
    slowdowns = [w["value"] for w in f["why"] if w["measure"] == "link_slowdown"]
    assert slowdowns == [pytest.approx(20 / 4)] * 2  # both of rank 5's links at 4 of 20 GB/s


def test_a_straggler_that_explains_the_regression_outranks_it(scenarios):
    f, = scenarios["regression restated"]
    assert f["kind"] == "compute_straggler" and f["ranks"] == [1]
    assert [(o["kind"], o["criterion"]) for o in f["outranked"]] == [("regression", "step_slower_than_baseline")]


def test_a_job_waiting_longer_for_its_cpus_says_so(scenarios):
    f, = scenarios["regression waiting for a cpu"]
    assert (f["kind"], f["criterion"]) == ("regression", "slower_waiting_for_cpu")
    assert [w["measure"] for w in f["why"]][-2:] == ["cpu_wait_growth", "cpu_run_growth"]


def test_a_grown_pipeline_stage_says_how_much_of_the_slowdown_is_its_work(scenarios):
    """Stage 1 alone in its role, 30 ms a step longer than its past; stage 0's work as before (it waits)."""
    f, = scenarios["pipeline stage grown"]
    assert (f["kind"], f["ranks"], f["criterion"]) == ("compute_straggler", [1], "stage_work_grew")
    assert [w["measure"] for w in f["why"]] == ["step_growth", "run_growth_z", "stage_work_growth",
                                                "others_work_growth"]
    assert next(w for w in f["why"] if w["measure"] == "stage_work_growth")["rank"] == 1


def test_nothing_outranked_is_an_empty_list(scenarios):
    f, = scenarios["slow link pair"]
    assert f["outranked"] == [] and f["criterion"] == "link_matrix_slow"


def test_a_figure_rounded_into_its_threshold_keeps_its_digits():
    w = Why("late_by", 0.0500000004, 0.05, "share of step", ">")
    assert w.crossed() and Why(**w.to_dict()).crossed()
    assert Why("late_share", 0.93, 0.85, "share of steps").to_dict() == {
        "measure": "late_share", "value": 0.93, "threshold": 0.85, "unit": "share of steps", "op": ">="}
    with pytest.raises(ValueError):
        Why("late_share", 0.93, 0.85, "share of steps", "=>")


def test_a_finding_of_an_older_agent_keeps_its_fields_and_adds_the_three():
    f = Finding("slow_link", [3, 4], None, "link", 4.0, 0.1, "link 3 -> 4 is slow")
    assert list(f.to_dict()) == ["kind", "ranks", "function", "component", "score", "cost", "summary", "evidence",
                                 "criterion", "why", "outranked"]


def test_the_report_says_because_and_what_was_outranked(scenarios):
    f, = scenarios["gpu throttle"]
    doc = {"job": "j", "window": {"start": 0, "end": 2}, "ranks": [], "findings": [f]}
    lines = render(doc).splitlines()
    because = next(line for line in lines if line.startswith("   because "))
    assert because.startswith("   because gpu_clock_drop: own_work_z ")
    assert "clock_drop 0.287 >= 0.1 (of max SM clock, below the peers')" in because
    outranked = next(line for line in lines if line.startswith("   outranked: "))
    assert outranked.startswith("   outranked: compute_straggler (") and "of rank 5 (a throttled GPU" in outranked
    # A document of an agent that did not say why: no such line
    old = {k: v for k, v in f.items() if k not in ("criterion", "why", "outranked")}
    assert not [line for line in render({**doc, "findings": [old]}).splitlines() if "because" in line]


def test_the_reports_figures_name_their_rank_where_a_finding_names_several():
    doc = {"job": "j", "window": {}, "ranks": [], "findings": [{
        "kind": "node_fault", "ranks": [4, 5], "function": None, "component": "host", "score": 5.0, "cost": 0.3,
        "summary": "every rank on node2 computes longer", "evidence": {}, "criterion": "every_rank_of_node_straggles",
        "why": [Why("hosts", 4, 2, "hosts").to_dict(), Why("own_work_z", 7.25, 4.0, "robust z", rank=5).to_dict()],
        "outranked": []}]}
    because = next(line for line in render(doc).splitlines() if "because" in line)
    assert because == ("   because every_rank_of_node_straggles: hosts 4 >= 2 (hosts); "
                       "rank 5 own_work_z 7.25 >= 4 (robust z)")


# The page's script under node, with just enough of a DOM for its el(): the text of a finding box's why lines.
PAGE_JS = r"""
const vm = require("vm"), fs = require("fs");
class Node {
  constructor(tag) { this.tag = tag; this.attrs = {}; this.children = []; this.style = {}; this.dataset = {}; }
  setAttribute(k, v) { this.attrs[k] = String(v); }
  append(...cs) { this.children.push(...cs); }
  replaceChildren(...cs) { this.children = cs; }
  get textContent() { return this.children.map(c => typeof c === "string" ? c : c.textContent).join(""); }
  set textContent(v) { this.children = [String(v)]; }
}
globalThis.Node = Node;
globalThis.document = {createElement: t => new Node(t), createElementNS: (ns, t) => new Node(t),
                       getElementById: () => new Node("div"), body: new Node("body")};
globalThis.fetch = async () => { throw new Error("offline"); };
globalThis.setInterval = () => 0;
vm.runInThisContext(fs.readFileSync(process.argv[1], "utf8").split("<script>")[1].split("</script>")[0]);
const lines = [];
const walk = n => {
  if (typeof n === "string") return;
  if ((n.attrs.class || "").split(" ").includes("why")) lines.push(n.textContent);
  n.children.forEach(walk);
};
walk(vm.runInThisContext("findingBox")(JSON.parse(fs.readFileSync(0, "utf8")), true));
console.log(JSON.stringify(lines));
"""


def page_why(f: dict[str, Any]) -> list[str]:
    from rankscope.agent.service.page import PAGE
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (the browser test renders the page: tests/system/test_page_browser.py)")
    out = subprocess.run([node, "-e", PAGE_JS, str(PAGE)], input=json.dumps(f), capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout)


def test_the_page_shows_why_under_the_summary(scenarios):
    f, = scenarios["gpu throttle"]
    because, outranked = page_why(f)
    assert because.startswith("because gpu_clock_drop: own_work_z ")
    assert "clock_drop 0.287 >= 0.1 (of max SM clock, below the peers')" in because
    assert outranked.startswith("outranked: compute_straggler (") and "of rank 5 (a throttled GPU" in outranked
    assert page_why({k: v for k, v in f.items() if k not in ("criterion", "why", "outranked")}) == []
    several = next(f for f in scenarios["node fault"] if f["kind"] == "node_fault")  # ranks 4 and 5, node2's
    assert "rank 4 own_work_z" in page_why(several)[0] and "rank 5 own_work_z" in page_why(several)[0]
