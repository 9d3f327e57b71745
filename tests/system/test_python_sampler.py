"""The CPython frame sampler on real interpreters: every supported layout, a pid namespace, threads, deep
stacks, time off CPU, and interpreters it must refuse. Real eBPF: needs root.

Every target prints a line when it is ready and runs until killed; the only waiting on the clock is the
measurement window, which ends as soon as enough samples are in (or, for time off CPU, after a second).
"""
from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rankscope.agent.host.procfs import ProcessMemory
from rankscope.agent.interpreters import NATIVE_THREAD, SPECIAL_FRAMES, TRUNCATED, Frame
from rankscope.agent.interpreters.cpython import layouts, process
from rankscope.agent.sources.python_sampler import PythonSampler, StackTime, UnsupportedInterpreter

PYENV = Path.home() / ".pyenv" / "versions"
INTERPRETERS = {
    "3.10": PYENV / "3.10.13" / "bin" / "python3.10",
    "3.11": PYENV / "3.11.7" / "bin" / "python3.11",
    "3.12": PYENV / "3.12.1" / "bin" / "python3.12",
    "3.13": PYENV / "3.13.0" / "bin" / "python3.13",
    "debian-3.11": Path("/usr/bin/python3.11"),  # static, non-PIE, stripped of .symtab
}
FREQUENCY = 199  # Hz: more samples per second of test than the default 49
MIN_SAMPLES = 300  # hot_a's share then has a standard error of ~2.6 points

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="eBPF and /proc/PID/mem need root")

# A known call tree: <module> -> main -> outer -> hot_a (70 % of the work) or hot_b (30 %), chosen at
# random per ~1 ms chunk so that no rhythm of the program can beat with the sampling clock.
TARGET = r'''
import hashlib, random, sys, threading

def hot_a(n):
    x = 0
    for i in range(n):
        x += i
    return x

def hot_b(n):
    x = 0
    for i in range(n):
        x += i
    return x

def outer(rng):
    if rng.random() < 0.7:
        hot_a(20000)
    else:
        hot_b(20000)

def crunch(buf):
    return hashlib.sha256(buf).digest()  # runs without the GIL

def worker():
    buf = b"x" * (8 << 20)
    while True:
        crunch(buf)

def deep(n):
    if n:
        return deep(n - 1)
    while True:
        hot_a(20000)

def main(mode):
    rng = random.Random(1)
    outer(rng)
    if mode == "threads":
        threading.Thread(target=worker, name="worker", daemon=True).start()
    print("ready", sys.version.split()[0], flush=True)
    if mode == "deep":
        deep(100)
    while True:
        outer(rng)

main(sys.argv[1] if len(sys.argv) > 1 else "split")
'''


def interpreter(name: str) -> Path:
    path = INTERPRETERS[name]
    if not path.exists():
        pytest.skip(f"{path} is not installed")
    return path


@pytest.fixture(scope="module")
def sampler() -> Iterator[PythonSampler]:
    s = PythonSampler(frequency=FREQUENCY)
    yield s
    s.close()


def start(procs: list, argv: list[str]) -> tuple[subprocess.Popen, str]:
    """Start argv and wait for its readiness line; returns the process and the rest of that line."""
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    procs.append(p)
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    if not sel.select(timeout=20):
        raise AssertionError(f"{argv} did not get ready in 20 s")
    line = p.stdout.readline().decode().split()
    assert line and line[0] == "ready", f"{argv} printed {line!r} instead of ready (exit {p.poll()})"
    return p, " ".join(line[1:])


def target_script(tmp_path: Path) -> Path:
    path = tmp_path / "target.py"
    path.write_text(TARGET)
    return path


def collect(sampler: PythonSampler, pid: int, min_samples: int = MIN_SAMPLES, limit: float = 8.0):
    """On-CPU samples of `pid` until there are `min_samples` (a measurement window, not a synchronisation)."""
    sampler.read()  # start from now
    counts: dict[tuple[Frame, ...], int] = {}
    deadline = time.monotonic() + limit
    while sum(counts.values()) < min_samples and time.monotonic() < deadline:
        time.sleep(0.2)
        for stack, t in sampler.read().get(pid, {}).items():
            assert isinstance(t, StackTime)
            if t.samples:
                counts[stack] = counts.get(stack, 0) + t.samples
    assert sum(counts.values()) >= min_samples // 2, f"only {sum(counts.values())} samples of pid {pid}"
    return counts


