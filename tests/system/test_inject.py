"""Loading the CUPTI shim (and test libraries) into running processes that did not opt in, for real: ptrace on
live processes (root), the shim's USDT probes attached by the agent afterwards. No GPU: CUPTI's own set-up
fails without NVIDIA's driver (said once on the job's stderr), the shim's probes are there regardless.

The targets check from inside that they were put back exactly: tests/inject_target.c spins on values held
in registers (general and SSE), or blocks in read(2), which must restart as if nothing happened."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
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
from rankscope.agent.host.targets import Target, stat_fields
from rankscope.agent.inject.inject import InjectError, Injection, inject
from rankscope.agent.inject.loader import load_bias
from rankscope.agent.inject.shim import inject_shim
from rankscope.agent.inject.tracee import Tracee
from rankscope.agent.session import Session
from rankscope.agent.sources.gpu import GpuViews
from rankscope.agent.sources.probes.cupti import BATCH_PROBE, PROBE, PROVIDER, SHIM_LIBRARY, shim_path
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
    first = next(m for m in procfs.maps(pid) if SHIM_LIBRARY.match(m.name) and m.offset == 0)
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
        assert (done.loaded, done.result, done.library) == (True, 42, f"/memfd:{copy.name}")
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
    started = int(stat_fields(target.pid)[19])
    try:
        watched = Target(pid=target.pid, name="python", start_time=started, libraries={"libpython": "/x"})
        session._inject_shim(watched)  # CPU only: left alone
        assert shim_path(target.pid) is None and "maps no libcuda" in caplog.text
        session._inject_shim(Target(pid=target.pid, name="python", start_time=started, libraries={"cuda": "/y"}))
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
    with pytest.raises(InjectError, match="cannot read .*libjunk.so"):
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


class Container:
    """The target program in a mount namespace of its own whose /tmp is a fresh tmpfs, as a container's, after
    `setup` (shell) ran there as its root: what a tenant can plant before the agent comes."""

    def __init__(self, built: dict[str, Path], setup: str = "true"):
        folder = built["target"].parent  # under the host's /tmp: hidden from the process by its own /tmp
        self.proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                      f"mount --bind {folder} /mnt && mount -t tmpfs none /tmp && ({setup}) && "
                                      f"exec /mnt/target read"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        assert self.proc.stdout.readline().strip() == "ready"

    def ask(self, text: str) -> str:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _copy_folder(library: Path) -> str:
    """The folder of the process's /tmp where an agent copying `library` in would put it (one per content)."""
    return f"/tmp/rankscope-{hashlib.sha256(library.read_bytes()).hexdigest()[:16]}"


def test_a_library_the_container_cannot_see_is_loaded_from_the_process_s_own_memory(built):
    container = Container(built)
    try:
        assert not os.path.exists(procfs.host_path(container.pid, str(built["libok.so"])))
        placed = inject(container.pid, str(built["libok.so"]), "entry")
        assert (placed.library, placed.result) == ("/memfd:libok.so", 42)
        assert maps_library(container.pid, "/memfd:libok.so")
        assert container.ask("x") == "ok x"
        assert os.listdir(f"/proc/{container.pid}/root/tmp") == []  # nothing written into the container
    finally:
        container.close()


def test_a_container_s_symlinks_do_not_lead_the_agent_to_a_host_file(built, tmp_path):
    """The container plants, where a copying agent would write its temporary file, a symlink to an absolute
    path: resolved from the host, that is the host's file, which must stay as it was."""
    victim = tmp_path / "host-file"
    victim.write_text("the host's own\n")
    victim.chmod(0o600)
    folder = _copy_folder(built["libok.so"])
    container = Container(built, f"mkdir -p {folder} && ln -s {victim} {folder}/libok.so.{os.getpid()}.tmp")
    try:
        try:
            placed: Injection | InjectError = inject(container.pid, str(built["libok.so"]), "entry")
        except InjectError as e:
            placed = e
        assert victim.read_bytes() == b"the host's own\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600
        assert isinstance(placed, Injection) and placed.result == 42, placed
        assert container.ask("y") == "ok y"
    finally:
        container.close()


def test_a_copy_the_container_planted_is_not_loaded(built):
    """A file of the library's name already where a copying agent would look: another library (here one that
    cannot load) is not what the process gets."""
    folder = _copy_folder(built["libok.so"])
    container = Container(built, f"mkdir -p {folder} && cp /mnt/lib/libundefined.so {folder}/libok.so")
    try:
        placed = inject(container.pid, str(built["libok.so"]), "entry")
        assert (placed.loaded, placed.result, placed.library) == (True, 42, "/memfd:libok.so")
        assert not maps_library(container.pid, f"{folder}/libok.so")
    finally:
        container.close()


def test_a_reused_pid_is_not_injected(built, start):
    """The process watched is pinned by its start time: another one on its PID is left alone."""
    target = start(str(built["target"]), "read")
    started = int(stat_fields(target.pid)[19])
    with pytest.raises(InjectError, match="not the one watched"):
        inject(target.pid, str(built["libok.so"]), "entry", start_time=started + 1)
    assert not maps_library(target.pid, "libok.so") and target.ask("z") == "ok z"
    assert inject(target.pid, str(built["libok.so"]), "entry", start_time=started).result == 42


def test_the_session_loads_the_shim_only_where_inject_allow_says(start, caplog):
    target = start(sys.executable, "-c", PYTHON_TARGET)
    watched = Target(pid=target.pid, name="python", start_time=int(stat_fields(target.pid)[19]),
                     libraries={"cuda": "/y"})
    elsewhere = Session(inject_shim=True, inject_allow=("/no/such/cgroup/*", "0123456789abcdef*"))
    try:
        elsewhere._inject_shim(watched)
        assert shim_path(target.pid) is None and "that --inject-allow names" in caplog.text
    finally:
        elsewhere.close()
    cgroup = procfs.cgroup(target.pid).splitlines()[0].split(":", 2)[2]
    here = Session(inject_shim=True, inject_allow=(f"{cgroup[:-1]}*",))
    try:
        here._inject_shim(watched)
        assert shim_path(target.pid) is not None
    finally:
        here.close()
