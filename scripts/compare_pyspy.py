"""rankscope's Python sampler against py-spy on the same running process: top-10 functions by self share.

    .venv/bin/pip install py-spy && sudo .venv/bin/python scripts/compare_pyspy.py [--seconds 10] [--python PATH]

Both sample on-CPU time (py-spy without --idle) over the same interval of one workload with a known
mix of functions; each function's self share is the fraction of samples in which it is innermost.
"""
from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

from rankscope.agent.sources.python_sampler import PythonSampler

WORKLOAD = textwrap.dedent("""
    import sys, time
    def tokenize(n):
        return sum(i * i for i in range(n))
    def augment(n):
        s = 0
        for i in range(n):
            s += i % 7
        return s
    def forward(n):
        return tokenize(n) + augment(n // 2)
    def collate():
        return [str(i) for i in range(3000)]
    def step():
        forward(60000)
        collate()
        sorted(range(20000), key=lambda x: -x)
    print("ready", flush=True)
    while True:
        step()
""")


def pyspy_shares(pid: int, seconds: float, rate: int) -> dict[str, float]:
    with tempfile.NamedTemporaryFile(suffix=".txt") as out:
        subprocess.run(["py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", str(rate),
                        "--format", "raw", "--output", out.name, "--nonblocking"],
                       check=True, capture_output=True)
        counts: collections.Counter[str] = collections.Counter()
        for line in Path(out.name).read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            leaf = stack.split(";")[-1]  # "func (file.py:line)"
            counts[leaf.split(" (")[0]] += int(n)
    total = sum(counts.values()) or 1
    return {name: n / total for name, n in counts.items()}


def rankscope_shares(sampler: PythonSampler, pid: int) -> dict[str, float]:
    counts: collections.Counter[str] = collections.Counter()
    for stack, t in sampler.read().get(pid, {}).items():
        if stack and t.samples:
            counts[stack[-1].qualname] += t.samples
    total = sum(counts.values()) or 1
    return {name: n / total for name, n in counts.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--rate", type=int, default=99, help="samples per second, both tools")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "workload.py"
        script.write_text(WORKLOAD)
        proc = subprocess.Popen([args.python, str(script)], stdout=subprocess.PIPE, text=True)
        try:
            proc.stdout.readline()
            with PythonSampler(frequency=args.rate) as sampler:
                sampler.attach(proc.pid)
                sampler.read()
                spy: dict[str, float] = {}
                t = threading.Thread(target=lambda: spy.update(pyspy_shares(proc.pid, args.seconds, args.rate)))
                t.start()
                t.join()  # py-spy's --duration is the shared measurement window
                ours = rankscope_shares(sampler, proc.pid)
        finally:
            proc.kill()
            proc.wait()
    top = sorted(spy, key=lambda k: -spy[k])[:10]
    worst = max(abs(spy[k] - ours.get(k, 0.0)) for k in top)
    print(f"{'function':<28} {'py-spy':>8} {'rankscope':>10} {'diff (pp)':>10}")
    for k in top:
        print(f"{k:<28} {spy[k]:8.1%} {ours.get(k, 0.0):10.1%} {100 * (ours.get(k, 0.0) - spy[k]):+10.1f}")
    print(f"largest difference over py-spy's top {len(top)}: {100 * worst:.1f} percentage points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