def names(stack: tuple[Frame, ...]) -> list[str]:
    return [f.qualname for f in stack]


def python_share(counts) -> float:
    total = sum(counts.values())
    return sum(n for s, n in counts.items() if not SPECIAL_FRAMES.intersection(s)) / total


def check_split(counts, script: Path) -> None:
    total = sum(counts.values())
    top = max(counts, key=counts.get)
    assert names(top) == ["<module>", "main", "outer", "hot_a"], f"top stack {names(top)}"
    assert all(f.filename == str(script) for f in top)
    assert [f.firstlineno for f in top][-1] == TARGET.splitlines().index("def hot_a(n):") + 1
    a = sum(n for s, n in counts.items() if names(s)[-1:] == ["hot_a"])
    b = sum(n for s, n in counts.items() if names(s)[-1:] == ["hot_b"])
    assert a + b > 0.85 * total, f"hot_a + hot_b are only {(a + b) / total:.0%} of samples: {counts}"
    assert abs(a / (a + b) - 0.7) <= 0.12, f"hot_a {a} vs hot_b {b}: {a / (a + b):.0%}, expected 70 %"
    assert python_share(counts) >= 0.9, f"only {python_share(counts):.0%} of samples resolved: {counts}"


@needs_root
@pytest.mark.parametrize("name", list(INTERPRETERS))
def test_call_tree_and_shares(sampler, procs, tmp_path, name):
    script = target_script(tmp_path)
    p, version = start(procs, [str(interpreter(name)), str(script)])
    assert sampler.attach(p.pid) == version
    try:
        counts = collect(sampler, p.pid)
    finally:
        sampler.detach(p.pid)
    check_split(counts, script)


@needs_root
def test_process_in_its_own_pid_namespace(sampler, procs, tmp_path):
    """The interpreter knows its threads by their ids in its own pid namespace (here: 1)."""
    if not shutil.which("unshare"):
        pytest.skip("no unshare")
    script = target_script(tmp_path)
    outer, _ = start(procs, ["unshare", "--pid", "--fork", "--mount-proc", str(interpreter("debian-3.11")),
                             str(script)])
    with open(f"/proc/{outer.pid}/task/{outer.pid}/children") as f:
        (inner,) = (int(x) for x in f.read().split())
    with open(f"/proc/{inner}/status") as f:
        nspid = next(line.split()[1:] for line in f if line.startswith("NSpid:"))
    assert nspid == [str(inner), "1"], nspid
    sampler.attach(inner)
    try:
        counts = collect(sampler, inner)
    finally:
        sampler.detach(inner)
        os.kill(inner, signal.SIGKILL)
    assert counts.get((NATIVE_THREAD,), 0) < 0.05 * sum(counts.values())
    check_split(counts, script)


@needs_root
@pytest.mark.parametrize("name", ["3.10", "3.13"])
def test_each_thread_gets_its_own_stack(sampler, procs, tmp_path, name):
    """A thread hashing without the GIL is seen in its own function, not in the GIL holder's."""
    script = target_script(tmp_path)
    p, _ = start(procs, [str(interpreter(name)), str(script), "threads"])
    sampler.attach(p.pid)
    try:
        counts = collect(sampler, p.pid)
    finally:
        sampler.detach(p.pid)
    total = sum(counts.values())
    by_leaf: dict[str, int] = {}
    for s, n in counts.items():
        by_leaf[names(s)[-1]] = by_leaf.get(names(s)[-1], 0) + n
    worker = next((s for s in counts if names(s)[-1] == "crunch"), None)
    assert worker is not None and names(worker)[-2:] == ["worker", "crunch"], counts
    assert by_leaf.get("crunch", 0) >= 0.1 * total, by_leaf
    assert by_leaf.get("crunch", 0) + by_leaf.get("hot_a", 0) + by_leaf.get("hot_b", 0) >= 0.85 * total, by_leaf


