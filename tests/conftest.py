"""Shared helpers: waiting on conditions (never on the clock alone), simulated jobs, an agent process."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import pytest

from rankscope.schema.document import diagnosis_schema
from rankscope.sim.harness import free_port, http_json, maps_library, terminate, wait_until
from rankscope.sim.job import SimJob, start_job

__all__ = ["maps_library", "wait_until"]  # re-exported: the tests' own helpers live in the package

RANKSCOPE = [sys.executable, "-m", "rankscope.agent.cli"]

# Compiled BPF programs (loader/bpf_cache.py) are shared by the session's processes, in a directory of its own:
# the first test to attach a program compiles it, as on a fresh node, and the others load it. A developer's
# RANKSCOPE_BPF_CACHE (e.g. "off": every process compiles) is kept.
_BPF_CACHE = os.environ.get("RANKSCOPE_BPF_CACHE") or tempfile.mkdtemp(prefix="rankscope-test-bpf-")
os.environ["RANKSCOPE_BPF_CACHE"] = _BPF_CACHE
# Agents' history databases (--history-dir's default) in a directory of the test session, not the node's.
_HISTORY = tempfile.mkdtemp(prefix="rankscope-test-history-")
os.environ["RANKSCOPE_HISTORY_DIR"] = _HISTORY


def pytest_sessionfinish(session, exitstatus) -> None:
    if _BPF_CACHE.startswith(tempfile.gettempdir() + "/rankscope-test-bpf-"):
        shutil.rmtree(_BPF_CACHE, ignore_errors=True)
    shutil.rmtree(_HISTORY, ignore_errors=True)


def run(*args: str, user: int | None = None) -> subprocess.CompletedProcess:
    cmd = [*RANKSCOPE, *args]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", "--inh-caps=-all", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("rankscope: error: ")
    return lines[0]


@pytest.fixture
def sim_job() -> Iterator[Callable[..., SimJob]]:
    """Start simulated jobs whose ranks have loaded libcuda and libnccl; every job is stopped afterwards."""
    jobs: list[SimJob] = []

    def start(ranks: int = 4, faults: tuple[str, ...] = (), **kwargs) -> SimJob:
        job = start_job(ranks, faults=list(faults), **kwargs)
        jobs.append(job)
        wait_until(lambda: all(maps_library(p, "libnccl.so.2") for p in job.pids), 30, "ranks to load the stand-ins")
        return job

    yield start
    for job in jobs:
        job.stop()


class CommandProcess:
    """A helper program driven one line at a time (tests/*_driver.py): it prints "ready" once loaded, then
    one reply line per command line."""

    def __init__(self, *argv: str):
        self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout.readline().strip() == "ready"
        self.pid = self.proc.pid

    def call(self, line: str) -> list[str]:
        """The reply's words."""
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().split()


@pytest.fixture
def command_process() -> Iterator[Callable[..., CommandProcess]]:
    """Start CommandProcesses (argv); every one is killed after the test."""
    started: list[CommandProcess] = []

    def start(*argv: str) -> CommandProcess:
        started.append(CommandProcess(*argv))
        return started[-1]

    yield start
    for p in started:
        p.proc.kill()
        p.proc.wait()


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen]]:
    """Processes a test starts (append them): terminated after the test, killed if they linger."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.terminate()
    for p in started:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# The contention tests' ranks and hog, by scheduler weight. The kernel shares a CPU first between autogroups
# (one per session: this pytest, each torchrun job, the hog), then between the tasks of a group by nice. Other
# load on the machine (its own autogroups, at nice 0: weight 1024) moves to whichever CPU the hog leaves, and
# at equal weights two strangers starved the victim's peers as much as the victim: the tests found nothing.
# So the hog has a session of its own at HOG_NICE and the ranks' session runs at RANK_NICE: rank 2 gets ~10%
# of its CPU, its peers keep theirs against ten strangers. Both are also set per task, for kernels without
# autogroups (a container's cgroup, as in CI). At nice -15 (weight 29154) the hog took only 3-5 ms a step
# from a rank that computes 4 ms a step and sleeps the rest, in 2 runs of 90 (late in 55% of the steps, under
# the 60% that the rules ask: no finding; CI failed so once): the scheduler owes a waking sleeper its lag.
RANK_NICE = -10  # weight 9548
HOG_NICE = -20  # weight 88761


def _autogroup_nice(pid: int) -> int | None:
    """The nice of `pid`'s autogroup ("/autogroup-N nice K"); None where autogroups do not apply: a kernel without
    them, or a process in the root autogroup (its ancestors never called setsid, as in CI's container: the file
    reads empty, and writing it fails with EINVAL)."""
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            fields = f.read().split()
    except FileNotFoundError:
        return None
    return int(fields[-1]) if fields else None


def _set_autogroup_nice(pid: int, nice: int) -> None:
    if _autogroup_nice(pid) is not None:  # otherwise per-task nice is all there is
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, sorted."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
            out.append(int(entry))
    return sorted(out)


def raise_above_other_load(pid: int, with_children: bool = False) -> None:
    """Every thread of `pid` (and of its child processes: a DataLoader's workers) at RANK_NICE, its session's
    autogroup too: the machine's other load at nice 0 (other jobs beside the suite) takes no CPU it asks for.
    Threads and processes started later inherit it."""
    for proc in [pid, *(children(pid) if with_children else [])]:
        for tid in map(int, os.listdir(f"/proc/{proc}/task")):
            os.setpriority(os.PRIO_PROCESS, tid, RANK_NICE)  # per thread on Linux
    _set_autogroup_nice(pid, RANK_NICE)


@pytest.fixture
def above_other_load() -> Iterator[Callable[[int, int], None]]:
    """pin(pid, cpu): every thread of `pid` on `cpu`, at RANK_NICE, its session's autogroup too. After the test
    each pinned thread gets its CPUs and nice back, and each autogroup its nice, this pytest's own too (the
    simulated job's ranks share it): a job that several tests share runs on as it did."""
    threads: dict[int, tuple[set[int], int]] = {}  # tid -> its CPUs and nice before
    groups = {os.getpid(): _autogroup_nice(os.getpid())}  # pid -> its autogroup's nice before

    def pin(pid: int, cpu: int) -> None:
        groups.setdefault(pid, _autogroup_nice(pid))
        for tid in map(int, os.listdir(f"/proc/{pid}/task")):
            threads.setdefault(tid, (os.sched_getaffinity(tid), os.getpriority(os.PRIO_PROCESS, tid)))
            os.sched_setaffinity(tid, {cpu})
        raise_above_other_load(pid)

    yield pin
    for tid, (cpus, nice) in threads.items():
        try:
            os.sched_setaffinity(tid, cpus)
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:  # ended with its job
            pass
    for pid, nice in groups.items():
        try:
            if nice is not None:
                _set_autogroup_nice(pid, nice)
        except OSError:  # ended with its job
            pass


@contextlib.contextmanager
def cpu_hog() -> Iterator[subprocess.Popen]:
    """A busy loop on CPU 1, in a session of its own at HOG_NICE: it takes ~90% of that CPU from a rank."""
    proc = subprocess.Popen(["taskset", "-c", "1", "nice", "-n", str(HOG_NICE), "sh", "-c", "while :; do :; done"],
                            start_new_session=True)
    try:
        _set_autogroup_nice(proc.pid, HOG_NICE)
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def hog() -> Iterator[subprocess.Popen]:
    """cpu_hog() for the whole test."""
    with cpu_hog() as proc:
        yield proc


class AgentProcess:
    """`rankscope agent` in a subprocess, serving on a free loopback port."""

    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # Output to a file: a pipe nobody drains would block the agent once it filled.
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([*RANKSCOPE, "agent", "--listen", f"127.0.0.1:{self.port}", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True)

        def up() -> bool:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise AssertionError(f"agent exited: {self.log.read()[-4000:]}")
            try:
                return http_json(f"{self.url}/v1/targets") is not None
            except OSError:
                return False

        wait_until(up, 60, "the agent to serve")

    def get(self, path: str) -> Any:
        answer = http_json(self.url + path)
        if path.startswith("/v1/diagnosis"):
            check_document(answer)
        return answer

    def stop(self) -> None:
        terminate(self.proc, 20)
        self.log.close()


@pytest.fixture
def agent() -> Iterator[Callable[..., AgentProcess]]:
    started: list[AgentProcess] = []

    def start(*args: str) -> AgentProcess:
        a = AgentProcess(*args)
        started.append(a)
        return a

    yield start
    for a in started:
        a.stop()


def diagnose_json(pids: list[int], duration: float, *extra: str) -> dict:
    out = subprocess.run([*RANKSCOPE, "diagnose", "--pid", ",".join(map(str, pids)), "--duration", str(duration),
                          "--json", *extra], capture_output=True, text=True, timeout=duration + 60)
    assert out.returncode == 0, out.stderr
    return check_document(json.loads(out.stdout))


@functools.cache
def _document_validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(diagnosis_schema())


def check_document(doc: dict) -> dict:
    """`doc`, once it is a diagnosis document as rankscope/schema/diagnosis.schema.json describes it: every
    document the tests read from `diagnose --json` or an agent's /v1/diagnosis passes through here."""
    errors = sorted(_document_validator().iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, "; ".join(f"{'/'.join(map(str, e.absolute_path)) or '(document)'}: {e.message}"
                                 for e in errors[:5])
    return doc




def captured_while(streams: list, pid: int, action: Callable[[], None]):
    """A trace capture of `pid` over `streams` (loader/trace_stream.py) that lasts while `action` runs: it
    starts, `action` runs once every stream is read, then it stops."""
    from rankscope.agent.trace_capture import capture

    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        capturing = pool.submit(capture, streams, [pid], 60, stop)
        try:
            wait_until(lambda: all(s.running for s in streams) or capturing.done(), 10, "the capture to start")
            action()
        finally:
            stop.set()
        return capturing.result(timeout=30)
