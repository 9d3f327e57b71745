"""The jobs the kit watches: the PyTorch job on the GPU (gpu_job.py, one process per rank) or, without a GPU,
the simulated job of rankscope/sim; and the rankscope processes it runs beside them. Every process is started
in a session of its own and killed with it, so nothing the kit starts outlives its step."""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from rankscope.agent.host.targets import stat_fields
from rankscope.sim.harness import wait_until

JOB_SCRIPT = Path(__file__).resolve().parent / "gpu_job.py"


@dataclass
class GpuJob:
    """The ranks of one gpu_job.py run; each writes reports/r<rank>.json."""

    procs: list[subprocess.Popen]
    reports: Path
    log: Path

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def report(self, rank: int) -> dict:
        try:
            return json.loads((self.reports / f"r{rank}.json").read_text())
        except (OSError, ValueError):  # not written yet
            return {}

    def in_phase(self, phase: str) -> bool:
        """Every rank has reached `phase` (raises once a rank exited with an error: the log says why)."""
        for rank, proc in enumerate(self.procs):
            if proc.poll() not in (None, 0):
                raise RuntimeError(f"rank {rank} exited with {proc.returncode}: {tail(self.log)}")
        return all(self.report(r).get("phase") == phase for r in range(len(self.procs)))

    def wait_phase(self, phase: str, timeout: float) -> None:
        wait_until(lambda: self.in_phase(phase), timeout, f"every rank in phase {phase!r}", interval=0.2)

    def step_times(self, rank: int, start: float, end: float) -> list[float]:
        """The rank's step times (s) of the steps within [start, end] (unix s), as its report holds them."""
        return [d for s, d in self.report(rank).get("steps", []) if start <= s and s + d <= end]

    def median_step_s(self, rank: int, start: float, end: float) -> tuple[float, int]:
        """The rank's median step time over its steps within [start, end] (unix s), and how many."""
        steps = self.step_times(rank, start, end)
        return (statistics.median(steps) if steps else float("nan")), len(steps)

    def reported_past(self, t: float) -> bool:
        """Rank 0's report holds a step that started after `t` (it is written every half second)."""
        steps = self.report(0).get("steps", [])
        return bool(steps) and steps[-1][0] > t

    def pause(self) -> None:
        """SIGSTOP: the ranks take no CPU and queue no GPU work until resume(). Returns once they are stopped
        (a signal is delivered when its target next runs, not when kill returns)."""
        self._signal(signal.SIGSTOP)
        wait_until(lambda: all(stopped(p) for p in self.procs), 10, "the ranks to stop", interval=0.001)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, sig)

    def stop(self) -> None:
        for proc in self.procs:
            kill_session(proc)


def stopped(proc: subprocess.Popen) -> bool:
    """The process is stopped by a signal, or gone."""
    try:
        state = stat_fields(proc.pid)[0]
    except (OSError, ValueError, IndexError):
        return True
    return state in ("T", "Z", "X") or proc.poll() is not None


def tail(log: Path, chars: int = 600) -> str:
    try:
        return log.read_text(errors="replace")[-chars:].strip()
    except OSError:
        return ""


def kill_session(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def start_gpu_job(python: str, workdir: Path, log: Path, ranks: int = 1, env: dict[str, str] | None = None,
                  args: tuple[str, ...] = (), collective: str = "none") -> GpuJob:
    """`ranks` processes of gpu_job.py on GPU 0 (a rendezvous on a free port), their reports under `workdir`,
    their output appended to `log`."""
    from rankscope.sim.harness import free_port

    reports = workdir / f"job-{time.monotonic_ns()}"
    reports.mkdir(parents=True)
    port = str(free_port())
    procs = []
    with open(log, "ab") as out:
        out.write(f"--- gpu_job.py x{ranks} {collective} {' '.join(args)}\n".encode())
        for rank in range(ranks):
            rank_env = {**(env if env is not None else os.environ), "RANK": str(rank), "WORLD_SIZE": str(ranks),
                        "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                        "PYTHONUNBUFFERED": "1"}
            procs.append(subprocess.Popen(
                [python, str(JOB_SCRIPT), "--report", str(reports / f"r{rank}.json"), "--collective", collective,
                 *args], env=rank_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
    return GpuJob(procs, reports, log)


@dataclass
class Agent:
    """A `rankscope agent` serving on loopback, stopped (SIGINT, then SIGKILL) by stop()."""

    proc: subprocess.Popen
    url: str
    log: Path
    started: float = field(default_factory=time.time)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        kill_session(self.proc)


def rankscope(python: str, env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-m", "rankscope.agent.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def start_agent(python: str, env: dict[str, str], pids: list[int], detail: str, log: Path) -> Agent:
    from rankscope.sim.harness import free_port

    port = free_port()
    with open(log, "ab") as out:
        out.write(f"--- rankscope agent --detail {detail}\n".encode())
        proc = subprocess.Popen([python, "-m", "rankscope.agent.cli", "agent", "--pid", ",".join(map(str, pids)),
                                 "--listen", f"127.0.0.1:{port}", "--window", "1", "--detail", detail],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Agent(proc, f"http://127.0.0.1:{port}", log)


def library_path(pid: int, fragment: str) -> str | None:
    """The host path of the file `pid` maps whose name contains `fragment` (e.g. 'libcuda.so')."""
    from rankscope.agent.host import procfs

    for m in procfs.maps(pid):
        if fragment in Path(m.path).name:
            return procfs.host_path(pid, m.path)
    return None

