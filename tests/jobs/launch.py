"""Start a test job (tests/jobs/*.py, or any torchrun script) under torchrun with faults injected, or the
simulated GPU job (rankscope.sim), and read its own step log: shared by the accuracy tests and
scripts/bench_accuracy.py.

The job's code is left as written: inject/sitecustomize.py (on PYTHONPATH) records every optimizer step and
applies $RANKSCOPE_FAULT; the simulated ranks log their steps themselves (rankscope.sim.steplog). Each
rank's pid comes from its own step log.

A slow link (SlowLink) puts one rank in its own network namespace behind a veth pair whose two ends are
rate-limited with tc's token bucket (tbf: this project's kernels have no netem). Every rank then runs under
its own torchrun, as on separate nodes, with gloo bound to the veth's addresses.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rankscope.sim.harness import free_port, wait_until
from rankscope.sim.job import SimJob, start_job

JOBS = Path(__file__).resolve().parent
INJECT = JOBS / "inject"


@dataclass(frozen=True)
class SlowLink:
    """Rank `rank`'s traffic to and from every other rank shaped to `rate` (tc's syntax) each way: from the job's
    start, or (`at_start` False) from TorchrunJob.shape_link, the job's own unshaped steps before it being the
    what-if of what the slow link costs."""

    rank: int
    rate: str = "100mbit"
    at_start: bool = True


@dataclass
class _Netns:
    """A network namespace joined to the root one by a veth pair: HOST_ADDR on the root side, NS_ADDR inside."""

    name: str
    host_if: str
    ns_if: str
    host_addr: str
    ns_addr: str
    shaped: bool = False

    @classmethod
    def create(cls, tag: str) -> _Netns:
        octet = int(tag[:4], 16) % 250 + 1
        ns = cls(f"rs-{tag}", f"rsh{tag}", f"rsn{tag}", f"10.78.{octet}.1", f"10.78.{octet}.2")
        try:
            _run(f"ip netns add {ns.name}", f"ip link add {ns.host_if} type veth peer name {ns.ns_if} netns {ns.name}",
                 f"ip addr add {ns.host_addr}/30 dev {ns.host_if}", f"ip link set {ns.host_if} up",
                 f"ip -n {ns.name} addr add {ns.ns_addr}/30 dev {ns.ns_if}",
                 f"ip -n {ns.name} link set {ns.ns_if} up", f"ip -n {ns.name} link set lo up")
        except RuntimeError:
            ns.delete()
            raise
        return ns

    def shape(self, rate: str | None) -> None:
        """Both directions, into the namespace (the root side's egress) and out of it, shaped to `rate`, or
        unshaped (None; tc cannot delete the veth's default). The bucket holds 1 ms of a 1 Gbit/s link and queues
        up to 100 ms before dropping."""
        if rate is None and not self.shaped:
            return
        change = f"replace dev {{}} root tbf rate {rate} burst 128kb latency 100ms" if rate else "del dev {} root"
        _run(f"tc qdisc {change.format(self.host_if)}", f"tc -n {self.name} qdisc {change.format(self.ns_if)}")
        self.shaped = rate is not None

    def delete(self) -> None:
        """The namespace, and with it the veth pair."""
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


def _run(*cmds: str) -> None:
    """`cmds` in order; RuntimeError with its stderr on the first that fails."""
    for cmd in cmds:
        try:
            subprocess.run(cmd.split(), check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"{e.cmd}: {e.stderr.strip()}") from e


class StepTruth:
    """A job's own step logs: r<RANK>.json per rank in `truth` (rankscope.sim.steplog), and its `go` file."""

    truth: Path
    ranks: int

    def step_log(self, rank: int) -> dict | None:
        try:
            return json.loads((self.truth / f"r{rank}.json").read_text())
        except (OSError, ValueError):  # not written yet
            return None

    def steps_done(self) -> int:
        """The fewest steps any rank has logged (0 before every rank logged one)."""
        logs = [self.step_log(r) for r in range(self.ranks)]
        return min((d["steps"] for d in logs if d), default=0) if all(logs) else 0

    def step_ends(self, rank: int) -> list[float]:
        d = self.step_log(rank)
        return d["ends"] if d else []

    def step_time(self, start: float, end: float, rank: int | None = None) -> float | None:
        """The job's own step time over [start, end] (unix s): the mean duration of the steps that ended
        within it, as its log's ms/step prints it, over every rank (or one)."""
        spans = []
        for r in range(self.ranks) if rank is None else [rank]:
            ends = [t for t in self.step_ends(r) if start <= t <= end]
            if len(ends) >= 2:
                spans.append((ends[-1] - ends[0]) / (len(ends) - 1))
        return statistics.fmean(spans) if spans else None

    def median_step(self, start: float, end: float) -> float | None:
        """The job's own typical step over [start, end] (unix s): the median duration of the steps that began
        and ended within it, over every rank. A pause between two steps (a checkpoint's save) lengthens one
        step of many, which the median leaves out and the mean (step_time) spreads over them all."""
        spans = []
        for r in range(self.ranks):
            ends = [t for t in self.step_ends(r) if start <= t <= end]
            spans += [b - a for a, b in zip(ends, ends[1:])]
        return statistics.median(spans) if spans else None

    def wait_written(self, after: float, timeout: float = 30) -> None:
        """Until every running rank's log was rewritten after `after` (unix s)."""
        def fresh() -> bool:
            logs = [self.step_log(r) for r in range(self.ranks)]
            return all(d and d["written"] > after for d in logs)
        wait_until(fresh, timeout, "the ranks' step logs", interval=0.1)

    def go(self) -> float:
        """Starts the faults whose onset is `go` (inject/sitecustomize.py); returns when (unix s)."""
        return self.switch("go", True)

    def switch(self, name: str, on: bool) -> float:
        """Starts (or stops) the faults whose onset is the switch `name` (inject/sitecustomize.py: each rank
        reads it every step); returns when (unix s)."""
        if on:
            (self.truth / name).touch()
        else:
            (self.truth / name).unlink(missing_ok=True)
        return time.time()


@dataclass
class TorchrunJob(StepTruth):
    """A running torchrun job; `truth` holds one step log per rank (inject/sitecustomize.py)."""

    script: str
    ranks: int
    launchers: list[subprocess.Popen]  # one torchrun, or one per rank (a slow link)
    truth: Path
    log: Path
    run_id: str
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid
    netns: _Netns | None = None
    slow_link: SlowLink | None = None

    def shape_link(self, on: bool) -> None:
        """The slow link's shaping switched on, or off (the fault of a job started with one, not `at_start`)."""
        assert self.netns is not None and self.slow_link is not None, "a job without a slow link"
        self.netns.shape(self.slow_link.rate if on else None)

    def alive(self) -> bool:
        return all(launcher.poll() is None for launcher in self.launchers)

    def exited(self) -> subprocess.Popen | None:
        """A torchrun that has exited, if any."""
        return next((launcher for launcher in self.launchers if launcher.poll() is not None), None)

    def kill(self) -> None:
        """SIGKILL torchrun's process group and each rank's (torchrun starts every rank in its own session)."""
        for pid in (*(launcher.pid for launcher in self.launchers), *self.pids.values()):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                os.kill(pid, signal.SIGCONT)  # a stopped rank must run to die of the group's SIGKILL
            except ProcessLookupError:
                pass
        for launcher in self.launchers:
            launcher.wait()
        if self.netns is not None:
            self.netns.delete()


def start(script: str, ranks: int, args: list[str], workdir: Path, fault: str = "",
          steady_steps: int = 20, timeout: float = 90, env: dict[str, str] | None = None,
          slow_link: SlowLink | None = None) -> TorchrunJob:
    """Start `script` (a path, or a name in tests/jobs/) with `ranks` ranks under torchrun and wait until every
    rank has logged `steady_steps` steps (0: until every rank has started and loaded torch, before its first
    step). `fault`: $RANKSCOPE_FAULT for the ranks."""
    path = Path(script) if os.sep in script else JOBS / script
    run_id = f"{path.stem}-{secrets.token_hex(3)}"
    truth = workdir / run_id
    truth.mkdir(parents=True)
    log = workdir / f"{run_id}.log"
    child_env = dict(os.environ, **(env or {}))
    child_env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(INJECT), child_env.get("PYTHONPATH")])),
                     RANKSCOPE_TRUTH_DIR=str(truth), RANKSCOPE_FAULT=fault)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--rdzv-id", run_id, "--master-port", str(free_port())]
    job = TorchrunJob(str(path), ranks, [], truth, log, run_id)
    def launch(argv: list[str], **extra_env: str) -> None:
        with open(log, "ab") as out:
            job.launchers.append(subprocess.Popen(
                [*argv, str(path), *args], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=dict(child_env, **extra_env), start_new_session=True))

    def steady() -> bool:
        if (gone := job.exited()) is not None:
            raise RuntimeError(f"torchrun exited {gone.returncode}: {log.read_text(errors='replace')[-2000:]}")
        return job.steps_done() >= steady_steps

    def started() -> bool:
        if (gone := job.exited()) is not None:
            raise RuntimeError(f"torchrun exited {gone.returncode}: {log.read_text(errors='replace')[-2000:]}")
        job.pids = _torch_ranks(job.launchers)
        return len(job.pids) == ranks

    try:
        if slow_link is None:
            launch([*torchrun, "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1"])
        else:
            job.netns, job.slow_link = (ns := _Netns.create(run_id[-6:])), slow_link
            if slow_link.at_start:
                job.shape_link(True)
            # torchrun sets OMP_NUM_THREADS=1 for several ranks of one node, not for one: left to 2 intra-op
            # threads each (spinning OpenMP waits), cnn-3's ranks computed 8x slower than under one torchrun,
            # and that, not the link, made the "slow link" job's 0.5 s steps. The ranks share this node's cores.
            omp = {"OMP_NUM_THREADS": child_env.get("OMP_NUM_THREADS", "1")}
            for rank in range(ranks):  # a node per rank: static rendezvous, node rank = global rank
                inside = rank == slow_link.rank
                launch([*(["nsenter", f"--net=/var/run/netns/{ns.name}"] if inside else []), *torchrun,
                        "--nnodes", str(ranks), "--node-rank", str(rank), "--nproc-per-node", "1",
                        "--master-addr", ns.host_addr], GLOO_SOCKET_IFNAME=ns.ns_if if inside else ns.host_if, **omp)
        if not steady_steps:
            wait_until(started, timeout, f"every rank of {path.name} to load torch", interval=0.1)
            return job
        wait_until(steady, timeout, f"every rank of {path.name} to log {steady_steps} steps", interval=0.2)
        job.pids = {r: job.step_log(r)["pid"] for r in range(ranks)}
    except BaseException:
        job.kill()
        raise
    return job