@needs_root
def test_deep_stack_is_cut_at_max_depth_keeping_the_innermost(sampler, procs, tmp_path):
    script = target_script(tmp_path)
    p, _ = start(procs, [str(interpreter("3.12")), str(script), "deep"])
    sampler.attach(p.pid)
    try:
        counts = collect(sampler, p.pid, min_samples=100)
    finally:
        sampler.detach(p.pid)
    top = max(counts, key=counts.get)
    assert top[0] == TRUNCATED
    assert len(top) == sampler.max_depth + 1
    assert names(top)[-2:] == ["deep", "hot_a"] and set(names(top)[1:-1]) == {"deep"}


@needs_root
def test_the_largest_max_depth_builds_and_keeps_whole_stacks(procs, tmp_path):
    """127 code objects per stack: its scratch is zeroed in pieces (clang makes one memset of over 1 KiB a
    call, which BPF lacks, and LLVM then ends the whole process)."""
    p, _ = start(procs, [str(interpreter("3.12")), str(target_script(tmp_path)), "deep"])
    with PythonSampler(frequency=FREQUENCY, max_depth=127) as deep_sampler:
        deep_sampler.attach(p.pid)
        counts = collect(deep_sampler, p.pid, min_samples=50)
    top = max(counts, key=counts.get)
    assert names(top) == ["<module>", "main"] + ["deep"] * 101 + ["hot_a"]


# -- time off CPU ---------------------------------------------------------------------------------------------

# The main thread alternates 20 ms asleep in sleepy() and 5 ms on CPU in busy(); a "loader" thread is blocked
# in wait_for_batch() on an empty queue from before the process is watched to the end.
OFFCPU_TARGET = r'''
import queue, sys, threading, time

def sleepy():
    time.sleep(0.02)

def busy():
    end = time.perf_counter() + 0.005
    while time.perf_counter() < end:
        pass

def wait_for_batch(q):
    return q.get()

def main():
    q = queue.Queue()
    threading.Thread(target=wait_for_batch, args=(q,), name="loader", daemon=True).start()
    while not q.not_empty._waiters:  # until the loader is in Condition.wait, about to block on its lock
        pass
    print("ready", sys.version.split()[0], flush=True)
    while True:
        sleepy()
        busy()

main()
'''
OFFCPU_WINDOW = 1.0  # seconds: 40 sleepy/busy rounds


def collect_time(sampler: PythonSampler, pid: int, seconds: float = OFFCPU_WINDOW, reads: int = 4):
    """Stack times of `pid` over `seconds`, summed over `reads` reads, and the wall time they cover (from
    the start of the first read to the start of the last: each read counts sleeps up to its start)."""
    times: dict[tuple[Frame, ...], StackTime] = {}
    t0 = time.monotonic()
    sampler.read()  # start from now
    for _ in range(reads):
        time.sleep(seconds / reads)  # the measurement window
        t1 = time.monotonic()
        for stack, t in sampler.read().get(pid, {}).items():
            old = times.get(stack, StackTime())
            times[stack] = StackTime(old.samples + t.samples, old.off_cpu_s + t.off_cpu_s)
    return times, t1 - t0


