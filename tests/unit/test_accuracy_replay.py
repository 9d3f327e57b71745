"""`scripts/bench accuracy --replay`: kept windows diagnosed again by the current analyzer, scored as kept."""
import importlib.util
import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from test_analyzer import simulate
from test_analyzer_links import MBPS, tcp_ring

from rankscope.schema.wire import encode_patterns

ROOT = Path(__file__).resolve().parents[2]


def bench_accuracy():
    spec = importlib.util.spec_from_file_location("bench_accuracy", ROOT / "scripts" / "bench_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_accuracy"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def keep(bench, folder: Path, name: str, fault: str, patterns, findings: list[str], step: float) -> None:
    """A window as the matrix keeps it: patterns, and the run (the verdict then, the job's truth)."""
    run = bench.Run("mlp-4", fault, right=False, false=[], findings=findings, truth_step_s=step,
                    truth_cost=0.25 if fault == "compute" else None)
    (folder / f"{name}.msgpack").write_bytes(encode_patterns(patterns))
    (folder / f"{name}.json").write_text(json.dumps({"run": asdict(run), "document": {}, "log": ""}))


def test_replay_scores_kept_windows_with_the_current_analyzer(tmp_path):
    bench = bench_accuracy()
    keep(bench, tmp_path, "mlp-4-compute-a-0", "compute", simulate(4, host_extra={3: 0.016}), [], 0.064)
    keep(bench, tmp_path, "mlp-4-healthy-b-0", "healthy", simulate(4), ["slow_link[2]"], 0.048)
    runs = {r.fault: r for r in bench.replay([tmp_path])}
    assert runs["compute"].right and runs["compute"].findings == ["compute_straggler[3]"]
    assert runs["compute"].cost is not None and runs["compute"].cost_err is not None
    assert runs["compute"].injected_cost == min(bench.added_s(0.75 * 0.064) / 0.064, 1.0)
    # the finding's "N ms longer per step" (the simulated rank's 16 ms) against the delay the matrix injects
    assert runs["compute"].extra_s == pytest.approx(0.016, abs=0.002)
    assert runs["compute"].injected_s == bench.added_s(0.75 * 0.064)
    assert runs["healthy"].right and runs["healthy"].false == []
    table = bench.table(bench.summarize(list(runs.values())))
    assert "| mlp-4 | compute |" in table and "of injected" in table


def test_a_replay_saves_its_runs_as_the_current_analyzers_matrix(tmp_path, capsys):
    """--replay --json: the kept windows' runs, diagnosed again, saved under the current code's version with the
    folders they came from, so an analyzer change is measured on every window kept so far; --table reads them."""
    bench = bench_accuracy()
    kept = tmp_path / "kept"
    kept.mkdir()
    keep(bench, kept, "mlp-4-compute-a-0", "compute", simulate(4, host_extra={3: 0.016}), [], 0.064)
    keep(bench, kept, "mlp-4-healthy-b-0", "healthy", simulate(4), ["slow_link[2]"], 0.048)
    out = tmp_path / "replayed.json"
    assert bench.main(["--replay", str(kept), "--json", str(out)]) == 0
    replayed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["code"] == bench.code_version() and saved["replayed"] == [str(kept)]
    assert [s["name"] for s in saved["shapes"]] == ["mlp-4"]
    assert sorted((r["fault"], r["right"], r["findings"]) for r in saved["runs"]) == [
        ("compute", True, ["compute_straggler[3]"]), ("healthy", True, [])]
    assert bench.main(["--table", str(out)]) == 0
    assert capsys.readouterr().out == replayed  # in the matrix's order
    assert bench.main(["--replay", str(kept), "--faults", "healthy", "--json", str(out)]) == 0  # some cases only
    assert [r["fault"] for r in json.loads(out.read_text())["runs"]] == ["healthy"]


def test_a_kept_window_without_a_reference_is_scored_against_the_shapes_healthy_step(tmp_path):
    """A batch of one fault (slow links, say) ran no healthy case first: its windows' costs are scored against
    the healthy windows of the same shape in the corpus (their median step)."""
    bench = bench_accuracy()
    keep(bench, tmp_path, "mlp-4-slowlink-a-0", "slowlink", simulate(4, link_extra={3: 0.016}), [], 0.064)
    for i, step in enumerate((0.047, 0.048, 0.052)):
        keep(bench, tmp_path, f"mlp-4-healthy-b-{i}", "healthy", simulate(4, seed=i), [], step)
    slow = next(r for r in bench.replay([tmp_path]) if r.fault == "slowlink")
    assert slow.right and slow.findings == ["slow_link[3]"]
    assert slow.truth_cost == pytest.approx(1 - 0.048 / 0.064) and slow.cost is not None


def test_a_slower_simulated_gpu_is_scored_against_its_kernels_extra_time_without_a_reference():
    """The delay is the job's own model (its kernels' time a step), known whatever the healthy step."""
    bench = bench_accuracy()
    sim = next(s for s in bench.SHAPES if s.sim)
    assert bench.injected_s(sim, "compute-small", None, 0.05) == pytest.approx(0.15 * bench.GPU_S_PER_STEP)
    assert bench.injected_s(sim, "loader", None, 0.05) is None  # scaled to the healthy step: unknown


def test_a_missed_window_reads_beside_what_its_fault_cost_the_job(tmp_path):
    """A slow link hidden behind a CPU-bound step slows its job by nothing: its missed windows show that, as an
    agent case's misses do (the table's "job slowed (missed)"), and a right one its slowdown too."""
    bench = bench_accuracy()
    keep(bench, tmp_path, "mlp-4-slowlink-a-0", "slowlink", simulate(4), [], 0.0485)
    keep(bench, tmp_path, "mlp-4-slowlink-a-1", "slowlink", simulate(4, link_extra={3: 0.016}), [], 0.064)
    for i, step in enumerate((0.047, 0.048, 0.052)):
        keep(bench, tmp_path, f"mlp-4-healthy-b-{i}", "healthy", simulate(4, seed=i), [], step)
    runs = bench.replay([tmp_path])
    missed, found = sorted((r for r in runs if r.fault == "slowlink"), key=lambda r: r.truth_step_s)
    assert not missed.right and missed.job_slowed == pytest.approx(0.0485 / 0.048 - 1)
    assert found.right and found.job_slowed == pytest.approx(0.064 / 0.048 - 1)
    assert all(r.job_slowed is None for r in runs if r.fault == "healthy")
    row = next(r for r in bench.summarize(runs) if r["fault"] == "slowlink")
    assert row["missed_slowed"] == [pytest.approx(0.0485 / 0.048 - 1)]


def keep_agent_run(bench, folder: Path, name: str, windows, fault: str = "healthy-agent", truth=None,
                   injected_s: float | None = None, shape: str = "mlp-4") -> None:
    """An agent's run as the matrix keeps it: each window's patterns in order, the run, and a regression's
    truth (the job's step before the onset and in each window)."""
    folder.mkdir(exist_ok=True)
    run = bench.Run(shape, fault, right=True, false=[], findings=[], job=name, injected_s=injected_s)
    for i, patterns in enumerate(windows):
        (folder / f"{name}-{i}.msgpack").write_bytes(encode_patterns(patterns) if isinstance(patterns, list)
                                                     else patterns)
    (folder / f"{name}.json").write_text(json.dumps({"run": asdict(run), "documents": [], "truth": truth}))


def test_a_replayed_regression_is_scored_against_the_jobs_steps_before_and_after_the_onset(tmp_path):
    """cnn-3's agent windows (tests/data/agent-windows): every rank 25 ms slower a step from window 4 on; the
    agent reports the regression once it held in three windows, in window 6, whose truth is the job's 90 ms
    step."""
    bench = bench_accuracy()
    windows = [(ROOT / "tests" / "data" / "agent-windows" / f"cnn-3-regression-{i}.msgpack").read_bytes()
               for i in range(7)]
    truth = {"before_s": 0.0590, "windows_s": [0.0619, 0.0588, 0.0567, 0.0580, 0.0859, 0.0876, 0.0902]}
    keep_agent_run(bench, tmp_path, "cnn-3-regression-a", windows, "regression", truth, injected_s=0.025)
    run = bench.replay([tmp_path])[0]
    assert run.right and run.findings[0] == "regression[0, 1, 2]"
    assert run.truth_step_s == 0.0902 and run.truth_cost == pytest.approx(1 - 0.0590 / 0.0902)
    assert run.injected_cost == pytest.approx(0.025 / 0.0902)
    assert 0 < run.cost < 1 and run.cost_err is not None and run.step_err is not None
    # "sitecustomize.py:_Rank.before_step grew by 25 ms per step": the delay injected before each step
    assert run.extra_s == pytest.approx(0.025, abs=0.001) and run.extra_err is not None
    keep_agent_run(bench, tmp_path / "two", "cnn-3-regression-b", windows[:6], "regression", truth, injected_s=0.025)
    assert not bench.replay([tmp_path / "two"])[0].right  # two slow windows are not yet a regression


def test_replay_runs_an_agent_window_after_window_reporting_what_held(tmp_path):
    """A rank late in one 2 s window of ten, or in two running (4 s), is not reported by the agent (it must
    hold over HOLD_S); late in three running, it is: the replay scores it as a false finding on a healthy job."""
    bench = bench_accuracy()
    healthy, late = [simulate(4, seed=s) for s in range(10)], simulate(4, host_extra={3: 0.016}, seed=11)
    keep_agent_run(bench, tmp_path, "mlp-4-healthy-agent-once", [*healthy[:4], late, *healthy[4:9]])
    keep_agent_run(bench, tmp_path, "mlp-4-healthy-agent-twice", [*healthy[:4], late, late, *healthy[4:8]])
    keep_agent_run(bench, tmp_path, "mlp-4-healthy-agent-thrice", [*healthy[:4], late, late, late, *healthy[4:7]])
    runs = {r.job: r for r in bench.replay([tmp_path])}
    for brief in ("once", "twice"):
        assert runs[f"mlp-4-healthy-agent-{brief}"].right and runs[f"mlp-4-healthy-agent-{brief}"].findings == []
    assert not runs["mlp-4-healthy-agent-thrice"].right
    assert runs["mlp-4-healthy-agent-thrice"].false == ["compute_straggler[3]"]


def test_a_healthy_runs_regression_counts_only_where_the_jobs_own_log_slowed():
    """Something outside a healthy job can slow it (the machine's other work): a regression the agent names
    in a window where the job's own steps grew by SLOWED_BY or more is right; elsewhere it is false."""
    bench = bench_accuracy()
    shape = next(s for s in bench.SHAPES if s.name == "mlp-2")
    fault = next(f for f in bench.FAULTS if f.name == "healthy-agent")
    regression = {"kind": "regression", "ranks": [0, 1]}
    truth = {"windows_s": [0.0045, 0.0047, 0.0046, 0.0058, 0.0049]}  # window 3: +26% over the median before it
    assert list(bench.slowed_windows(truth)) == [3]
    left, shown = bench.borne_out([[], [], [], [regression], [regression]], truth)
    assert left == [regression] and shown == ["regression[0, 1] (the job's log: +26%)"]
    assert bench.score_agent(shape, fault, left, None) == (False, ["regression[0, 1]"])
    assert bench.borne_out([[], [], [], [regression], []], truth)[0] == []
    held = {**regression, "held": True}  # repeated through the deep windows it raised: window 3's finding again
    assert bench.borne_out([[], [], [], [regression], [held]], truth) == ([], shown)
    assert bench.borne_out([[], [regression]], None) == ([regression], [])  # no truth kept: counted as before
    # Confirmed first in a deep window: scored where it was measured (window 3), not skipped.
    assert bench.borne_out([[], [], [], [], [held], [held]], truth) == ([], shown)
    assert bench.borne_out([[], [], [], [], [held]], {"windows_s": [0.0045] * 5}) == ([held], [])
    # A lasting slowdown, named once it held: against its first windows, not the slow ones since.
    drift = {"windows_s": [0.0834, 0.0796, 0.0824, 0.0859, 0.1057, 0.0976, 0.0924, 0.104, 0.0959, 0.0948]}
    assert bench.borne_out([[]] * 9 + [[regression]], drift) == ([], ["regression[0, 1] (the job's log: +15%)"])
    # ...first windows the agent's baseline holds: not the one it attached in (lm-2: 476 ms while the agent
    # compiled its probes, 271, then 174-191 ms, slowed to 260-290 ms from window 6 by the machine's other work)
    attached = {"windows_s": [0.4764, 0.2714, 0.1737, 0.1824, 0.1907, 0.1825, 0.2604, 0.2766, 0.2899, 0.2846]}
    assert bench.borne_out([[]] * 9 + [[regression]], attached) == ([], ["regression[0, 1] (the job's log: +56%)"])


def test_a_held_regression_is_scored_in_the_window_it_was_measured_in():
    bench = bench_accuracy()
    regression = {"kind": "regression", "ranks": [0, 1], "cost": 0.4}
    held = {**regression, "held": True}
    # Named in window 3, held through the deep windows 4 and 5 it raised: measured in window 3.
    assert bench.measured_in(held, 5, [[], [], [], [regression], [held], [held]]) == 3
    assert bench.measured_in(regression, 3, [[], [], [], [regression]]) == 3


def test_a_rank_fault_is_switched_on_in_its_running_job_after_the_reference():
    # The cost's what-if is the job's own step before the onset (another job of the shape may run 30% apart).
    bench = bench_accuracy()
    shapes, faults = {s.name: s for s in bench.SHAPES}, {f.name: f for f in bench.FAULTS}
    for name in ("compute", "compute-small", "compute-small-agent", "loader", "gc", "pagefaults"):
        assert bench.fault_spec(shapes["mlp-2"], faults[name], 0.05).endswith("@go")
        assert "@" not in bench.fault_spec(shapes["sim-4"], faults[name], 0.05)  # the simulated job has no go
    for name in ("slowlink", "slowlink-4x"):  # the link shaped under the running job, by the bench
        assert not bench.slow_link(shapes["mlp-3-io"], faults[name], 1e8).at_start


def test_a_replayed_small_straggler_is_scored_where_the_agent_names_it(tmp_path):
    """mlp-3-io, a tenth of the step spun on rank 2 from window 4: named in window 10 (4 of the last 8), its
    step against the job's own in that window, its extra time per step against the 1.93 ms spun."""
    bench = bench_accuracy()
    windows = [(ROOT / "tests" / "data" / "agent-windows" / "runs" / "mlp-3-io-compute-small" / f"{i}.msgpack")
               .read_bytes() for i in range(13)]
    steps = [0.019216, 0.018532, 0.020808, 0.021358, 0.02116, 0.019588, 0.019964, 0.019842, 0.019452, 0.020439,
             0.02045, 0.019686, 0.019807]  # the job's own, in each window
    truth = {"before_s": 0.019965, "windows_s": steps}
    keep_agent_run(bench, tmp_path, "mlp-3-io-small", windows, "compute-small-agent", truth, injected_s=0.00193,
                   shape="mlp-3-io")
    run, = bench.replay([tmp_path])
    assert run.right and run.false == [] and run.findings[0] == "compute_straggler[2]"
    assert run.truth_step_s == steps[10] and run.step_err == pytest.approx(0, abs=0.02)
    assert run.extra_s == pytest.approx(0.00193, rel=0.5)
    # What the fault cost the job by its own log: its windows after the straddling one (5..10) against before
    assert run.job_slowed == pytest.approx(sum(steps[5:]) / len(steps[5:]) / 0.019965 - 1)


def test_the_table_shows_what_a_missed_fault_cost_its_job():
    """A small straggler missed where it slowed its job by 1% (it had that much slack) reads differently from
    one missed where it cost 8%: the table lists each miss's slowdown beside the case's median."""
    bench = bench_accuracy()
    runs = [bench.Run("cnn-3", "compute-small-agent", right=r, false=[], findings=[], job=str(i), job_slowed=s)
            for i, (r, s) in enumerate([(True, 0.05), (False, 0.01), (False, 0.08), (True, 0.06)])]
    row, = bench.summarize(runs)
    assert row["job_slowed"] == pytest.approx(0.055) and row["missed_slowed"] == [0.01, 0.08]
    assert "| +6% (+1%, +8%) |" in bench.table([row])
    assert bench.job_slowed(None, 4) is None and bench.job_slowed({"before_s": 0.1, "windows_s": [0.1] * 5}, 4) is None


def test_batches_name_their_code_and_a_table_that_mixes_versions_says_so(tmp_path, capsys):
    """Batches of one matrix may run sessions apart: each names the code it ran on (rankscope/ and the jobs' git
    trees), and a table merged from batches of two versions says so, since its rows are then not one matrix."""
    bench = bench_accuracy()
    code = bench.code_version()
    trees = code.removesuffix("+dirty").split("-")
    assert len(trees) == 2 and all(len(t) == 10 for t in trees)  # HEAD:rankscope, HEAD:tests/jobs
    run = bench.Run("mlp-2", "healthy", right=True, false=[], findings=[], truth_step_s=0.004, job="a")
    shapes = [s for s in bench.SHAPES if s.name == "mlp-2"]
    bench.save(tmp_path / "a.json", shapes, [run], code)
    bench.save(tmp_path / "b.json", shapes, [run], code)
    assert json.loads((tmp_path / "a.json").read_text())["code"] == code
    assert len(bench.merged([str(tmp_path / "a.json"), str(tmp_path / "b.json")])) == 2
    assert "code versions" not in capsys.readouterr().err
    bench.save(tmp_path / "c.json", shapes, [run], "0123456789-0123456789")
    assert len(bench.merged([str(tmp_path / "a.json"), str(tmp_path / "c.json")])) == 2
    assert "ran on 2 code versions" in capsys.readouterr().err
    assert bench.main(["--table", str(tmp_path / "a.json"), str(tmp_path / "gone.json")]) == 2
    assert "no such file: " + str(tmp_path / "gone.json") in capsys.readouterr().err
    assert bench.main(["--healthy-from", str(tmp_path / "gone.json")]) == 2


def test_a_batch_without_the_healthy_case_scales_its_faults_to_earlier_healthy_runs():
    """--healthy-from: earlier batches' healthy runs (their steps, their links' pace) stand in for the healthy
    case run first; the other runs there are not references."""
    bench = bench_accuracy()
    run = lambda fault, step, pace: bench.Run("lm-2", fault, right=True, false=[], findings=[],  # noqa: E731
                                              truth_step_s=step, links_Bps=pace)
    refs = bench.References.of([run("healthy", 0.17, 9e6), run("healthy", 0.18, None), run("compute", 0.3, 8e6)])
    assert refs.steps == {"lm-2": [0.17, 0.18]} and refs.paces == {"lm-2": [9e6]}
    assert refs.step("lm-2") == pytest.approx(0.175) and refs.pace("lm-2") == 9e6
    assert refs.step("mlp-2") is None and refs.pace("mlp-2") is None


def test_batches_merge_in_the_matrixs_order_of_shapes_and_faults(tmp_path):
    """Two batches of the same shapes (one the healthy and small cases, the other the rest) read as one matrix:
    each shape's rows together, its faults in the matrix's order."""
    bench = bench_accuracy()
    run = lambda shape, fault: bench.Run(shape, fault, right=True, false=[], findings=[], job="a")  # noqa: E731
    shapes = [s for s in bench.SHAPES if s.name in ("mlp-2", "lm-2")]
    bench.save(tmp_path / "a.json", shapes, [run("mlp-2", "healthy"), run("lm-2", "healthy")], "c")
    bench.save(tmp_path / "b.json", shapes, [run("lm-2", "gc"), run("mlp-2", "compute"), run("mlp-2", "gc")], "c")
    runs = bench.merged([str(tmp_path / "b.json"), str(tmp_path / "a.json")])
    assert [(r.shape, r.fault) for r in runs] == [("mlp-2", "healthy"), ("mlp-2", "compute"), ("mlp-2", "gc"),
                                                  ("lm-2", "healthy"), ("lm-2", "gc")]


def test_a_fault_of_the_kind_a_shape_has_already_adds_to_it(monkeypatch, tmp_path):
    """mlp-3-io reads every batch 8 ms late (its storage): its slow loader sleeps those 8 ms and the injected
    delay, each from its own onset (the victim kept its storage latency until the fault began)."""
    bench = bench_accuracy()
    shapes, faults = {s.name: s for s in bench.SHAPES}, {f.name: f for f in bench.FAULTS}
    spec = bench.fault_spec(shapes["mlp-3-io"], faults["loader"], 0.02)
    assert spec == "loader:*:0.008,loader:2:0.0200@go"  # the storage latency is the shape's, from its start
    assert bench.fault_spec(shapes["mlp-3-io"], faults["compute"], 0.05) == "loader:*:0.008,compute:2:0.0250@go"

    monkeypatch.delenv("RANK", raising=False)  # imported outside a rank, the injector hooks nothing
    module = importlib.util.spec_from_file_location("inject", ROOT / "tests" / "jobs" / "inject" / "sitecustomize.py")
    inject = importlib.util.module_from_spec(module)
    module.loader.exec_module(inject)
    monkeypatch.setenv("RANKSCOPE_FAULT", "loader:*:0.008,loader:2:0.0200@go")
    monkeypatch.setenv("RANKSCOPE_TRUTH_DIR", str(tmp_path))
    victim, other = (inject._Rank(r, inject._faults_here(r)) for r in (2, 1))
    assert victim.active("loader") == other.active("loader") == 0.008 and victim.active("compute") is None
    (tmp_path / "go").touch()
    assert victim.active("loader") == pytest.approx(0.028) and other.active("loader") == 0.008


def test_the_table_says_what_each_case_lacks_against_the_bar():
    """The last column: 19 of 20 right, no finding in 20 healthy runs, step within 5%, cost within 30% of the
    injected share (the what-if where nothing known was injected); each shortfall named."""
    bench = bench_accuracy()

    def row(fault, n, wrong=0, **fields):
        runs = [bench.Run("mlp-4", fault, right=i >= wrong, false=[], findings=[], job="a", **fields) for i in range(n)]
        return bench.summarize(runs)[0]

    assert row("compute", 20, wrong=1)["bar"] == "met"
    assert row("compute", 20, wrong=2)["bar"] == "right 18/20"
    assert row("healthy", 20, wrong=1)["bar"] == "right 19/20"
    assert row("hang", 5)["bar"] == "15 more runs"
    assert row("compute", 20, step_s=0.106, truth_step_s=0.1)["bar"] == "step 6%"
    # The injected share rules where there is one (cnn-3's compute: what-if +100%, injected +2%)
    assert row("compute", 20, cost=0.4, truth_cost=0.2, injected_cost=0.39)["bar"] == "met"
    assert row("gc", 20, cost=0.4, truth_cost=0.2)["bar"] == "cost +100%"
    assert row("loader", 5, cost=0.1, truth_cost=0.2, injected_cost=0.2)["bar"] == "15 more runs; cost -50%"
    assert bench.table([row("compute", 20)]).splitlines()[-1].endswith("| - | met |")


def test_a_regression_spun_on_more_ranks_than_cores_is_scored_on_the_jobs_own_slowdown():
    """A delay spun on every rank of mlp-4 (four ranks) on two cores costs the job more than the delay (each
    spin holds a core a peer needs): its cost is scored against the job's own slowdown, not the delay's share;
    with a core a rank, or for a straggler's delay (one rank), the injected share still rules."""
    bench = bench_accuracy()
    figures = {"cost": 0.45, "truth_cost": 0.45, "injected_cost": 0.30}
    regression = bench.Run("mlp-4", "regression", right=True, false=[], findings=[], **figures)
    assert regression.spins_contend and regression.injected_err is None and regression.cost_err == 0
    assert bench.summarize([regression] * 20)[0]["bar"] == "met"
    on_cores = bench.Run("mlp-4", "regression", right=True, false=[], findings=[], cores=4, **figures)
    assert not on_cores.spins_contend and on_cores.injected_err == pytest.approx(0.5)
    straggler = bench.Run("mlp-4", "compute", right=True, false=[], findings=[], **figures)
    assert not straggler.spins_contend and straggler.injected_err == pytest.approx(0.5)
    assert bench.Run.of(json.loads(json.dumps(asdict(regression)))).cores == 2  # kept runs keep their machine's


def test_slowlink_4x_caps_the_victims_links_at_a_quarter_of_the_healthy_links_pace():
    """A fixed 100 Mbit/s is no fault where the job's healthy links run near it (cnn-3 on a slower host: 13-17
    MB/s); slowlink-4x caps the victim's links at a quarter of the pace the shape's healthy windows measured."""
    bench = bench_accuracy()
    shapes, faults = {s.name: s for s in bench.SHAPES}, {f.name: f for f in bench.FAULTS}
    assert bench.link_pace(tcp_ring(simulate(4))) == pytest.approx(MBPS)  # the median link's bytes / wire time
    assert bench.link_pace(simulate(4)) is None  # no link moved a byte
    link = bench.slow_link(shapes["cnn-3"], faults["slowlink-4x"], 20e6)
    assert (link.rank, link.rate) == (2, "40000kbit")  # 20 MB/s = 160 Mbit/s, a quarter of it
    assert bench.slow_link(shapes["cnn-3"], faults["slowlink"], None).rate == "100mbit"
    assert bench.slow_link(shapes["cnn-3"], faults["healthy"], 20e6) is None
    with pytest.raises(RuntimeError, match="healthy case first"):
        bench.slow_link(shapes["cnn-3"], faults["slowlink-4x"], None)
    assert shapes["cnn-3"].takes(faults["slowlink-4x"]) and not shapes["mlp-2"].takes(faults["slowlink-4x"])


def test_a_faults_loss_is_the_jobs_own_step_with_it_switched_off_and_on(tmp_path, monkeypatch):
    """Run.lost: the fault's go file made and removed in turn, each on phase's step against the off phases either
    side (the host drifting from 10 to 12 ms meanwhile), their median; the fault left off. The table shows the
    cost against it beside the loss."""
    bench = bench_accuracy()
    on_phases = []

    class Job:
        truth = tmp_path

        def wait_written(self, after):
            pass

        def go(self):
            (tmp_path / "go").touch()

        def step_time(self, start, end):
            on = (tmp_path / "go").exists()
            on_phases.append(on)
            off = 0.010 + 0.002 * len(on_phases) / (2 * bench.AB_PAIRS + 1)  # the host's pace drifts
            return off * 1.05 if on else off

    monkeypatch.setattr(bench.launch, "settle", lambda job, seconds: None)
    job = Job()
    lost = bench.measured_loss(job, bench.switch(job, next(f for f in bench.FAULTS if f.name == "compute")))
    assert on_phases == [False, True] * bench.AB_PAIRS + [False] and not (tmp_path / "go").exists()
    assert lost == pytest.approx(1 - 1 / 1.05, rel=1e-3)
    run = bench.Run("mlp-4", "compute", right=True, false=[], findings=[], cost=0.1, lost=0.08)
    assert run.lost_err == pytest.approx(0.25)
    assert "| +25% (8.0%) |" in bench.table(bench.summarize([run]))
