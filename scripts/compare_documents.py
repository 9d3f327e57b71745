#!/usr/bin/env python3
"""diagnose()'s documents of this checkout against another revision's, for a change that must not change any
result (a speed-up): the analyzer benchmark's synthetic inputs (alone and against a baseline of three
windows) and every kept real window (tests/data/windows, hang timeouts 4 and 30 s), compared field by field:
every key in order, every float exactly, every type.

    scripts/compare_documents.py [--base REV] [--sizes 1000,10000,100000]

Each checkout diagnoses in a process of its own; both are given the same inputs, built by this checkout's
scripts/benchmarks/analyzer.py. Exit status 1 when any document differs.
"""
from __future__ import annotations

import argparse
import math
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WINDOWS = ROOT / "tests" / "data" / "windows"
HANG_TIMEOUTS_S = (4.0, 30.0)  # as the kept windows' test and the default


def documents(sizes: list[int]) -> dict[str, Any]:
    """In a worker whose sys.path starts with the checkout under test."""
    from benchmarks.analyzer import synthetic_patterns
    from rankscope.analyzer.baseline import Baseline
    from rankscope.analyzer.diagnosis import diagnose
    from rankscope.schema.wire import decode_patterns

    docs: dict[str, Any] = {}
    for n in sizes:
        patterns = synthetic_patterns(n, straggler=n // 3)
        docs[f"synthetic {n}"] = diagnose(patterns)
        baselines: dict[str, Baseline] = {}
        for _ in range(3):  # MIN_WINDOWS: the fourth window is compared with the job's baseline
            diagnose(patterns, baselines=baselines)
        docs[f"synthetic {n}, baseline"] = diagnose(patterns, baselines=baselines)
    for path in sorted(WINDOWS.glob("*.msgpack")):
        patterns = decode_patterns(path.read_bytes())
        for timeout in HANG_TIMEOUTS_S:
            docs[f"{path.stem}, hang timeout {timeout:g} s"] = diagnose(patterns, timeout)
    return docs


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    if type(a) is not type(b):
        return [f"{where}: {type(a).__name__} != {type(b).__name__}"]
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{where}: keys {list(a)} != {list(b)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    if isinstance(a, float):
        same = (a == b and math.copysign(1, a) == math.copysign(1, b)) or (math.isnan(a) and math.isnan(b))
        return [] if same else [f"{where}: {a!r} != {b!r}"]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def run_worker(checkout: Path, sizes: list[int], out: Path) -> None:
    code = ("import pickle, sys; sys.path[:0] = sys.argv[1:3]; import rankscope, compare_documents as c; "
            "assert rankscope.__file__.startswith(sys.argv[1]), rankscope.__file__; "
            "pickle.dump(c.documents([int(n) for n in sys.argv[4].split(',') if n]), open(sys.argv[3], 'wb'))")
    path = [str(checkout), str(ROOT / "scripts")]
    subprocess.run([sys.executable, "-c", code, *path, str(out), ",".join(map(str, sizes))], check=True,
                   cwd=ROOT / "scripts")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="main", help="the revision to compare with (default: main)")
    ap.add_argument("--sizes", default="1000,10000,100000", help="ranks of the synthetic inputs")
    args = ap.parse_args()
    sizes = [int(n) for n in args.sizes.split(",") if n]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        base.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.base, "rankscope"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        docs = []
        for name, checkout in (("base", base), ("this", ROOT)):
            out = Path(tmp) / f"{name}.pickle"
            run_worker(checkout, sizes, out)
            docs.append(pickle.loads(out.read_bytes()))
    found = differences(*docs)
    print(f"{len(docs[0])} documents of {args.base} and this checkout: "
          + ("identical" if not found else f"{len(found)} differences"))
    for line in found[:50]:
        print(" ", line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
