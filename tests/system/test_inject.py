"""Loading the CUPTI shim (and test libraries) into running processes that did not opt in, for real: ptrace on
live processes (root), the shim's USDT probes attached by the agent afterwards. No GPU: CUPTI's own set-up
fails without NVIDIA's driver (said once on the job's stderr), the shim's probes are there regardless.

The targets check from inside that they were put back exactly: tests/inject_target.c spins on values held
in registers (general and SSE), or blocks in read(2), which must restart as if nothing happened."""
from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import RANKSCOPE, maps_library, one_line_error, run, wait_until

from rankscope.agent.host import procfs
from rankscope.agent.host.symbols import sdt_probes
from rankscope.agent.host.targets import Target
from rankscope.agent.inject.inject import InjectError, Injection, inject
from rankscope.agent.inject.loader import load_bias
from rankscope.agent.inject.shim import inject_shim
from rankscope.agent.inject.tracee import Tracee
from rankscope.agent.session import Session
from rankscope.agent.sources.gpu import GpuViews
from rankscope.agent.sources.probes.cupti import BATCH_PROBE, PROBE, PROVIDER, shim_path
from rankscope.sim.job import start_job

TARGET_SOURCE = Path(__file__).parent.parent / "inject_target.c"
STOP_BOUND_S = 0.5  # the thread held per injection (~1 ms measured, scripts/bench inject); loaded-machine slack
PYTHON_TARGET = ("import sys, time\nprint('ready', flush=True)\nn = 0\n"
                 "while True:\n    n += sum(range(2000))\n    time.sleep(0.002)\n")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """tests/inject_target.c as the target program and as libraries to load: entry() returns 42; one kills
    its own process in its constructor, one sleeps there for 3 s, one needs a symbol defined nowhere; and a
    file that is no ELF at all."""
    out = tmp_path_factory.mktemp("inject")
    (out / "lib").mkdir()
    variants = {"target": [], "lib/libok.so": ["-shared", "-fPIC", "-DLIBRARY"],
                "lib/libexit.so": ["-shared", "-fPIC", "-DLIBRARY", "-DEXIT_IN_CONSTRUCTOR"],
                "lib/libslow.so": ["-shared", "-fPIC", "-DLIBRARY", "-DSLEEP_IN_CONSTRUCTOR=3"],
                "lib/libundefined.so": ["-shared", "-fPIC", "-DLIBRARY", "-DNEEDS_MISSING_SYMBOL"]}
    for name, flags in variants.items():
        subprocess.run(["gcc", "-O2", "-Wall", *flags, "-o", str(out / name), str(TARGET_SOURCE)], check=True)
    (out / "lib/libjunk.so").write_text("not an ELF file\n")
    return {name.removeprefix("lib/"): out / name for name in (*variants, "lib/libjunk.so")}


class Child:
    """A started process that prints "ready" first; its stdout read line by line."""

    def __init__(self, argv: list[str], **env: str):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **env})
        self.pid = self.proc.pid
        assert self.line() == "ready"

    def line(self) -> str:
        return self.proc.stdout.readline().strip()

    def ask(self, text: str) -> str:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        return self.line()

    def running(self) -> bool:
        return procfs.task_status(self.pid).get(self.pid, {}).get("State", "Z")[0] not in "ZX"


@pytest.fixture
def start() -> Iterator[Callable[..., Child]]:
    started: list[Child] = []

    def start(*argv: str) -> Child:
        started.append(Child(list(argv)))
        return started[-1]

    yield start
    for t in started:
        t.proc.kill()
        t.proc.wait()


def semaphore(pid: int, probe: str = PROBE) -> int:
    """The shim's semaphore of `probe` as the process has it now (raised while the agent is attached)."""
    path = shim_path(pid)
    first = next(m for m in procfs.maps(pid) if os.path.basename(m.path) == os.path.basename(path) and m.offset == 0)
    address = load_bias(path, first.start) + sdt_probes(path)[(PROVIDER, probe)].semaphore
    with procfs.ProcessMemory(pid) as mem:
        return int.from_bytes(mem.read(address, 2), "little")


