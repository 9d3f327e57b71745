"""One-shot profile capture, as `rankscope profile` does it: the frame sampler alone on any CPython
processes (training processes or not: no uprobe is attached), for a window, then each process's stacks.

A process's rank is its RANK from the environment (torchrun's), else its place in the list given; the step
time is not known here (it comes from the collectives the agent probes), so a differential profile is per
second of the window.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rankscope.agent.host.targets import TargetError, environment, identity_from_env
from rankscope.agent.session import host_name
from rankscope.agent.sources.python_sampler import PythonAttachError, PythonSampler
from rankscope.agent.views.profile import RankProfile


def ranks_of(pids: list[int]) -> dict[int, tuple[str, int]]:
    """pid -> (job, rank): the launcher's identity where it set one, else ("local", place in the list)."""
    out = {}
    for i, pid in enumerate(pids):
        ident = identity_from_env(pid, environment(pid))
        out[pid] = (ident.job, ident.rank) if ident.source == "env" else ("local", i)
    return out


def capture(pids: list[int], duration: float, frequency: int,
            watching: Callable[[str], None] = lambda _: None) -> list[RankProfile]:
    """The profiles of `pids` over `duration` seconds (Ctrl-C ends early); TargetError for a process that
    cannot be sampled."""
    with sampled(pids, duration, frequency, watching) as profiles:
        return profiles


@contextmanager
def sampled(pids: list[int], duration: float, frequency: int,
            watching: Callable[[str], None] = lambda _: None) -> Iterator[list[RankProfile]]:
    """capture()'s profiles, the sampler still attached while the block runs: removing its tracepoint and
    perf events waits for the kernel (~0.1 s), so a command writes its answer first."""
    ranks = ranks_of(pids)
    host = host_name()
    with PythonSampler(frequency=frequency) as sampler:
        for pid in pids:
            try:
                sampler.attach(pid)
            except PythonAttachError as e:
                raise TargetError(f"pid {pid}: {e}") from None
        sampler.read()  # the window opens once every process is sampled
        start = time.time()
        watching(f"rankscope: sampling {len(pids)} process(es) at {frequency} Hz for {duration:g} s")
        try:
            time.sleep(duration)  # the window itself
        except KeyboardInterrupt:
            pass
        stacks = sampler.read()
        end = time.time()
        yield [RankProfile(job=ranks[pid][0], rank=ranks[pid][1], pid=pid, host=host, start=start, end=end,
                           frequency=frequency, stacks=stacks.get(pid, {})) for pid in pids]
