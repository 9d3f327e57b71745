"""The real GPU's rows of the accuracy matrix (issue 13): PyTorch ranks time-sharing the one GPU through gloo and
through NCCL, healthy and with one rank doing 8x the matrix products. `rankscope diagnose` over each window is
scored as `scripts/bench accuracy` scores a run: the verdict (kind and rank), false findings, the step time
against the job's own log and the cost against the share of the step the same shape loses to the heavy rank
(its healthy case's step, measured just before). Every window's patterns, document and truth are kept in
OUT/gpu-windows.tar.xz, so the analyzer can be replayed on real GPU windows where there is no GPU."""
from __future__ import annotations

import json
import os
import statistics
import tarfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpu_kit.jobs import rankscope
from gpu_kit.steps import HEAVY_MATMULS, STRAGGLER_JOB_ARGS, Failed, Kit

WINDOWS = 3  # diagnosed windows per case, one after another on one job: the decision repeated
WINDOW_S = 5
COMPONENT = "gpu"  # where the heavy rank's time goes: its kernels, waited for in the copy of its gradients
# NCCL refuses two ranks of a communicator on one GPU unless they are on different hosts: each rank is a host of
# its own (gpu_job.py --host-per-rank) and they talk over sockets on loopback (as in nccl_spans).
NCCL_ENV = {"NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo"}
ARCHIVE = "gpu-windows.tar.xz"
RESULTS = "gpu-accuracy.json"  # rewritten after every case: a step cut short by its budget keeps what it scored


@dataclass(frozen=True)
class GpuCase:
    collective: str  # gloo: gradients copied to the host and all-reduced there; nccl: all-reduce and a send ring
    ranks: int
    heavy: int | None = None  # the rank doing HEAVY_MATMULS; None: a healthy run

    @property
    def shape(self) -> str:
        return f"{self.collective}-{self.ranks}"

    @property
    def name(self) -> str:
        return f"{self.shape}-{'healthy' if self.heavy is None else 'gpu'}"


# Each shape's healthy case first: it gives the step its straggler case is measured against.
CASES = (GpuCase("gloo", 4), GpuCase("gloo", 4, 2), GpuCase("nccl", 2), GpuCase("nccl", 2, 1),
         GpuCase("nccl", 4), GpuCase("nccl", 4, 2))


@dataclass
class Scored:
    """One diagnosed window against the job's truth."""
    case: str
    window: int
    right: bool
    false_findings: int  # findings naming none of the expected ranks (all of them, in a healthy run)
    findings: list[dict]
    step_ms: float | None  # the document's
    truth_step_ms: float  # the job's own: rank 0's median step over the window
    cost: float | None = None  # the straggler finding's
    truth_cost: float | None = None  # 1 - the healthy step / this step
    diagnose_s: float = 0.0


def score(case: GpuCase, doc: dict) -> tuple[bool, int, dict]:
    """Right: a healthy run names nothing; a straggler run names its heavy rank first, a compute straggler in
    COMPONENT. Returns (right, false findings, the straggler finding or {})."""
    findings = doc.get("findings", [])
    if case.heavy is None:
        return not findings, len(findings), {}
    false = sum(1 for f in findings if case.heavy not in f.get("ranks", []))
    first = findings[0] if findings else {}
    right = (first.get("kind"), first.get("ranks"), first.get("component")) == \
        ("compute_straggler", [case.heavy], COMPONENT)
    return right, false, first if right else {}


def _step_ms(doc: dict) -> float | None:
    step = doc.get("step_time_s")
    return round(step * 1e3, 3) if step else None


