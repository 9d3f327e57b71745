"""Exact timing of Python functions on real interpreters (real eBPF, needs root): every supported CPython
here, calls that enter the eval loop from C, nesting, the user's --trace-function, and what is not timed.

Each target waits for a line on stdin, makes a known number of calls of known duration, prints "done" and
waits; the test reads the timer after "done", so counts are exact.
"""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import RANKSCOPE, diagnose_json, wait_until
from test_python_sampler import INTERPRETERS, interpreter, needs_root, start

from rankscope.agent.interpreters.cpython.process import inspect
from rankscope.agent.sources.python_exact import PythonTimer, TracedFunction

LOADS, LOAD_S = 12, 0.004  # data-loader batches, each this long
FORWARD_S, LAYER_S = 0.006, 0.002  # one forward per batch; it runs one layer's forward inside
WORKS, WORK_S = 25, 0.001  # calls of the user's function, through map()
PLAIN = 40  # a __next__ that is no data loader's, and a forward called directly from Python

TARGET = r'''
import sys, time

class Layer:
    def forward(self, x):
        time.sleep(LAYER_S)
        return x

class Net:
    def __init__(self):
        self.layer = Layer()
    def forward(self, x):
        time.sleep(FORWARD_S - LAYER_S)
        return list(map(self.layer.forward, [x]))[0]  # nested: a timed call inside a timed call
    def __call__(self, x):
        return self.forward(x)  # Python to Python: not an eval entry on 3.11+

class _ToyDataLoaderIter:
    def __init__(self, n):
        self.n = n
    def __iter__(self):
        return self
    def __next__(self):
        if self.n == 0:
            raise StopIteration  # the last call: it raises, and counts as a call
        self.n -= 1
        time.sleep(LOAD_S)
        return self.n

class Countdown:  # an iterator, but no data loader: its __next__ is not timed
    def __init__(self, n):
        self.n = n
    def __iter__(self):
        return self
    def __next__(self):
        if self.n == 0:
            raise StopIteration
        self.n -= 1
        return self.n

def work(x):
    time.sleep(WORK_S)
    return x

def main():
    print("ready", flush=True)
    sys.stdin.readline()
    net = Net()
    for batch in _ToyDataLoaderIter(LOADS):
        list(map(net.forward, [batch]))
    sum(Countdown(PLAIN))
    list(map(work, range(WORKS)))
    print("done", flush=True)
    sys.stdin.readline()

main()
'''


def target(tmp_path: Path) -> Path:
    path = tmp_path / "toy.py"
    consts = {"LOADS": LOADS, "LOAD_S": LOAD_S, "FORWARD_S": FORWARD_S, "LAYER_S": LAYER_S, "WORKS": WORKS,
              "WORK_S": WORK_S, "PLAIN": PLAIN}
    path.write_text("".join(f"{k} = {v!r}\n" for k, v in consts.items()) + TARGET)
    return path


@pytest.fixture(scope="module")
def timer() -> Iterator[PythonTimer]:
    t = PythonTimer([TracedFunction.parse("toy:work")])
    yield t
    t.close()


def run_calls(p: subprocess.Popen) -> None:
    p.stdin.write(b"go\n")
    line = p.stdout.readline().decode().strip()
    assert line == "done", f"target printed {line!r} (exit {p.poll()})"


@needs_root
@pytest.mark.parametrize("name", list(INTERPRETERS))
def test_counts_and_durations_are_exact(timer, procs, tmp_path, name):
    p, _ = start(procs, [str(interpreter(name)), str(target(tmp_path))])
    interp = inspect(p.pid)
    timer.attach(interp)
    try:
        run_calls(p)
        rows = {r.name: r for r in timer.read()[p.pid]}
    finally:
        timer.detach(p.pid)
    qual = interp.layout.code_qualname is not None  # 3.10 code objects have no qualified name
    expect = {  # name -> (calls, seconds each)
        "toy.py:" + ("Net.forward" if qual else "forward"): (LOADS, FORWARD_S),
        "toy.py:work": (WORKS, WORK_S),
    }
    if qual:  # 3.10: __next__ of a data loader is recognised by its qualified name or its file only
        expect["toy.py:_ToyDataLoaderIter.__next__"] = (LOADS + 1, LOAD_S * LOADS / (LOADS + 1))
        expect["toy.py:Layer.forward"] = (LOADS, LAYER_S)
    else:  # both forwards share the name "forward": one row, both counted
        expect["toy.py:forward"] = (2 * LOADS, (FORWARD_S + LAYER_S) / 2)
    assert set(rows) == set(expect), rows
    for fn, (calls, each) in expect.items():
        r = rows[fn]
        assert r.count == calls, r
        # sleep() never returns early; scheduling may add a little
        assert calls * each <= r.total_s <= calls * each * 1.5 + 0.01, r
        assert each <= r.max_s <= 2 * r.total_s, r
    assert timer.counters()["too_deep"] == 0