def test_a_computing_thread_is_put_back_exactly(built, start):
    """The main thread is taken in the middle of its loop (outside libc: a safe point), dlopen and entry()
    run on it, and its registers, SSE ones included, are back: the loop goes on without noticing."""
    target = start(str(built["target"]), "spin")
    for i in range(5):  # five libraries, five interrupted points of the loop
        copy = built["libok.so"].with_name(f"libok{i}.so")
        shutil.copyfile(built["libok.so"], copy)
        done = inject(target.pid, str(copy), "entry")
        assert (done.loaded, done.result, done.library) == (True, 42, str(copy))
        assert 0 < done.stop_s < STOP_BOUND_S
        assert maps_library(target.pid, copy.name)
    assert target.running()
    target.proc.send_signal(signal.SIGUSR1)  # ends the loop
    out, _ = target.proc.communicate(timeout=30)
    assert out.startswith("stopped ") and target.proc.returncode == 0, out  # "corrupt ..." had a register changed


@pytest.mark.parametrize("mode", ["read", "epoll"])
def test_a_thread_blocked_in_a_system_call_restarts_it(built, start, mode):
    """read(2) restarts by itself after a stop; epoll_wait(2) would return EINTR, so it is made to run again."""
    target = start(str(built["target"]), mode)
    wait_until(lambda: procfs.task_status(target.pid)[target.pid]["State"].startswith("S"), 10, f"blocked in {mode}")
    done = inject(target.pid, str(built["libok.so"]), "entry")
    assert (done.loaded, done.result, done.tries) == (True, 42, 1)  # blocked: a safe point at the first try
    assert target.ask("after") == "ok after"  # no EINTR ("bad ..."), nothing lost


def test_plain_python_process_gets_the_shim_and_the_agent_attaches(start):
    target = start(sys.executable, "-c", PYTHON_TARGET)
    blocked = procfs.task_status(target.pid)[target.pid]["SigBlk"]
    done = inject_shim(target.pid)
    assert procfs.task_status(target.pid)[target.pid]["SigBlk"] == blocked  # the shim's threads block all, not it
    assert done.loaded and done.result == 0 and 0 < done.stop_s < STOP_BOUND_S
    assert shim_path(target.pid) is not None
    assert (PROVIDER, PROBE) in sdt_probes(shim_path(target.pid))  # its USDT probes are in the process
    assert semaphore(target.pid) == semaphore(target.pid, BATCH_PROBE) == 0  # no agent yet: nothing handed over
    views = GpuViews()
    try:
        assert views.watch(target.pid)  # the GPU source attaches to the late shim's probes
        assert semaphore(target.pid, BATCH_PROBE) > 0  # records in batches: one count per probe site
    finally:
        views.close()
    assert semaphore(target.pid, BATCH_PROBE) == 0
    again = inject_shim(target.pid)
    assert (again.loaded, again.stop_s) == (False, 0.0)  # already present: nothing done
    assert target.running()


def test_the_session_loads_the_shim_only_into_processes_that_run_cuda(start, caplog):
    target = start(sys.executable, "-c", PYTHON_TARGET)
    session = Session(inject_shim=True)
    try:
        watched = Target(pid=target.pid, name="python", start_time=0, libraries={"libpython": "/x"})
        session._inject_shim(watched)  # CPU only: left alone
        assert shim_path(target.pid) is None and "maps no libcuda" in caplog.text
        session._inject_shim(Target(pid=target.pid, name="python", start_time=0, libraries={"cuda": "/y"}))
        assert shim_path(target.pid) is not None
    finally:
        session.close()


def _median_step(ends: list[float]) -> float:
    return statistics.median(b - a for a, b in zip(ends, ends[1:]))


def test_a_simulated_rank_gets_the_shim_from_diagnose_and_keeps_its_step_time(tmp_path):
    truth = tmp_path / "truth"
    truth.mkdir()
    job = start_job(1, truth_dir=truth)
    log = truth / "r0.json"

    def steps_since(t: float, count: int) -> list[float] | None:
        ends = [e for e in json.loads(log.read_text())["ends"] if e > t] if log.exists() else []
        return ends if len(ends) >= count else None

    try:
        before = wait_until(lambda: steps_since(0, 20), 60, "20 steps before")
        result = subprocess.run([*RANKSCOPE, "diagnose", "--pid", str(job.pids[0]), "--duration", "1",
                                 "--inject-shim", "--json"], capture_output=True, text=True, timeout=180)
        assert result.returncode == 0, result.stderr
        assert f"pid {job.pids[0]}: CUPTI shim loaded" in result.stderr and shim_path(job.pids[0]) is not None
        assert [r["state"] for r in json.loads(result.stdout)["ranks"]] == ["running"]
        done = time.time()
        after = wait_until(lambda: steps_since(done, 20), 60, "20 steps after")
        assert job.alive()
        # The job's own step log: the same pace after (a loose bound: the machine may be busy).
        assert _median_step(after) < 2 * _median_step(before) + 0.02, (_median_step(before), _median_step(after))
        assert not inject_shim(job.pids[0]).loaded  # a second injection: already present
    finally:
        job.stop()


