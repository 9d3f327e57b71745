"""The accuracy matrix's two sets of shapes: the tuning shapes and the held-out ones (jobs the analyzer's
thresholds never saw), selected by --tuning and --held-out and tabled apart."""
import json
from pathlib import Path

from test_accuracy_replay import ROOT, bench_accuracy


def test_the_held_out_shapes_are_public_frameworks_jobs_no_tuning_shape_runs():
    bench = bench_accuracy()
    held_out = [s for s in bench.SHAPES if s.held_out]
    tuning_scripts = {s.script for s in bench.SHAPES if not s.held_out}
    assert {s.script for s in held_out} == {"lightning_trainer.py", "ddp_static_graph.py", "pipelining_gpipe.py"}
    assert not tuning_scripts & {s.script for s in held_out}
    faults = {f.name: f for f in bench.FAULTS}
    for shape in held_out:
        assert (ROOT / "tests" / "jobs" / shape.script).is_file()
        assert all(shape.takes(faults[name]) for name in ("healthy", "compute", "hang")), shape.name
        assert shape.takes(faults["slowlink"]) == (shape.ranks >= 3 and "slowlink" in shape.faults), shape.name


def test_the_selector_picks_one_set_of_shapes_or_both():
    bench = bench_accuracy()
    every = ",".join(s.name for s in bench.SHAPES)
    held_out = bench.selected(every, held_out=True)
    tuning = bench.selected(every, held_out=False)
    assert held_out and all(s.held_out for s in held_out)
    assert tuning and not any(s.held_out for s in tuning)
    assert len(held_out) + len(tuning) == len(bench.SHAPES) == len(bench.selected(every, held_out=None))
    assert [s.name for s in bench.selected("mlp-2,gpipe-2", held_out=True)] == ["gpipe-2"]


def batch(bench, path: Path) -> Path:
    """A saved batch with a tuning shape's runs and a held-out shape's: one right, one wrong each."""
    runs = [bench.Run("mlp-2", "healthy", True, [], []), bench.Run("mlp-2", "compute", True, [], ["c[1]"]),
            bench.Run("gpipe-2", "healthy", False, ["python_gc[0]"], ["python_gc[0]"]),
            bench.Run("gpipe-2", "compute", False, [], [])]
    bench.save(path, bench.SHAPES, runs, "test")
    return path


def test_the_table_reports_held_out_shapes_apart_and_the_flag_keeps_only_them(tmp_path, capsys):
    bench = bench_accuracy()
    saved = batch(bench, tmp_path / "batch.json")
    assert bench.main(["--table", str(saved)]) == 0
    both = capsys.readouterr().out
    tuning, held_out = both.split("### held-out shapes")
    assert "| mlp-2 | compute |" in tuning and "gpipe-2" not in tuning
    assert "| gpipe-2 | compute |" in held_out and "mlp-2" not in held_out
    assert "right 0/1 faulty runs, 0/1 healthy runs clean, 1 false findings" in held_out
    assert bench.main(["--table", str(saved), "--held-out"]) == 0
    only = capsys.readouterr().out
    assert "gpipe-2" in only and "mlp-2" not in only and "tuning shapes" not in only
    rows = json.loads(saved.read_text())["rows"]
    assert {r["shape"]: r["held_out"] for r in rows} == {"mlp-2": False, "gpipe-2": True}


def test_a_live_matrix_writes_outside_the_checkout_by_default():
    bench = bench_accuracy()
    assert not bench.DEFAULT_OUT.resolve().is_relative_to(ROOT)
