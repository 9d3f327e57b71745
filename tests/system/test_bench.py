"""The benchmark suite at tiny sizes (`scripts/bench --quick`), so that no benchmark rots unnoticed.

Nothing about timing is asserted: a quick run's figures mean nothing (and the machine may be busy). What is
checked is that every benchmark run here measured something: a finite number for each of its figures, no error.

Run here: the benchmarks of a few seconds each at tiny size. Those that start a torch job or the agent over
a job for tens of seconds each (job, agent, attach, trace, torch, startup: about 105 s of the suite's time)
time what the system tests already run; `scripts/bench --quick` runs them, and every benchmark module is
imported and listed by the command line here.
"""
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench  # noqa: E402

QUICK = ["launch", "sched", "detach", "payload", "latency", "analyzer", "inject", "cluster", "busy"]
LONG = {"job", "agent", "attach", "trace", "torch", "startup", "shim"}
# Run as two halves side by side: at tiny size the benchmarks mostly wait, so two halves of about equal
# length (latency 8 s, detach 7, busy 6, payload 4, the rest under 4) end in little more than the longer one.
HALF = {"latency", "busy", "cluster", "sched", "inject"}


def test_every_benchmark_is_either_run_here_or_a_long_one():
    assert set(QUICK) <= set(bench.BENCHES) <= set(QUICK) | LONG  # a new benchmark is listed in one of them
    assert all(callable(run) for run in bench.BENCHES.values())


def test_the_quick_benchmarks_run_at_tiny_size(tmp_path):
    halves = [sorted(set(QUICK) & HALF), sorted(set(QUICK) - HALF)]
    runs = [subprocess.Popen([sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick", "--json",
                              str(tmp_path / f"bench-{i}.json"), *names], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i, names in enumerate(halves)]
    outputs = [run.communicate(timeout=600) for run in runs]
    for run, (_, stderr) in zip(runs, outputs):
        assert run.returncode == 0, stderr[-4000:]
    docs = [json.loads((tmp_path / f"bench-{i}.json").read_text()) for i in range(len(halves))]
    assert all(doc["quick"] is True for doc in docs)
    results = {name: result for doc in docs for name, result in doc["results"].items()}
    assert set(results) == set(QUICK)
    stdout = "".join(out for out, _ in outputs)
    for name, result in results.items():
        assert "error" not in result["details"], (name, result["details"]["error"])
        assert result["rows"], name
        for row in result["rows"]:
            assert isinstance(row["value"], (int, float)) and math.isfinite(row["value"]), (name, row)
            assert row["figure"] in stdout  # the table names every figure
