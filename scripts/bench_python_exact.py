"""Cost per call of exact Python timing (not collected by pytest; run as root):

    .venv/bin/python scripts/bench_python_exact.py [--python 3.12] [--calls 200000] [--rounds 3]

A CPython process times a loop of calls that enter the eval loop from C (`map(f, ...)` over a trivial
function) in three states, in rounds: no probes; the timer attached but the function not chosen (the cost
every eval entry of a watched process pays: uprobe + uretprobe traps, two map lookups); the function
chosen (`--trace-function`: its calls are timed). Prints the median ns per call of each state and the
differences.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "system"))

from test_python_sampler import INTERPRETERS  # noqa: E402

from rankscope.agent.interpreters.cpython.process import inspect  # noqa: E402
from rankscope.agent.sources.python_exact import PythonTimer, TracedFunction

LOOP = r'''
import sys, time

def chosen(x):
    return x

def other(x):
    return x

print("ready", flush=True)
for line in sys.stdin:
    fn, n = line.split()
    f = chosen if fn == "chosen" else other
    t0 = time.perf_counter_ns()
    for _ in map(f, range(int(n))):
        pass
    print((time.perf_counter_ns() - t0) / int(n), flush=True)
'''


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", default="3.12", choices=list(INTERPRETERS))
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    script = Path("/tmp/rankscope-bench-exact.py")
    script.write_text(LOOP)
    p = subprocess.Popen([str(INTERPRETERS[args.python]), str(script)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"

    def run(fn: str) -> float:
        p.stdin.write(f"{fn} {args.calls}\n")
        p.stdin.flush()
        return float(p.stdout.readline())

    results: dict[str, list[float]] = {"no probes": [], "attached, not chosen": [], "chosen (timed)": []}
    timer = PythonTimer([TracedFunction.parse("__main__:chosen")])
    try:
        run("other")  # warm up
        for _ in range(args.rounds):
            results["no probes"].append(run("other"))
            timer.attach(inspect(p.pid))
            results["attached, not chosen"].append(run("other"))
            results["chosen (timed)"].append(run("chosen"))
            timed = {r.name: r.count for r in timer.read().get(p.pid, [])}
            assert timed.get("rankscope-bench-exact.py:chosen") == args.calls, timed
            timer.detach(p.pid)
    finally:
        timer.close()
        p.kill()
    base = statistics.median(results["no probes"])
    print(f"CPython {args.python}, {args.calls} calls through map() per run, median of {args.rounds} runs:")
    for state, values in results.items():
        med = statistics.median(values)
        print(f"  {state:22s} {med:8.1f} ns/call  (+{med - base:7.1f})")


if __name__ == "__main__":
    main()