@needs_root
def test_detached_process_is_no_longer_timed(timer, procs, tmp_path):
    from rankscope.agent.host.symbols import code_byte

    p, _ = start(procs, [str(interpreter("3.12")), str(target(tmp_path))])
    timer.attach(inspect(p.pid))
    assert code_byte(p.pid, "libpython3.12.so.1.0", "_PyEval_EvalFrameDefault") == 0xCC
    timer.detach(p.pid)
    assert code_byte(p.pid, "libpython3.12.so.1.0", "_PyEval_EvalFrameDefault") != 0xCC
    run_calls(p)
    assert p.pid not in timer.read()


@pytest.mark.parametrize("text", ["work", "toy:", ":work", "toy:work()", "to y:work", "toy:a..b"])
def test_a_bad_traced_function_is_refused(text):
    with pytest.raises(ValueError, match="module:qualname"):
        TracedFunction.parse(text)
    out = subprocess.run([*RANKSCOPE, "diagnose", "--pid", "1", "--trace-function", text],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--trace-function" in out.stderr, out.stderr


def test_traced_functions_are_matched_by_module_and_qualname():
    from rankscope.agent.interpreters import Frame

    t = TracedFunction.parse("pkg.data:Loader.fetch")
    assert t.matches(Frame("Loader.fetch", "/srv/pkg/data.py", 3), has_qualname=True)
    assert t.matches(Frame("fetch", "/srv/pkg/data.py", 3), has_qualname=False)  # 3.10
    assert not t.matches(Frame("Loader.fetch", "/srv/pkg/other.py", 3), has_qualname=True)
    assert not t.matches(Frame("Other.fetch", "/srv/pkg/data.py", 3), has_qualname=True)
    assert TracedFunction.parse("pkg.data:f").matches(Frame("f", "/srv/pkg/data/__init__.py", 1), True)


@needs_root
def test_diagnose_names_the_traced_loader_of_an_input_straggler(sim_job):
    # Ranks under 3.10, where every call enters the eval loop: the sim's load_batch (a plain call) is seen.
    job = sim_job(4, faults=("input-stall:1:0.03",), python=str(interpreter("3.10")))
    doc = diagnose_json(job.pids, 3, "--trace-function", "rank:load_batch")
    (f,) = [f for f in doc["findings"] if f["kind"] == "input_straggler"]
    assert (f["ranks"], f["function"]) == ([1], "rank.py:load_batch"), doc["findings"]
    (ev,) = f["evidence"]["per_rank"]
    assert ev["timed_function"] == "rank.py:load_batch"
    (load,) = [r for r in ev["python_timed"] if r["function"] == "rank.py:load_batch"]
    assert load["count"] >= 20  # a step is ~80 ms with the stall
    assert load["mean_s"] == pytest.approx(0.03 + 0.004, abs=0.006)  # stall + the sim's own load time
    for rank in doc["ranks"]:
        (row,) = [r for r in rank["python_timed"] if r["function"] == "rank.py:load_batch"]
        assert row["mean_s"] >= (0.03 if rank["rank"] == 1 else 0.003), rank


GC_TARGET = r'''
import gc, sys

class Node:
    pass

print("ready", flush=True)
sys.stdin.readline()
gc.disable()  # only the collections below
live = [[Node() for _ in range(100)] for _ in range(2000)]  # a full collection traverses them
for _ in range(COLLECTIONS):
    for _ in range(1000):
        a, b = Node(), Node()
        a.b, b.a = b, a
    gc.collect()
print("done", flush=True)
sys.stdin.readline()
'''


def _gc_armed(pid: int, python: str) -> int:
    """The process's python:gc__start semaphore (non-zero: its GC probe sites run)."""
    from rankscope.agent.host.symbols import sdt_probes
    from rankscope.agent.sources.python_exact import GC_START

    with open(f"/proc/{pid}/mem", "rb") as mem:
        mem.seek(sdt_probes(python)[GC_START].semaphore)  # Debian's python3.11 is not PIE: no load bias
        return int.from_bytes(mem.read(2), "little")


@needs_root
def test_collections_of_a_stripped_interpreter_are_timed_through_usdt(timer, procs, tmp_path):
    script = tmp_path / "gc_target.py"
    script.write_text(f"COLLECTIONS = 7\n{GC_TARGET}")
    python = str(interpreter("debian-3.11"))  # no gc_collect_main symbol; python:gc__start/gc__done notes
    p, _ = start(procs, [python, str(script)])
    timer.attach(inspect(p.pid))
    try:
        assert _gc_armed(p.pid, python) == 1
        run_calls(p)
        gc_stats = timer.read_gc()[p.pid]
    finally:
        timer.detach(p.pid)
    assert _gc_armed(p.pid, python) == 0  # the process is left as it was found
    assert gc_stats.count == 7 and gc_stats.role == "gc"
    assert 0 < gc_stats.p50_s <= gc_stats.max_s <= gc_stats.total_s < 7 * 0.5, gc_stats


@needs_root
def test_a_killed_agent_leaves_the_gc_sites_disarmed(procs, tmp_path):
    """The kernel keeps the semaphore (the uprobes' reference counter): it goes down with the agent."""
    script = tmp_path / "gc_target.py"
    script.write_text(f"COLLECTIONS = 1\n{GC_TARGET}")
    python = str(interpreter("debian-3.11"))
    p, _ = start(procs, [python, str(script)])
    agent = subprocess.Popen([sys.executable, "-c", "import sys; from rankscope.agent.interpreters.cpython.process import "
                              "inspect; from rankscope.agent.sources.python_exact import PythonTimer; "
                              f"PythonTimer().attach(inspect({p.pid})); print('up', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs.append(agent)
    assert agent.stdout.readline().strip() == "up"
    assert _gc_armed(p.pid, python) == 1
    agent.kill()
    agent.wait()
    wait_until(lambda: _gc_armed(p.pid, python) == 0, 5, "the kernel to lower the semaphore")


@needs_root
def test_gc_storm_on_debian_python_is_python_gc(sim_job):
    job = sim_job(4, faults=("gc:2",), python=str(interpreter("debian-3.11")))
    doc = diagnose_json(job.pids, 3)
    (f,) = [f for f in doc["findings"] if f["kind"] == "python_gc"]
    assert (f["ranks"], f["function"], f["component"]) == ([2], "gc__start", "python"), doc["findings"]


BUSY = r'''
def f(x):
    return x

print("ready", flush=True)
while True:
    for _ in map(f, range(100000)):
        pass
'''


QUIET = 'import sys; print("ready", flush=True); sys.stdin.read()'


@needs_root
def test_a_process_entering_eval_too_often_stops_being_probed_with_its_peers(timer, procs, tmp_path):
    """A rank too hot to time takes its job's other ranks with it (timed beside untimed ones, they would look
    slower by the probes' cost); another job's process stays timed."""
    import ctypes

    from rankscope.agent.host.symbols import code_byte

    script = tmp_path / "busy.py"
    script.write_text(BUSY)
    python = str(interpreter("3.12"))
    busy, _ = start(procs, [python, str(script)])
    peer, _ = start(procs, [python, "-c", QUIET])
    other, _ = start(procs, [python, "-c", QUIET])
    late, _ = start(procs, [python, "-c", QUIET])
    timer.attach(inspect(busy.pid), "job-a")
    timer.attach(inspect(peer.pid), "job-a")
    timer.attach(inspect(other.pid), "job-b")
    probed = lambda p: code_byte(p.pid, "libpython3.12.so.1.0", "_PyEval_EvalFrameDefault") == 0xCC  # noqa: E731
    try:
        entries = lambda: timer.bpf["pyx_targets"][ctypes.c_uint32(busy.pid)].entries  # noqa: E731
        wait_until(lambda: entries() > 1000, 10, "the busy loop to enter eval")
        assert probed(busy) and probed(peer) and probed(other)
        # Each read judges the rate since the previous one: the loop's (~100,000/s idle, over 20,000/s on a
        # loaded machine) trips it at the first read that follows enough entries.
        wait_until(lambda: timer.read() is not None and not probed(busy), 10, "the busy process to be unprobed")
        assert (probed(peer), probed(other)) == (False, True)
        timer.attach(inspect(late.pid), "job-a")  # a rank of job-a watched later is not timed either
        assert not probed(late)
        # Each of job-a's ranks says why (its pattern's python_untimed, the document's rank entry).
        why = timer.untimed(busy.pid)
        assert why.startswith(f"pid {busy.pid} of its job entered the Python eval loop") and "times a second" in why
        assert timer.untimed(peer.pid) == timer.untimed(late.pid) == why and timer.untimed(other.pid) == ""
        # Once none of job-a is watched the job is gone: a restarted job-a (new processes) is timed afresh.
        for p in (busy, peer, late):
            timer.detach(p.pid)
        restarted, _ = start(procs, [python, "-c", QUIET])
        timer.attach(inspect(restarted.pid), "job-a")
        assert probed(restarted) and timer.untimed(restarted.pid) == ""
        timer.detach(restarted.pid)
    finally:
        for p in (busy, peer, other, late):
            timer.detach(p.pid)


@needs_root
def test_a_rank_that_cannot_be_timed_leaves_its_jobs_other_ranks_untimed(procs):
    """A rank whose interpreter could not be read (its frames neither) is not timed, so neither are its job's
    other ranks: timed alone, a healthy 2-rank MLP's rank 1 ran 7% longer on its CPU and was named a straggler
    (the matrix, 2026-11-28). Another job's process stays timed."""
    from rankscope.agent.detail import DEEP
    from rankscope.agent.host.symbols import code_byte
    from rankscope.agent.host.targets import Identity, Target
    from rankscope.agent.sources.python_exact import PythonTiming

    python = str(interpreter("3.12"))
    ranks = [start(procs, [python, "-c", QUIET])[0] for _ in range(3)]
    other, _ = start(procs, [python, "-c", QUIET])
    interps = {p.pid: inspect(p.pid) for p in (ranks[0], ranks[2], other)}  # ranks[1]'s could not be read

    class Sampler:  # the frame sampler's answer: the interpreter of each process it samples
        def interpreter(self, pid: int):
            return interps.get(pid)

    def target(p: subprocess.Popen, job: str, rank: int) -> Target:
        return Target(p.pid, "python", 0, identity=Identity(job, rank, 3, rank, "env"),
                      python_error=None if p.pid in interps else "cannot read _PyRuntime")

    timing = PythonTiming(Sampler(), (), DEEP)
    probed = lambda p: code_byte(p.pid, "libpython3.12.so.1.0", "_PyEval_EvalFrameDefault") == 0xCC  # noqa: E731
    try:
        timing.attach(target(ranks[0], "job-a", 0))
        timing.attach(target(other, "job-b", 0))
        assert probed(ranks[0]) and probed(other)
        timing.attach(target(ranks[1], "job-a", 1))
        timing.attach(target(ranks[2], "job-a", 2))  # watched later: not timed either
        assert (probed(ranks[0]), probed(ranks[2]), probed(other)) == (False, False, True)
        why = f"pid {ranks[1].pid} of its job cannot be timed: cannot read _PyRuntime"
        assert timing.timer.untimed(ranks[0].pid) == timing.timer.untimed(ranks[2].pid) == why
        assert timing.timer.untimed(other.pid) == ""
    finally:
        timing.close()


@needs_root
def test_functions_are_timed_only_while_switched_on(procs, tmp_path):
    """The agent's light mode leaves the eval loop alone (GC is still timed); deep mode probes it."""
    from rankscope.agent.host.symbols import code_byte

    p, _ = start(procs, [str(interpreter("3.12")), str(target(tmp_path))])
    t = PythonTimer()
    probed = lambda: code_byte(p.pid, "libpython3.12.so.1.0", "_PyEval_EvalFrameDefault") == 0xCC  # noqa: E731
    try:
        t.attach(inspect(p.pid))
        assert not probed()
        t.set_functions(True)
        assert probed()
        run_calls(p)
        assert {r.name for r in t.read()[p.pid]} >= {"toy.py:Net.forward", "toy.py:_ToyDataLoaderIter.__next__"}
        t.set_functions(False)
        assert not probed()
    finally:
        t.close()


@needs_root
def test_310_is_timed_only_on_request(procs, tmp_path):
    from rankscope.agent.host.symbols import code_byte

    p, _ = start(procs, [str(interpreter("3.10")), str(target(tmp_path))])
    t = PythonTimer()
    try:
        t.attach(inspect(p.pid))
        t.set_functions(True)  # refused, with a warning: every 3.10 call enters the eval loop
        assert code_byte(p.pid, "libpython3.10.so.1.0", "_PyEval_EvalFrameDefault") != 0xCC
    finally:
        t.close()
