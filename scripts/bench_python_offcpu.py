"""Cost of the off-CPU half of the CPython frame sampler, per context switch (not collected by pytest; root):

    .venv/bin/python scripts/bench_python_offcpu.py [--python 3.12] [--trips 20000] [--rounds 5] [--depth 1]
                                                  [--threads 0] [--cpu 0]

Two processes bounce a byte through two pipes, both pinned to one CPU, so that each round trip is exactly two
context switches, each a sleep (a switch-out that the sampler walks when watched) and a wake-up. Measured:
a C pair and a CPython pair (its loop `--depth` Python frames deep, with `--threads` extra Python threads
parked in the process, which the walk has to search past), in phases that alternate: no sampler loaded;
the sampler loaded (watching another process) with the pairs not watched; the CPython pair watched.
The cost per switch is the change of the median round trip, halved (a noisy figure on a busy machine).

The kernel's own accounting of the sched_switch program (BPF_ENABLE_STATS: run time and run count) gives
the exact cost inside the program: per run while nothing switching is watched, and the extra per watched
sleep (the walk at the switch-out plus the bookkeeping at the wake-up).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "system"))

from test_python_sampler import INTERPRETERS  # noqa: E402

from rankscope.agent.sources.python_sampler import PythonSampler

C_PAIR = r'''
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
int main(void) {
    int a[2], b[2]; char c = 0, line[64];
    if (pipe(a) || pipe(b)) return 1;
    if (fork() == 0) {
        close(a[1]); close(b[0]);  /* EOF when the parent is gone */
        for (;;) { if (read(a[0], &c, 1) != 1) return 0; write(b[1], &c, 1); }
    }
    printf("ready\n"); fflush(stdout);
    while (fgets(line, sizeof line, stdin)) {
        long n = atol(line); struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (long i = 0; i < n; i++) { write(a[1], &c, 1); read(b[0], &c, 1); }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        printf("%.1f\n", ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / n); fflush(stdout);
    }
    return 0;
}
'''

PY_PAIR = r'''
import os, sys, threading, time
depth, threads = int(sys.argv[1]), int(sys.argv[2])
a, b = os.pipe(), os.pipe()
def park(ev): ev.wait()
ev = threading.Event()
for _ in range(threads):
    threading.Thread(target=park, args=(ev,), daemon=True).start()
def nest(n, f):
    return nest(n - 1, f) if n > 1 else f()
def echo():
    while True:
        c = os.read(a[0], 1)
        if not c: return
        os.write(b[1], c)
def bounce(n):
    for _ in range(n):
        os.write(a[1], b"x")
        os.read(b[0], 1)
child = os.fork()
if child == 0:
    os.close(a[1]); os.close(b[0])  # EOF when the parent is gone
    nest(depth, echo)
    os._exit(0)
print("ready", child, flush=True)
for line in sys.stdin:
    n = int(line)
    t0 = time.perf_counter_ns()
    nest(depth, lambda: bounce(n))
    print(f"{(time.perf_counter_ns() - t0) / n:.1f}", flush=True)
'''

IDLE = 'import sys\nprint("ready", flush=True)\nsys.stdin.read()\n'


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _bpf(cmd: int, attr: ctypes.Array) -> int:
    r = _libc.syscall(321, cmd, attr, ctypes.sizeof(attr))
    if r < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return r


def enable_stats() -> int:
    """BPF_ENABLE_STATS (BPF_STATS_RUN_TIME): run time is counted while the returned fd is open."""
    return _bpf(32, ctypes.create_string_buffer(8))


def prog_stats(fd: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of a loaded program (BPF_OBJ_GET_INFO_BY_FD, struct bpf_prog_info)."""
    info = ctypes.create_string_buffer(256)
    attr = ctypes.create_string_buffer(16)
    struct.pack_into("<IIQ", attr, 0, fd, ctypes.sizeof(info), ctypes.addressof(info))
    _bpf(15, attr)
    return struct.unpack_from("<QQ", info, 192)