@needs_root
@pytest.mark.parametrize("name", list(INTERPRETERS))
def test_off_cpu_time_goes_to_the_stack_that_slept(sampler, procs, tmp_path, name):
    script = tmp_path / "offcpu.py"
    script.write_text(OFFCPU_TARGET)
    p, _ = start(procs, [str(interpreter(name)), str(script)])
    sampler.attach(p.pid)
    try:
        times, wall = collect_time(sampler, p.pid)
    finally:
        sampler.detach(p.pid)

    def where(leaf: list[str]):
        return [t for s, t in times.items() if [n.rsplit(".", 1)[-1] for n in names(s)[-len(leaf):]] == leaf]

    sleepy = where(["main", "sleepy"])
    busy = where(["main", "busy"])
    assert all(f.filename == str(script) for s in times for f in s if f.qualname in ("sleepy", "busy"))
    slept = sum(t.off_cpu_s for t in sleepy)
    assert slept >= 0.7 * wall, f"sleepy: {slept:.3f} s off CPU in {wall:.3f} s: {times}"
    assert sum(t.off_cpu_s for t in busy) <= 0.02 * wall, times
    samples = sum(t.samples for t in times.values())
    assert samples >= 15, times
    assert sum(t.samples for t in busy) >= 0.75 * samples, f"on-CPU samples not mostly in busy: {times}"

    # Blocked since before the attach: found from user space, then counted up to every read.
    loader = where(["wait_for_batch", "get", "wait"])
    assert len(loader) == 1, times
    assert 0.9 * wall <= loader[0].off_cpu_s <= 1.1 * wall, f"{loader[0]} in {wall:.3f} s"
    assert loader[0].samples == 0
    total_off = sum(t.off_cpu_s for t in times.values())
    assert total_off <= 2.05 * wall, f"two threads, {total_off:.3f} s off CPU in {wall:.3f} s"


@needs_root
def test_detached_process_is_no_longer_sampled(sampler, procs, tmp_path):
    script = tmp_path / "offcpu.py"
    script.write_text(OFFCPU_TARGET)
    p, _ = start(procs, [str(interpreter("3.12")), str(script)])
    sampler.attach(p.pid)
    time.sleep(0.1)  # a window with samples and sleeps
    sampler.detach(p.pid)
    sampler.read()
    time.sleep(0.3)  # a window in which samples would have been taken
    assert p.pid not in sampler.read()
    (prog,) = (prog for prog in sampler._programs.values() if prog.layout.version == (3, 12))
    assert all(v.stack.pid != p.pid for v in prog.bpf["py_sleeping"].values())


# -- refusals -------------------------------------------------------------------------------------------------

PY2_TARGET = 'import sys\nsys.stdout.write("ready\\n")\nsys.stdout.flush()\nsys.stdin.read()\n'


@needs_root
@pytest.mark.parametrize("version", ["2.7.18", "3.9.18"])
def test_old_cpython_is_refused(procs, tmp_path, version):
    exe = PYENV / version / "bin" / f"python{version.rsplit('.', 1)[0]}"
    if not exe.exists():
        pytest.skip(f"{exe} is not installed")
    script = tmp_path / "idle.py"
    script.write_text(PY2_TARGET)
    p, _ = start(procs, [str(exe), str(script)])
    with pytest.raises(UnsupportedInterpreter, match=rf"CPython {version.rsplit('.', 1)[0]}, which is not supported"):
        process.inspect(p.pid)


@needs_root
def test_a_process_that_is_not_python_is_refused(procs):
    p = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    procs.append(p)  # Popen returns once cat has been exec'd
    with pytest.raises(UnsupportedInterpreter, match="runs no CPython interpreter: no _PyRuntime"):
        process.inspect(p.pid)


FAKE = r'''
#include <stdio.h>
#include <string.h>
#include <unistd.h>
char _PyRuntime[65536];
const unsigned long Py_Version = VERSION_HEX;
int PyAIter_Check(void *o) { return 0; }
int main(void) {
    memset(_PyRuntime, 0x41, sizeof _PyRuntime);
    puts("ready"); fflush(stdout);
    char c; return (int)read(0, &c, 1);
}
'''


@needs_root
@pytest.mark.parametrize(
    "hexversion,message",
    [
        (0x030C01F0, r"3\.12\.1.*offsets from table\): the layout does not verify"),
        (0x030D00F0, r"does not start with the xdebugpy cookie"),
        (0x030900F0, r"CPython 3\.9\.0, which is not supported"),
    ],
)
def test_odd_binary_claiming_to_be_cpython_is_refused(procs, tmp_path, hexversion, message):
    if not shutil.which("gcc"):
        pytest.skip("no gcc")
    src, exe = tmp_path / "fake.c", tmp_path / "fake-interpreter"
    src.write_text(FAKE)
    subprocess.run(["gcc", "-O0", "-rdynamic", f"-DVERSION_HEX={hexversion:#x}UL", "-o", str(exe), str(src)],
                   check=True)
    p, _ = start(procs, [str(exe)])
    with pytest.raises(UnsupportedInterpreter, match=message):
        process.inspect(p.pid)


