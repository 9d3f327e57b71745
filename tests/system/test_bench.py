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


def test_every_benchmark_runs_at_tiny_size(tmp_path):
    expected = BENCHMARKS | ({"torch", "startup"} if (ROOT / "tests" / "torch_ddp_train.py").exists() else set())
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick", "--json", str(out)],
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["quick"] is True
    assert set(doc["results"]) == expected
    for name, result in doc["results"].items():
        assert "error" not in result["details"], (name, result["details"]["error"])
        assert result["rows"], name
        for row in result["rows"]:
            assert isinstance(row["value"], (int, float)) and math.isfinite(row["value"]), (name, row)
            assert row["figure"] in run.stdout  # the table names every figure