def test_failed_injections_leave_the_target_running(built, start):
    target = start(str(built["target"]), "read")
    with pytest.raises(InjectError, match="no such library"):
        inject(target.pid, str(built["libok.so"].with_name("libmissing.so")), "entry")
    with pytest.raises(InjectError, match="exports no function nothere"):
        inject(target.pid, str(built["libok.so"]), "nothere")
    with pytest.raises(InjectError, match="cannot read symbols of .*libjunk.so"):
        inject(target.pid, str(built["libjunk.so"]), "entry")
    with pytest.raises(InjectError, match="could not load .*libundefined.so: .*undefined symbol: rankscope_no_such"):
        inject(target.pid, str(built["libundefined.so"]), "entry")  # dlopen returns NULL: dlerror's reason
    assert target.ask("after a failed dlopen") == "ok after a failed dlopen"
    t = time.monotonic()
    with pytest.raises(InjectError, match="did not return in time"):
        inject(target.pid, str(built["libslow.so"]), "entry", timeout_s=0.3)
    assert time.monotonic() - t < 2.5  # bounded: the deadline, then the thread is put back
    assert target.ask("after slow") == "ok after slow"
    assert not maps_library(target.pid, "libundefined.so") and target.running()


def test_a_process_that_exits_mid_injection_is_let_go(built, start):
    target = start(str(built["target"]), "read")
    with pytest.raises(InjectError, match="exited during the injection"):
        inject(target.pid, str(built["libexit.so"]), "entry")  # its constructor kills its process inside dlopen
    wait_until(lambda: target.proc.poll() is not None or not target.running(), 10, "the process to be gone")


def test_refusals_touch_nothing(built, start):
    target = start(str(built["target"]), "read")
    debugger = Tracee(target.pid, target.pid)  # another tracer holds it
    try:
        with pytest.raises(InjectError, match="already traced by pid"):
            inject(target.pid, str(built["libok.so"]), "entry")
    finally:
        assert debugger.interrupt(time.monotonic() + 10)  # a tracer lets a thread go from a stop
        debugger.release()
    assert target.ask("untouched") == "ok untouched" and not maps_library(target.pid, "libok.so")
    assert "needs root" in one_line_error(run("diagnose", "--pid", str(target.pid), "--inject-shim", user=65534))
    opted_in = Child([str(built["target"]), "read"], CUDA_INJECTION64_PATH="/opt/nsight/libinjection.so")
    try:  # CUDA will load what the job named at cuInit: the shim is not brought in beside it
        with pytest.raises(InjectError, match="names /opt/nsight/libinjection.so in CUDA_INJECTION64_PATH"):
            inject_shim(opted_in.pid)
        assert shim_path(opted_in.pid) is None
    finally:
        opted_in.proc.kill()
        opted_in.proc.wait()


def test_a_library_the_container_cannot_see_is_copied_into_its_tmp(built, tmp_path):
    """The target's mount namespace hides the library's folder under a tmpfs: the copy goes to its /tmp."""
    lib = built["libok.so"].parent
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                             f"mount -t tmpfs none {lib} && exec {built['target']} read"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    placed: Injection | None = None
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert not os.path.exists(procfs.host_path(proc.pid, str(built["libok.so"])))
        placed = inject(proc.pid, str(built["libok.so"]), "entry")
        assert placed.library.startswith("/tmp/rankscope-") and placed.library.endswith("/libok.so")
        assert placed.result == 42 and maps_library(proc.pid, placed.library)
        proc.stdin.write("x\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "ok x"
    finally:
        proc.kill()
        proc.wait()
        if placed is not None:
            shutil.rmtree(os.path.dirname(placed.library), ignore_errors=True)  # the host's /tmp here