def run_case(kit: Kit, case: GpuCase, healthy_step_s: float | None, windows: Path) -> list[Scored]:
    env = kit.job_env(shim=True, plugin=case.collective == "nccl")
    args = ["--seconds", "300", *STRAGGLER_JOB_ARGS]
    if case.collective == "nccl":
        env.update(NCCL_ENV)
        args.append("--host-per-rank")
    if case.heavy is not None:
        args += ["--heavy-rank", str(case.heavy), "--heavy-matmuls", str(HEAVY_MATMULS)]
    job = kit.job(ranks=case.ranks, env=env, collective=case.collective, args=tuple(args))
    out = []
    try:
        job.wait_phase("run", 150)
        for w in range(WINDOWS):
            saved = windows / f"{case.name}-{w}.msgpack"
            start = time.monotonic()
            result = rankscope(kit.python, kit.agent_env(), "diagnose", "--pid", ",".join(map(str, job.pids)),
                               "--json", "--duration", str(WINDOW_S), "--save-patterns", str(saved), timeout=180)
            took = time.monotonic() - start
            if result.returncode != 0:
                with open(kit.log, "a") as f:
                    f.write(f"--- diagnose of {case.name} exited {result.returncode}\n{result.stderr}\n")
                raise RuntimeError(f"diagnose exited {result.returncode}: {result.stderr.strip()[-600:]}")
            doc = json.loads(result.stdout)
            window = doc.get("window") or {}
            truth, _ = job.median_step_s(0, window.get("start", 0), window.get("end", time.time()))
            right, false, found = score(case, doc)
            row = Scored(case.name, w, right, false,
                         [{k: f.get(k) for k in ("kind", "ranks", "component", "function", "cost")}
                          for f in doc.get("findings", [])],
                         _step_ms(doc), round(truth * 1e3, 3), diagnose_s=round(took, 1))
            if case.heavy is not None:
                row.cost = found.get("cost")
                row.truth_cost = round(1 - healthy_step_s / truth, 4) if healthy_step_s else None
            (windows / f"{case.name}-{w}.json").write_text(json.dumps(
                {"case": asdict(case), "document": doc, "scored": asdict(row),
                 "steps": job.report(0).get("steps", [])[-2000:]}, default=str))
            out.append(row)
    finally:
        job.stop()
    return out


@dataclass
class CaseRow:
    case: str
    runs: int = 0
    right: int = 0
    false_findings: int = 0
    step_error: list[float] = field(default_factory=list)  # the document's step / the job's - 1, per window
    cost_error: list[float] = field(default_factory=list)  # the cost / the truth's - 1, per straggler window


def table(scored: list[Scored]) -> dict[str, dict]:
    rows: dict[str, CaseRow] = {}
    for s in scored:
        row = rows.setdefault(s.case, CaseRow(s.case))
        row.runs += 1
        row.right += s.right
        row.false_findings += s.false_findings
        if s.step_ms and s.truth_step_ms:
            row.step_error.append(round(s.step_ms / s.truth_step_ms - 1, 4))
        if s.cost is not None and s.truth_cost:
            row.cost_error.append(round(s.cost / s.truth_cost - 1, 4))
    return {name: asdict(r) for name, r in rows.items()}


def gpu_accuracy(kit: Kit) -> dict:
    """Every GpuCase diagnosed WINDOWS times on the GPU; fails where a verdict is wrong or a finding false."""
    kit.need_gpu()
    kit.need_agent()
    wanted = os.environ.get("RANKSCOPE_KIT_CASES")  # e.g. nccl-2,nccl-4: some shapes (a rerun's device time)
    cases = [c for c in CASES if not wanted or c.shape in wanted.split(",")]
    windows = kit.work / "gpu-windows"
    windows.mkdir(exist_ok=True)
    scored: list[Scored] = []
    healthy: dict[str, float] = {}
    broken: dict[str, str] = {}
    try:
        for case in cases:
            try:
                rows = run_case(kit, case, healthy.get(case.shape), windows)
            except (RuntimeError, TimeoutError, OSError, ValueError) as e:  # one case's job or agent: the rest run
                broken[case.name] = str(e)[-400:]
                continue
            scored += rows
            if case.heavy is None and rows:
                healthy[case.shape] = statistics.median(r.truth_step_ms for r in rows) / 1e3
            (kit.out / RESULTS).write_text(json.dumps([asdict(s) for s in scored], indent=1))
    finally:
        with tarfile.open(kit.out / ARCHIVE, "w:xz") as tar:
            tar.add(windows, arcname="gpu-windows")
    figures = {"cases": table(scored), "broken": broken, "windows": [asdict(s) for s in scored]}
    wrong = [f"{s.case}-{s.window}" for s in scored if not s.right or s.false_findings]
    if wrong or broken:
        raise Failed(f"wrong or false: {', '.join(wrong) or 'none'}; broken: {', '.join(broken) or 'none'}", figures)
    return figures