def _torch_ranks(launchers: list[subprocess.Popen]) -> dict[int, int]:
    """rank -> pid of the launchers' children that have loaded torch (libtorch_cpu.so mapped), by their RANK."""
    parents = {launcher.pid for launcher in launchers}
    out = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text(errors="replace")
            if int(stat[stat.rindex(")") + 2:].split()[1]) not in parents:
                continue
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{entry}/environ").read_text(errors="replace")
                       .split("\0") if "=" in kv)
            if "RANK" in env and "libtorch_cpu.so" in Path(f"/proc/{entry}/maps").read_text():
                out[int(env["RANK"])] = int(entry)
        except (OSError, ValueError):  # gone meanwhile
            continue
    return out


@dataclass
class SimRun(StepTruth):
    """The simulated GPU job (rankscope.sim) behind TorchrunJob's face: its faults are `--fault` specs."""

    job: SimJob
    truth: Path
    run_id: str  # the job id rankscope reports (TORCHELASTIC_RUN_ID)
    pids: dict[int, int] = field(default_factory=dict)

    @property
    def ranks(self) -> int:
        return self.job.ranks

    @property
    def log(self) -> Path:
        """The stderr of the first rank that exited (else rank 0's)."""
        codes = self.job.returncodes()
        return self.job.log_dir / f"rank{next((r for r, c in enumerate(codes) if c is not None), 0)}.err"

    def alive(self) -> bool:
        return all(code is None for code in self.job.returncodes())

    def kill(self) -> None:
        for pid in self.job.pids:
            try:
                os.kill(pid, signal.SIGCONT)  # a stopped rank must run to end
            except ProcessLookupError:
                pass
        self.job.stop()


