"""Runs every step of the GPU validation kit in order, each on its own: a step that fails or cannot run here
is recorded with its reason and the next one runs. Writes OUT/results.json and OUT/table.txt (and the jobs'
log, the diagnosed window's patterns).

    scripts/gpu-check OUT [--bcc auto|system|bundle] [--only STEP,...] [--deadline SECONDS]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the gpu_kit package
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: rankscope

from gpu_kit import accuracy, bundle, steps  # noqa: E402

VALUE_CHARS = 110  # of a row's figures in the table
# Seconds a step may take at most (the last ones get what the deadline leaves): a hung job costs one step.
STEP_BUDGET_S = {"environment": 120, "bcc": 150, "diagnose_straggler": 180, "overhead": 300, "gpu_accuracy": 530}
DEFAULT_BUDGET_S = 150
MIN_STEP_S = 20
STEPS = (*steps.STEPS, accuracy.gpu_accuracy)  # the accuracy matrix's GPU rows last: the longest step


@dataclass
class StepResult:
    name: str
    status: str  # ok, failed, skipped
    reason: str = ""
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)


class StepTimeout(Exception):
    """The step ran out of its time (SIGALRM): its jobs are stopped by its own cleanup as the exception passes."""


def _alarm(signum, frame) -> None:
    raise StepTimeout("the step ran out of its time")


def run_step(step, kit: steps.Kit, seconds: int) -> StepResult:
    """Runs one step for at most `seconds`, whatever happens inside it."""
    start = time.monotonic()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(max(1, seconds))
    try:
        result = StepResult(step.__name__, "ok", figures=step(kit))
    except steps.Skip as e:
        result = StepResult(step.__name__, "skipped", str(e))
    except steps.Failed as e:
        result = StepResult(step.__name__, "failed", str(e)[-2000:], figures=e.figures)
    except Exception as e:  # noqa: BLE001: every failure is a result; the kit goes on
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        result = StepResult(step.__name__, "failed", detail[-2000:])
        with open(kit.log, "a") as f:
            f.write(f"--- {step.__name__} failed\n{traceback.format_exc()}\n")
    finally:
        signal.alarm(0)
    result.seconds = round(time.monotonic() - start, 1)
    return result


def table(results: list[StepResult]) -> str:
    lines = [f"{'step':<20} {'status':<8} {'s':>6}  figures / reason"]
    for r in results:
        text = r.reason if r.status != "ok" else json.dumps(r.figures, default=str)
        lines.append(f"{r.name:<20} {r.status:<8} {r.seconds:>6.1f}  {text[:VALUE_CHARS]}")
    return "\n".join(lines) + "\n"


def write(out: Path, kit: steps.Kit, results: list[StepResult]) -> None:
    doc = {"mode": "gpu" if kit.gpu else "stand-ins", "gpu": kit.gpu, "agent": kit.no_bcc or "runs",
           "finished": time.time(), "steps": [asdict(r) for r in results]}
    (out / "results.json").write_text(json.dumps(doc, indent=1, default=str))
    (out / "table.txt").write_text(table(results))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--bcc", choices=("auto", "system", "bundle"), default="auto")
    ap.add_argument("--bundle", type=Path, default=bundle.DEFAULT_DIR, help="the carried bundle (.gpukit)")
    ap.add_argument("--only", default="", help="comma-separated step names (environment and bcc always run)")
    ap.add_argument("--deadline", type=int, default=560,
                    help="seconds for the whole run (the device tool's command limit is 600)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("gpu-check: must run as root (uprobes, eBPF)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    kit = steps.Kit(args.out, steps.python_of_jobs(), args.bundle, args.bcc)
    wanted = {s for s in args.only.split(",") if s} | {"environment", "bcc"}
    results: list[StepResult] = []
    try:
        for step in STEPS:
            if args.only and step.__name__ not in wanted:
                continue
            left = args.deadline - (time.monotonic() - started)
            if left < MIN_STEP_S:
                results.append(StepResult(step.__name__, "skipped", f"no time left of --deadline {args.deadline} s"))
            else:
                results.append(run_step(step, kit, int(min(left, STEP_BUDGET_S.get(step.__name__, DEFAULT_BUDGET_S)))))
            r = results[-1]
            print(f"gpu-check: {r.name}: {r.status} ({r.seconds:.1f} s){': ' + r.reason[:300] if r.reason else ''}",
                  file=sys.stderr, flush=True)
            write(args.out, kit, results)  # after every step: a run cut short still leaves what it found
    finally:
        shutil.rmtree(kit.work, ignore_errors=True)  # the jobs' reports, the unpacked bundle
    sys.stdout.write(table(results))
    return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