@needs_root
def test_a_wrong_layout_does_not_verify(procs, tmp_path):
    """The live checks catch another version's offsets (here 3.12's on a 3.11 process)."""
    p, _ = start(procs, [str(interpreter("3.11")), str(target_script(tmp_path))])
    found = process.inspect(p.pid)
    assert found.layout.source == "table" and found.layout.version == (3, 11)
    mem = ProcessMemory(p.pid)
    try:
        with pytest.raises(UnsupportedInterpreter, match="does not verify"):
            process.verify(mem, p.pid, found.runtime, layouts.TABLE[(3, 12)], found.version)
    finally:
        mem.close()


@needs_root
def test_313_offsets_come_from_the_interpreter_itself(procs, tmp_path):
    p, _ = start(procs, [str(interpreter("3.13")), str(target_script(tmp_path))])
    found = process.inspect(p.pid)
    assert found.layout.source == "_Py_DebugOffsets"
    table = layouts.TABLE[(3, 13)]
    assert [found.layout.runtime_interp_head, found.layout.interp_tstate_head, found.layout.tstate_frame] == [
        table.runtime_interp_head, table.interp_tstate_head, table.tstate_frame]


# -- _Py_DebugOffsets variants (no process needed) ----------------------------------------------------------


def _debug_blob(minor: int, variant: str, free_threaded: int = 0) -> tuple[bytes, dict[str, int]]:
    """A _Py_DebugOffsets image of one variant: each field at 8 x its place in its section, invariants kept."""
    layout = layouts._DEBUG_LAYOUTS[(3, minor)][variant]
    values: dict[str, int] = {"version": (3 << 24) | (minor << 16) | 0xF0, "free_threaded": free_threaded}
    for sec, fs in layout[1:]:
        sec_values = {f"{sec}.{f}": layouts._DEBUG_INVARIANTS.get(f"{sec}.{f}", 8 * i) for i, f in enumerate(fs)}
        sec_values[f"{sec}.size"] = 16 if sec == "pyobject" else max(sec_values.values()) + 8
        values.update(sec_values)
    names = [f"{sec}.{f}" if sec else f for sec, fs in layout for f in fs]
    return layouts.DEBUG_COOKIE + b"".join(values[n].to_bytes(8, "little") for n in names), values


@pytest.mark.parametrize("variant", list(layouts._DEBUG_LAYOUTS[(3, 14)]))
def test_314_debug_offsets_variants_are_told_apart(variant):
    raw, values = _debug_blob(14, variant)
    raw += bytes(layouts.debug_offsets_size(14) - len(raw))
    d = layouts.parse_debug_offsets(raw, 14)
    assert d["thread_state.native_thread_id"] == values["thread_state.native_thread_id"]
    layout = layouts.layout_from_debug_offsets(d, 14)
    assert layout.tstate_frame == values["thread_state.current_frame"]
    assert layout.code_qualname == values["code_object.qualname"]
    assert "-DPY_CODE_TAG_MASK=3" in layout.cflags() and layout.owner_skip_from == 3


def test_free_threaded_build_is_refused():
    raw, _ = _debug_blob(13, "3.13", free_threaded=1)
    with pytest.raises(UnsupportedInterpreter, match="free-threaded"):
        layouts.layout_from_debug_offsets(layouts.parse_debug_offsets(raw, 13), 13)


def test_debug_offsets_that_make_no_sense_are_refused():
    raw, _ = _debug_blob(13, "3.13")
    with pytest.raises(UnsupportedInterpreter, match="not understood"):
        layouts.parse_debug_offsets(raw[:8] + bytes(8) + raw[8:], 13)  # shifted by one field


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
