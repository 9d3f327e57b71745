"""Launches a simulated training job: N rank processes with torchrun-like identities, one process group.

`rankscope sim --ranks N [--fault SPEC ...] [--steps N]` prints the PIDs as one comma-separated line, then
waits until the ranks exit (or Ctrl-C / SIGTERM) and stops them.
"""
from __future__ import annotations

import argparse
import atexit
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from rankscope.sim.bindings import shm_name
from rankscope.sim.build import build_libraries
from rankscope.sim.faults import GRAMMAR, Fault, parse_fault
from rankscope.sim.harness import free_port

__all__ = ["Fault", "SimJob", "parse_fault", "start_job", "add_arguments", "run", "main"]

RANK_SCRIPT = Path(__file__).resolve().parent / "rank.py"
_STEP_TIME = re.compile(r"^step_time_s=([0-9.eE+-]+)\s*$", re.M)
_live_jobs: weakref.WeakSet[SimJob] = weakref.WeakSet()


@dataclass(eq=False)
class SimJob:
    """A running simulated job. `stop()` (also on leaving a `with` block, and at interpreter exit) ends it."""

    job_id: str  # TORCHELASTIC_RUN_ID of every rank
    procs: list[subprocess.Popen]  # index = global rank
    faults: list[Fault]
    nccl_id: bytes  # the communicator's ncclUniqueId
    lib_dir: Path
    log_dir: Path  # rank<R>.out / rank<R>.err
    master_port: int
    _owns_log_dir: bool = True
    _stopped: bool = field(default=False, repr=False)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @property
    def ranks(self) -> int:
        return len(self.procs)

    @property
    def pgid(self) -> int:
        return self.procs[0].pid

    @property
    def shm_name(self) -> str:
        """The communicator's POSIX shared-memory name (under /dev/shm without the leading slash)."""
        return shm_name(self.nccl_id)

    def returncodes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def alive(self) -> bool:
        """True while any rank is running."""
        return any(code is None for code in self.returncodes())

    def wait(self, timeout: float | None = None) -> list[int]:
        """Waits for every rank to exit; their exit codes. subprocess.TimeoutExpired if one is still running."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in self.procs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            p.wait(left)
        return [p.returncode for p in self.procs]

    def output(self, rank: int) -> str:
        """What rank `rank` printed on stdout so far (readable until stop())."""
        return (self.log_dir / f"rank{rank}.out").read_text(errors="replace")

    def errors(self, rank: int) -> str:
        return (self.log_dir / f"rank{rank}.err").read_text(errors="replace")

    def step_times(self) -> list[float | None]:
        """Per rank, the median step time a rank run with `steps` printed at exit (None if it did not)."""
        out = []
        for r in range(self.ranks):
            try:
                found = _STEP_TIME.findall(self.output(r))
            except OSError:
                found = []
            out.append(float(found[-1]) if found else None)
        return out

    def _signal(self, sig: int) -> None:
        if not self.alive():  # the group may be gone: never signal a recycled id
            return
        try:
            os.killpg(self.pgid, sig)
        except (ProcessLookupError, PermissionError):
            for p in self.procs:  # rank 0 left its group? signal the others one by one
                if p.poll() is None:
                    try:
                        p.send_signal(sig)
                    except ProcessLookupError:
                        pass

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM to the ranks, SIGKILL after `timeout` s; removes the shared memory and the logs. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._signal(signal.SIGTERM)
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.wait()
        try:
            os.unlink("/dev/shm/" + self.shm_name.lstrip("/"))
        except OSError:
            pass
        if self._owns_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        _live_jobs.discard(self)

    def __enter__(self) -> SimJob:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@atexit.register
def _stop_leftover_jobs() -> None:
    for job in list(_live_jobs):
        job.stop(timeout=2.0)


def start_job(ranks: int, faults: list[str | Fault] | tuple[str | Fault, ...] = (), steps: int | None = None,
              hold_file: Path | None = None, python: str = sys.executable, *, log_dir: Path | None = None,
              nccl_id: bytes | None = None, host_cpu_s: float | None = None,
              truth_dir: Path | None = None, buckets: int = 1) -> SimJob:
    """Builds the stand-ins and starts `ranks` rank processes (one process group); returns at once.

    faults: SPEC strings (see faults.GRAMMAR) or Fault objects; ValueError if malformed or naming a rank the
        job lacks.
    steps: each rank exits after that many steps (default: run until stopped).
    hold_file: the ranks wait for this file to exist before ncclCommInitRank.
    python: the interpreter of the ranks (another one runs rank.py as a script).
    log_dir: where ranks' stdout/stderr go (default: a temporary folder removed by stop()).
    nccl_id: the 128-byte ncclUniqueId (default: 128 random bytes, as ncclGetUniqueId makes them).
    host_cpu_s: CPU work of every rank's load_batch per step (default 1 ms): a host-heavier job.
    truth_dir: where each rank keeps its own step log, r<RANK>.json (steplog.py), for tests to check against.
    buckets: the gradients' all-reduces a step, enqueued before one synchronization (DDP's buckets).
    """
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a positive integer, not {ranks!r}")
    if steps is not None and steps < 0:
        raise ValueError("steps must be >= 0")
    if isinstance(faults, str):
        faults = [faults]
    parsed = [s if isinstance(s, Fault) else parse_fault(s) for s in faults]
    for spec, f in zip(faults, parsed):
        if f.rank >= ranks:
            raise ValueError(f"fault {str(spec)!r} names rank {f.rank}, but the job has ranks 0..{ranks - 1}")
    lib_dir = build_libraries()
    # The id is made here without loading libnccl.so.2 (its content is what ncclGetUniqueId returns: 128
    # random bytes): a launcher mapping the stand-ins would look like a training process to discovery.
    if nccl_id is None:
        nccl_id = secrets.token_bytes(128)
    if len(nccl_id) != 128:
        raise ValueError("nccl_id must be 128 bytes")
    job_id = f"sim-{secrets.token_hex(4)}"
    port = free_port()
    owns = log_dir is None
    log_dir = Path(tempfile.mkdtemp(prefix=f"rankscope-{job_id}-")) if log_dir is None else Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)

    if os.path.abspath(python) == os.path.abspath(sys.executable):  # else it may lack this package
        cmd = [python, "-m", "rankscope.sim.rank"]
    else:
        cmd = [python, str(RANK_SCRIPT)]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    if buckets != 1:
        cmd += ["--buckets", str(buckets)]
    for f in parsed:
        cmd += ["--fault", f.spec()]
    base_env = dict(os.environ, WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks), GROUP_RANK="0",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID=job_id,
                    RANKSCOPE_SIM_NCCL_ID=nccl_id.hex(), RANKSCOPE_SIM_LIB_DIR=str(lib_dir),
                    PYTHONUNBUFFERED="1")
    if hold_file is not None:
        base_env["RANKSCOPE_SIM_HOLD"] = str(hold_file)
    else:
        base_env.pop("RANKSCOPE_SIM_HOLD", None)
    base_env.pop("RANKSCOPE_SIM_HOST_CPU_S", None)
    base_env.pop("RANKSCOPE_TRUTH_DIR", None)
    if truth_dir is not None:
        base_env["RANKSCOPE_TRUTH_DIR"] = str(truth_dir)
    if host_cpu_s is not None:
        base_env["RANKSCOPE_SIM_HOST_CPU_S"] = str(host_cpu_s)

    procs: list[subprocess.Popen] = []
    try:
        for r in range(ranks):
            env = dict(base_env, RANK=str(r), LOCAL_RANK=str(r))
            group = 0 if r == 0 else procs[0].pid
            with open(log_dir / f"rank{r}.out", "wb") as out, open(log_dir / f"rank{r}.err", "wb") as err:
                procs.append(_spawn(cmd, env, out, err, group))
    except BaseException:
        for p in procs:
            p.kill()
            p.wait()
        if owns:
            shutil.rmtree(log_dir, ignore_errors=True)
        raise
    job = SimJob(job_id, procs, parsed, nccl_id, lib_dir, log_dir, port, owns)
    _live_jobs.add(job)
    return job


def _spawn(cmd: list[str], env: dict[str, str], out, err, group: int) -> subprocess.Popen:
    common = dict(env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, close_fds=True)
    if sys.version_info >= (3, 11):
        return subprocess.Popen(cmd, process_group=group, **common)
    return subprocess.Popen(cmd, preexec_fn=lambda: os.setpgid(0, group), **common)  # noqa: PLW1509


# ---------------------------------------------------------------- command line

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=4, help="number of rank processes (default 4)")
    parser.add_argument("--fault", action="append", default=[], metavar="SPEC",
                        help=f"inject a fault: {GRAMMAR} (repeatable), e.g. slow-gpu:2:2.5, gc:1@5, hang:0:100")
    parser.add_argument("--steps", type=int, default=None, help="each rank exits after N steps (default: forever)")


class _Stop(Exception):
    pass


def _raise_stop(_signum, _frame):
    raise _Stop()


def run(args: argparse.Namespace) -> int:
    """Runs the job until its ranks exit or Ctrl-C/SIGTERM; 0 when every rank exited 0 (or was stopped)."""
    try:
        job = start_job(args.ranks, faults=args.fault, steps=args.steps)
    except ValueError as e:
        print(f"rankscope: error: {e}", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, _raise_stop)
    stopped = False
    try:
        print(",".join(map(str, job.pids)), flush=True)
        while job.alive():
            try:
                job.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
    except (KeyboardInterrupt, _Stop):
        stopped = True
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        codes = job.returncodes()
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        for r in failed:
            tail = job.errors(r).strip().splitlines()[-5:]
            print(f"rankscope: rank {r} exited with status {codes[r]}" + "".join(f"\n  {line}" for line in tail),
                  file=sys.stderr)
        job.stop()
        signal.signal(signal.SIGTERM, previous)
    return 0 if stopped or not failed else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rankscope sim", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
