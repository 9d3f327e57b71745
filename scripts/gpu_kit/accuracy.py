"""The real GPU's rows of the accuracy matrix (issue 13): PyTorch ranks time-sharing the one GPU through gloo and
through NCCL, healthy, with one rank doing 8x the matrix products (a GPU-side straggler), and with one rank's
input pipeline slow (a host-side one: each batch it reads takes half the healthy step longer). `rankscope
diagnose` over each window is scored as `scripts/bench accuracy` scores a run: the verdict (kind, rank and
component), false findings, the step time against the job's own log, and the cost against the share of the step
the fault is: the injected delay's where it is one, else the share the same shape loses to it (its healthy
case's step, measured just before). Every window's patterns, document and truth are kept in
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

# Diagnosed windows per case, one after another on one job: the decision repeated (RANKSCOPE_KIT_WINDOWS: more,
# where the device time allows; a window costs ~12 s, 5 traced and the agent's start)
WINDOWS = int(os.environ.get("RANKSCOPE_KIT_WINDOWS", "3"))
WINDOW_S = 5
# Each fault: the finding expected first, naming the faulty rank (kind, component). The heavy rank's time goes to
# its kernels, waited for in the copy of its gradients; the slow reader's to its DataLoader's fetch.
EXPECTED = {"gpu": ("compute_straggler", "gpu"), "loader": ("input_straggler", "input")}
LOADER_SHARE = 0.5  # the slow reader's extra time per batch, of its shape's healthy step (the CPU matrix's)
INJECTOR = Path(__file__).resolve().parents[2] / "tests" / "jobs" / "inject"  # its sitecustomize: the loader fault
# NCCL refuses two ranks of a communicator on one GPU unless they are on different hosts: each rank is a host of
# its own (gpu_job.py --host-per-rank) and they talk over sockets on loopback (as in nccl_spans).
NCCL_ENV = {"NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo"}
ARCHIVE = "gpu-windows.tar.xz"
RESULTS = "gpu-accuracy.json"  # rewritten after every case: a step cut short by its budget keeps what it scored


@dataclass(frozen=True)
class GpuCase:
    collective: str  # gloo: gradients copied to the host and all-reduced there; nccl: all-reduce and a send ring
    ranks: int
    fault: str | None = None  # an EXPECTED key; None: a healthy run
    rank: int = -1  # the faulty rank

    @property
    def shape(self) -> str:
        return f"{self.collective}-{self.ranks}"

    @property
    def name(self) -> str:
        return f"{self.shape}-{self.fault or 'healthy'}"


# Each shape's healthy case first: it gives the step its faults are scaled to and measured against. The host-side
# fault before the GPU-side one, which earlier runs measured (2026-12-04, runs 2-3).
CASES = tuple(GpuCase(c, n, fault, rank if fault else -1) for c, n, rank in (("nccl", 4, 2), ("nccl", 2, 1),
                                                                            ("gloo", 4, 2))
              for fault in (None, "loader", "gpu"))


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
    truth_cost: float | None = None  # 1 - the healthy step / this step: what the job lost
    injected_cost: float | None = None  # the injected delay / this step, where the fault is one (the loader's)
    diagnose_s: float = 0.0


def score(case: GpuCase, doc: dict) -> tuple[bool, int, dict]:
    """Right: a healthy run names nothing; a faulty run names its rank first, with the kind and component
    EXPECTED of its fault. Returns (right, false findings, the straggler finding or {})."""
    findings = doc.get("findings", [])
    if case.fault is None:
        return not findings, len(findings), {}
    false = sum(1 for f in findings if case.rank not in f.get("ranks", []))
    first = findings[0] if findings else {}
    kind, component = EXPECTED[case.fault]
    right = (first.get("kind"), first.get("ranks"), first.get("component")) == (kind, [case.rank], component)
    return right, false, first if right else {}


def _step_ms(doc: dict) -> float | None:
    step = doc.get("step_time_s")
    return round(step * 1e3, 3) if step else None


def run_case(kit: Kit, case: GpuCase, healthy_step_s: float | None, windows: Path) -> list[Scored]:
    env = kit.job_env(shim=True, plugin=case.collective == "nccl")
    args = ["--seconds", "300", "--loader", *STRAGGLER_JOB_ARGS]
    if case.collective == "nccl":
        env.update(NCCL_ENV)
        args.append("--host-per-rank")
    delay = None
    if case.fault == "gpu":
        args += ["--heavy-rank", str(case.rank), "--heavy-matmuls", str(HEAVY_MATMULS)]
    elif case.fault == "loader":
        if not healthy_step_s:
            raise RuntimeError(f"no healthy step of {case.shape} to scale the slow reader's delay to")
        delay = LOADER_SHARE * healthy_step_s
        env["RANKSCOPE_FAULT"] = f"loader:{case.rank}:{delay:.4f}"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(INJECTOR), env.get("PYTHONPATH"))))
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
            if case.fault is not None:
                row.cost = found.get("cost")
                row.truth_cost = round(1 - healthy_step_s / truth, 4) if healthy_step_s else None
                row.injected_cost = round(delay / truth, 4) if delay else None
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
    # the cost / the injected share - 1 (the job's loss where no delay was injected), per straggler window
    cost_error: list[float] = field(default_factory=list)


def table(scored: list[Scored]) -> dict[str, dict]:
    rows: dict[str, CaseRow] = {}
    for s in scored:
        row = rows.setdefault(s.case, CaseRow(s.case))
        row.runs += 1
        row.right += s.right
        row.false_findings += s.false_findings
        if s.step_ms and s.truth_step_ms:
            row.step_error.append(round(s.step_ms / s.truth_step_ms - 1, 4))
        if s.cost is not None and (share := s.injected_cost or s.truth_cost):
            row.cost_error.append(round(s.cost / share - 1, 4))
    return {name: asdict(r) for name, r in rows.items()}


def gpu_accuracy(kit: Kit) -> dict:
    """Every GpuCase diagnosed WINDOWS times on the GPU; fails where a verdict is wrong or a finding false."""
    kit.need_gpu()
    kit.need_agent()
    wanted = os.environ.get("RANKSCOPE_KIT_CASES")  # e.g. nccl-2,gloo-4-healthy: shapes or cases (device time)
    cases = [c for c in CASES if not wanted or {c.shape, c.name} & set(wanted.split(","))]
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
            if case.fault is None and rows:
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
