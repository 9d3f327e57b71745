"""`rankscope profile` against py-spy on the same running process, over the same interval: the folded stacks'
shares, and the top functions' self shares.

    sudo .venv/bin/python scripts/compare_pyspy.py [--seconds 20] [--python PATH]   (py-spy: the test extras)

Both sample on-CPU time at one rate (`rankscope profile --what cpu --format folded`, `py-spy record --format
raw` without --idle) of a workload with a known mix of functions and stacks. A stack's share is its samples
over all samples; a function's self share is the share of the stacks it is innermost in. Frames are compared
by their function's last name and file name (py-spy prints `name (file)` with --nolineno, rankscope
`qualname (path:first line)`). rankscope's window opens once its sampler is compiled and attached; py-spy
starts then, for the same duration.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

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


def frame_key(frame: str) -> str:
    """`name (file...)` of either tool as `name (basename)`: the last part of the name, the file's base name."""
    name, _, where = frame.rpartition(" (")
    path, _, line = where.rstrip(")").rpartition(":")
    path = path if line.isdigit() else where.rstrip(")")
    return f"{name.rsplit('.', 1)[-1]} ({os.path.basename(path)})"


def shares(folded: str) -> dict[tuple[str, ...], float]:
    """Folded lines (`root;...;leaf COUNT`) -> each stack's share of the samples, frames as frame_key."""
    counts: collections.Counter[tuple[str, ...]] = collections.Counter()
    for line in folded.splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            counts[tuple(frame_key(f) for f in stack.split(";"))] += int(n)
    total = sum(counts.values()) or 1
    return {stack: n / total for stack, n in counts.items()}


def self_shares(stacks: dict[tuple[str, ...], float]) -> dict[str, float]:
    out: collections.Counter[str] = collections.Counter()
    for stack, share in stacks.items():
        out[stack[-1]] += share
    return dict(out)


def pyspy() -> str:
    found = Path(sys.executable).with_name("py-spy")
    return str(found) if found.exists() else "py-spy"


def compare(title: str, spy: dict, ours: dict, top: int) -> float:
    """Prints py-spy's `top` entries beside rankscope's; returns the largest difference (percentage points)."""
    keys = sorted(spy, key=lambda k: -spy[k])[:top]
    label = (lambda k: ";".join(k[-3:]) if isinstance(k, tuple) else k)  # a stack's innermost frames
    width = max(len(label(k)) for k in keys)
    print(f"\n{title}\n{'':<{width}} {'py-spy':>8} {'rankscope':>10} {'diff (pp)':>10}")
    for k in keys:
        print(f"{label(k):<{width}} {spy[k]:8.1%} {ours.get(k, 0.0):10.1%} {100 * (ours.get(k, 0.0) - spy[k]):+10.1f}")
    worst = max(abs(spy[k] - ours.get(k, 0.0)) for k in keys)
    covered = sum(spy[k] for k in keys)
    print(f"largest difference over py-spy's top {len(keys)} ({covered:.0%} of its samples): "
          f"{100 * worst:.1f} percentage points")
    return 100 * worst


def overlap(spy: dict, ours: dict) -> float:
    """The share of the samples that fall on the same stacks in both: the sum of each stack's smaller share."""
    return sum(min(spy.get(k, 0.0), ours.get(k, 0.0)) for k in spy.keys() | ours.keys())


def record(python: str, seconds: int, rate: int, blocking: bool = False) -> tuple[dict, dict]:
    """py-spy's and rankscope's stack shares of WORKLOAD run by `python`, sampled together for `seconds`."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "workload.py"
        script.write_text(WORKLOAD)
        proc = subprocess.Popen([python, str(script)], stdout=subprocess.PIPE, text=True)
        try:
            proc.stdout.readline()
            ours_out, spy_out = Path(tmp) / "rankscope.folded", Path(tmp) / "pyspy.txt"
            profile = subprocess.Popen([sys.executable, "-m", "rankscope.agent.cli", "profile", "--pid",
                                        str(proc.pid), "--duration", str(seconds), "--what", "cpu", "--rate",
                                        str(rate), "-o", str(ours_out)], stderr=subprocess.PIPE, text=True)
            opened = profile.stderr.readline()  # "rankscope: sampling ...": the window is open
            if "sampling" not in opened:
                raise RuntimeError(f"rankscope profile: {opened}{profile.stderr.read()}")
            subprocess.run([pyspy(), "record", "--pid", str(proc.pid), "--duration", str(seconds), "--rate",
                            str(rate), "--format", "raw", "--nolineno", "--output", str(spy_out),
                            *([] if blocking else ["--nonblocking"])], check=True, capture_output=True)
            if profile.wait(timeout=60) != 0:
                raise RuntimeError(f"rankscope profile: {profile.stderr.read()}")
            return shares(spy_out.read_text()), shares(ours_out.read_text())
        finally:
            proc.kill()
            proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--python", default=sys.executable, help="the workload's interpreter")
    ap.add_argument("--rate", type=int, default=99, help="samples per second, both tools")
    ap.add_argument("--top", type=int, default=10, help="stacks and functions compared, py-spy's largest")
    ap.add_argument("--pyspy-blocking", action="store_true",
                    help="py-spy stops the process for each sample (no torn stacks; slows the workload)")
    args = ap.parse_args()
    spy, ours = record(args.python, args.seconds, args.rate, args.pyspy_blocking)
    stacks = compare("folded stacks (share of on-CPU samples)", spy, ours, args.top)
    functions = compare("functions (self share)", self_shares(spy), self_shares(ours), args.top)
    print(f"\nstacks: {100 * overlap(spy, ours):.1f}% of the "
          f"samples fall on the same stacks in both (the shares' overlap); largest differences: stacks "
          f"{stacks:.1f} pp, functions {functions:.1f} pp")
    return 0


if __name__ == "__main__":
    sys.exit(main())