class Pair:
    def __init__(self, argv: list[str], cpu: int):
        self.p = subprocess.Popen(["taskset", "-c", str(cpu)] + argv, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        line = self.p.stdout.readline().split()
        assert line and line[0] == "ready", line
        self.pids = [self.p.pid] + [int(x) for x in line[1:]]

    def trip_ns(self, n: int) -> float:
        self.p.stdin.write(f"{n}\n")
        self.p.stdin.flush()
        return float(self.p.stdout.readline())

    def close(self) -> None:
        self.p.kill()
        self.p.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", default="3.12", choices=list(INTERPRETERS))
    ap.add_argument("--trips", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--cpu", type=int, default=0)
    args = ap.parse_args()
    exe = str(INTERPRETERS[args.python])
    tmp = Path(tempfile.mkdtemp(prefix="rankscope-offcpu-"))
    (tmp / "pair.c").write_text(C_PAIR)
    subprocess.run(["gcc", "-O2", "-o", str(tmp / "pair"), str(tmp / "pair.c")], check=True)
    (tmp / "pair.py").write_text(PY_PAIR)
    (tmp / "idle.py").write_text(IDLE)
    c = Pair([str(tmp / "pair")], args.cpu)
    py = Pair([exe, str(tmp / "pair.py"), str(args.depth), str(args.threads)], args.cpu)
    idle = subprocess.Popen([exe, str(tmp / "idle.py")], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    idle.stdout.readline()
    results: dict[str, list[float]] = {}

    def measure(phase: str) -> None:
        results.setdefault(f"C  {phase}", []).append(c.trip_ns(args.trips))
        results.setdefault(f"py {phase}", []).append(py.trip_ns(args.trips // 4))

    stats_fd = enable_stats()
    try:
        c.trip_ns(args.trips), py.trip_ns(args.trips // 4)  # warm up
        for _ in range(args.rounds):
            measure("no sampler")
            with PythonSampler() as sampler:
                sampler.attach(idle.pid)  # loads the programs (same layout)
                (prog,) = sampler._programs.values()
                switch_fd = prog.bpf.funcs[b"tracepoint__sched__sched_switch"].fd
                t0, n0 = prog_stats(switch_fd)
                measure("loaded, not watched")
                t1, n1 = prog_stats(switch_fd)
                per_run = (t1 - t0) / (n1 - n0)
                results.setdefault("prog ns per run, unwatched", []).append(per_run)
                for pid in py.pids:
                    sampler.attach(pid)
                sleeps0 = sampler.counters()["sleeps"]
                t0, n0 = prog_stats(switch_fd)
                results.setdefault("py watched", []).append(py.trip_ns(args.trips // 4))
                t1, n1 = prog_stats(switch_fd)
                sleeps = sampler.counters()["sleeps"] - sleeps0
                results.setdefault("sleeps per trip", []).append(sleeps / (args.trips // 4))
                results.setdefault("prog ns per watched sleep", []).append(
                    ((t1 - t0) - per_run * (n1 - n0)) / sleeps)
    finally:
        os.close(stats_fd)
        c.close(), py.close(), idle.kill()
    med = {k: statistics.median(v) for k, v in results.items()}
    for k, v in results.items():
        print(f"{k:28} median {med[k]:9.1f}  ({', '.join(f'{x:.0f}' for x in v)})")
    print(f"per context switch: unwatched C {(med['C  loaded, not watched'] - med['C  no sampler']) / 2:+.0f} ns, "
          f"unwatched CPython {(med['py loaded, not watched'] - med['py no sampler']) / 2:+.0f} ns, "
          f"watched CPython {(med['py watched'] - med['py no sampler']) / 2:+.0f} ns "
          f"({med['sleeps per trip']:.1f} watched sleeps per round trip)")
    print(f"inside the program: {med['prog ns per run, unwatched']:.0f} ns per run while nothing watched switches, "
          f"{med['prog ns per watched sleep']:+.0f} ns per watched sleep (walk + wake-up) "
          f"(depth {args.depth}, {args.threads} extra threads, CPython {args.python})")


if __name__ == "__main__":
    main()
