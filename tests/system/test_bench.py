"""The benchmark suite at tiny sizes (`scripts/bench --quick`), so that no benchmark rots unnoticed.

Nothing about timing is asserted: a quick run's figures mean nothing (and the machine may be busy). What is
checked is that every benchmark measured something: a finite number for each of its figures, no error.
"""
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = {"job", "launch", "sched", "agent", "detach", "payload", "latency", "analyzer", "inject",
              "trace", "cluster", "busy", "attach"}
# Run as two halves side by side: at tiny size the benchmarks mostly wait (one run in a row took 136 s and used
# ~35% of the 2 CPUs), so two halves of about equal length (startup 25 s, torch 23, attach 19, agent 14, trace
# 12, job 12, latency 8, detach 7, busy 6, payload 4, the rest under 4) end in little more than the longer one.
HALF = {"startup", "attach", "trace", "latency", "busy", "cluster", "sched", "inject"}


def test_every_benchmark_runs_at_tiny_size(tmp_path):
    expected = BENCHMARKS | ({"torch", "startup"} if (ROOT / "tests" / "torch_ddp_train.py").exists() else set())
    halves = [sorted(expected & HALF), sorted(expected - HALF)]
    runs = [subprocess.Popen([sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick", "--json",
                              str(tmp_path / f"bench-{i}.json"), *names], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i, names in enumerate(halves)]
    outputs = [run.communicate(timeout=1200) for run in runs]
    for run, (_, stderr) in zip(runs, outputs):
        assert run.returncode == 0, stderr[-4000:]
    docs = [json.loads((tmp_path / f"bench-{i}.json").read_text()) for i in range(len(halves))]
    assert all(doc["quick"] is True for doc in docs)
    results = {name: result for doc in docs for name, result in doc["results"].items()}
    assert set(results) == expected
    stdout = "".join(out for out, _ in outputs)
    for name, result in results.items():
        assert "error" not in result["details"], (name, result["details"]["error"])
        assert result["rows"], name
        for row in result["rows"]:
            assert isinstance(row["value"], (int, float)) and math.isfinite(row["value"]), (name, row)
            assert row["figure"] in stdout  # the table names every figure
