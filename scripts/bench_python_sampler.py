"""Measurements of the CPython frame sampler (not collected by pytest; run as root):

    .venv/bin/python scripts/bench_python_sampler.py overhead [--frequency 49] [--pairs 6] [--phase 2.5]
    .venv/bin/python scripts/bench_python_sampler.py accuracy [--frequency 49] [--seconds 4]

overhead: one CPU-bound CPython process counts loop iterations; phases without the sampler loaded and with
it attached alternate (A/B/A/B...), and each phase's rate is taken from the process's own reports, per wall
second and per CPU second of the process (the latter is immune to other load on the machine).

accuracy: per interpreter, the share of samples whose stack is exactly a path of the known call tree
(<module> -> main -> outer -> hot_a | hot_b, right names and file), and hot_a's share of hot_a + hot_b.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "system"))

from test_python_sampler import INTERPRETERS, TARGET  # noqa: E402

from rankscope.agent.sources.python_sampler import PythonSampler

COUNTER = r'''
import sys, time
def spin():
    n = 0
    t0 = time.monotonic()
    while True:
        for _ in range(50000):
            n += 1
        t = time.monotonic()
        if t - t0 >= 0.1:
            print(t, time.process_time(), n, flush=True)
            t0 = t
print("ready", flush=True)
spin()
'''


def overhead(args) -> None:
    script = Path("/tmp/rankscope-bench-counter.py")
    script.write_text(COUNTER)
    p = subprocess.Popen([str(INTERPRETERS[args.python]), str(script)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    reports: list[tuple[float, float, int]] = []

    def reader() -> None:
        for line in p.stdout:
            t, cpu, n = line.split()
            reports.append((float(t), float(cpu), int(n)))

    threading.Thread(target=reader, daemon=True).start()

    def rate(t0: float, t1: float) -> tuple[float, float]:
        inside = [r for r in reports if t0 <= r[0] <= t1]
        a, b = inside[0], inside[-1]
        return (b[2] - a[2]) / (b[0] - a[0]), (b[2] - a[2]) / (b[1] - a[1])

    off, on, samples = [], [], 0
    try:
        for _ in range(args.pairs):
            t0 = time.monotonic()
            time.sleep(args.phase)  # the measurement window
            off.append(rate(t0, time.monotonic()))
            sampler = PythonSampler(frequency=args.frequency)
            sampler.attach(p.pid)
            sampler.read()
            t0 = time.monotonic()
            time.sleep(args.phase)
            on.append(rate(t0, time.monotonic()))
            samples += sum(t.samples for c in sampler.read().values() for t in c.values())
            sampler.close()
    finally:
        p.kill()
    for name, i in (("wall", 0), ("cpu", 1)):
        a = statistics.median(r[i] for r in off)
        b = statistics.median(r[i] for r in on)
        paired = [on[k][i] / off[k][i] - 1 for k in range(len(on))]  # each phase with the one before it
        print(f"iterations per {name} second: without {a / 1e6:.3f} M, with {b / 1e6:.3f} M; paired change "
              f"median {statistics.median(paired):+.2%} (range {min(paired):+.2%} .. {max(paired):+.2%})")
    print(f"{samples} samples in {args.pairs} x {args.phase} s at {args.frequency} Hz")


def accuracy(args) -> None:
    script = Path("/tmp/rankscope-bench-target.py")
    script.write_text(TARGET)
    tree = [["<module>"], ["<module>", "main"], ["<module>", "main", "outer"],
            ["<module>", "main", "outer", "hot_a"], ["<module>", "main", "outer", "hot_b"]]
    with PythonSampler(frequency=args.frequency) as sampler:
        for name, exe in INTERPRETERS.items():
            if not exe.exists():
                continue
            p = subprocess.Popen([str(exe), str(script)], stdout=subprocess.PIPE, text=True)
            try:
                version = p.stdout.readline().split()[1]
                sampler.attach(p.pid)
                sampler.read()
                time.sleep(args.seconds)  # the measurement window
                counts = {s: t.samples for s, t in sampler.read().get(p.pid, {}).items() if t.samples}
                sampler.detach(p.pid)
            finally:
                p.kill()
                p.wait()
            total = sum(counts.values())
            right = sum(n for s, n in counts.items()
                        if [f.qualname for f in s] in tree and all(f.filename == str(script) for f in s))
            a = sum(n for s, n in counts.items() if s and s[-1].qualname == "hot_a")
            b = sum(n for s, n in counts.items() if s and s[-1].qualname == "hot_b")
            print(f"{name:12} {version:8} samples {total:5}  full correct stack {right / total:7.2%}  "
                  f"hot_a share {a / max(a + b, 1):.1%}")


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="what", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--frequency", type=int, default=49)
    o.add_argument("--pairs", type=int, default=6)
    o.add_argument("--phase", type=float, default=2.5)
    o.add_argument("--python", default="3.12", choices=list(INTERPRETERS))
    a = sub.add_parser("accuracy")
    a.add_argument("--frequency", type=int, default=49)
    a.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args()
    overhead(args) if args.what == "overhead" else accuracy(args)


if __name__ == "__main__":
    main()