def start_sim(ranks: int, faults: list[str], workdir: Path, steady_steps: int = 20, timeout: float = 90) -> SimRun:
    """Start the simulated GPU job with `ranks` ranks and `faults` (rankscope.sim.faults specs) and wait until
    every rank has logged `steady_steps` steps."""
    truth = workdir / f"sim-truth-{secrets.token_hex(3)}"
    truth.mkdir(parents=True)
    job = start_job(ranks, faults, log_dir=workdir / f"{truth.name}-logs", truth_dir=truth)
    run = SimRun(job, truth, job.job_id)

    def steady() -> bool:
        if not run.alive():
            raise RuntimeError(f"a simulated rank exited: {run.log.read_text(errors='replace')[-2000:]}")
        return run.steps_done() >= steady_steps

    try:
        wait_until(steady, timeout, f"every simulated rank to log {steady_steps} steps", interval=0.2)
        run.pids = {r: run.step_log(r)["pid"] for r in range(ranks)}
    except BaseException:
        run.kill()
        raise
    return run


def pin(job: TorchrunJob | SimRun, cpu_of_rank: dict[int, int]) -> None:
    """Pins every thread of each named rank (and its DataLoader workers' threads too: taskset -a on the rank
    only reaches its own threads) to one CPU."""
    for rank, cpu in cpu_of_rank.items():
        subprocess.run(["taskset", "-a", "-p", "-c", str(cpu), str(job.pids[rank])], check=True,
                       capture_output=True)


def settle(job: TorchrunJob | SimRun, seconds: float) -> None:
    """Let the job run `seconds` more (warm-up), failing early if it dies."""
    deadline = time.monotonic() + seconds
    wait_until(lambda: not job.alive() or time.monotonic() >= deadline, seconds + 5, "the warm-up", interval=0.2)
    if not job.alive():
        raise RuntimeError(f"{job.run_id} exited during warm-up: {job.log.read_text(errors='replace')[-2000:]}")


def until_watching(diagnose: subprocess.Popen) -> str:
    """Reads `rankscope diagnose`'s stderr (text) up to its line "rankscope: watching N processes of job J for
    D s": every rank is watched and the window is open from here on. Returns what it printed before (the
    warnings of attaching: a rank whose Python frames could not be read, ...)."""
    seen = []
    while line := diagnose.stderr.readline():
        if "rankscope: watching" in line:
            return "".join(seen)
        seen.append(line)
    raise AssertionError("diagnose ended before watching: " + "".join(seen))
