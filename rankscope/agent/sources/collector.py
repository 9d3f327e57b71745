"""Turns the uprobe program's cumulative maps into one RankPattern per watched process per window (the other
sources then fill in their parts: sources/source.py).

The kernel only ever adds; the collector keeps the previous reading and reports differences, so a
window's numbers never depend on a reset racing with the probes, and nothing collected is lost.
"""
from __future__ import annotations

import time

import numpy as np

from rankscope.agent.detail import LIGHT, Detail
from rankscope.agent.host.cpu_idle import CpuIdle
from rankscope.agent.host.targets import Identity, Target, major_faults, thread_group
from rankscope.agent.host.thread_state import where
from rankscope.agent.loader import histograms
from rankscope.agent.loader.program import (COLL_RING, DONE_RECORD, FN_STATS, INFLIGHT, WATCHED,
                                            ProbeProgram)
from rankscope.agent.sources.deltas import Deltas
from rankscope.agent.sources.probes import net, sched
from rankscope.agent.sources.probes.nccl import communicators, world_communicator
from rankscope.schema.patterns import CollectiveRecord, FunctionStats, HostCpus, RankPattern, Role

STALLED_SAMPLES = 5  # /proc reads of a stalled rank: its state by majority
# A rank whose last collective completed this long before the window's end is stalled (so far): where it
# is, is read. Not "nothing completed this window": a hang that starts mid-window must show too.
STALLED_AFTER_S = 2.0
_NONE_DONE = np.zeros(0, DONE_RECORD)


class _ProcessCursor:
    """What the previous window read of one process, so the next one reports differences."""

    def __init__(self, pid: int):
        self.functions: Deltas[int] = Deltas()  # fn -> (count, total_ns, bytes, hist)
        self.last_progress: float | None = None  # unix s of the last collective completion seen
        self.sched = sched.SchedReader(pid)
        self.tcp = net.TcpReader(net.jiffies_per_s())
        self.major_faults = major_faults(pid)


class Collector:
    def __init__(self, program: ProbeProgram, host: str):
        self.program = program
        self.host = host
        self._cursors: dict[int, _ProcessCursor] = {}
        self._window_start = time.time()
        self._cpu_idle = CpuIdle()
        self.detail: Detail = LIGHT

    def forget(self, pid: int) -> None:
        self._cursors.pop(pid, None)

    def collect(self, targets: list[Target], exited: set[int] = frozenset()) -> list[RankPattern]:
        """One pattern per target for the window since the previous call."""
        now = time.time()
        mono_to_unix = now - time.monotonic()  # bpf_ktime_get_ns() is CLOCK_MONOTONIC
        start, self._window_start = self._window_start, now
        bpf = self.program.bpf
        stats: dict[int, dict[int, tuple]] = {}
        for key, val in bpf[FN_STATS].items():
            stats.setdefault(key.pid, {})[key.fn] = (val.count, val.total_ns, val.max_ns, val.bytes, list(val.hist))
        completed = self.program.completed()
        comms = communicators(bpf)
        pending = {k.value: v.pending_last for k, v in bpf[WATCHED].items() if v.pending_last}
        stalled = {t.pid for t in targets if self._stalled(t, now)}  # before this window's progress: a superset
        blocked_in = self._blocked_in(stalled) if stalled else {}
        pending_op = self._pending_ops({pid: pending[pid] for pid in stalled if pid in pending})
        states = where(stalled, samples=STALLED_SAMPLES)  # all together: a few ms, however many stalled
        threads = sched.threads(bpf)
        thieves = sched.thieves(bpf)
        sockets = net.sockets(bpf)
        self._cpu_idle.advance()

        patterns = []
        for t in targets:
            if t.pid not in self._cursors:
                self._cursors[t.pid] = _ProcessCursor(t.pid)
            cursor = self._cursors[t.pid]
            faults = major_faults(t.pid)
            collectives = self._collectives(completed.get(t.pid, _NONE_DONE), mono_to_unix)
            if collectives:
                cursor.last_progress = collectives[-1].done
            ident = self._identity(t, comms.get(t.pid, []))
            cpus = self._cpu_idle.of(t.pid)
            patterns.append(RankPattern(
                job=ident.job, rank=ident.rank, world_size=ident.world_size, pid=t.pid, host=self.host,
                # A rank attached during this window has been accounted only since then.
                window_start=max(start, t.attached_at), window_end=now, state="exited" if t.pid in exited else "running",
                functions=self._functions(cursor, stats.get(t.pid, {})),
                collectives=collectives,
                identity_source=ident.source,
                sched=cursor.sched.thread_times(threads.get(t.pid, {})),
                neighbours=cursor.sched.neighbours(thieves.get(t.pid, {})),
                major_faults=max(faults - cursor.major_faults, 0),
                last_progress=cursor.last_progress,
                since=t.attached_at,
                where=self._where(states.get(t.pid, ""), pending_op.get(t.pid) or blocked_in.get(t.pid),
                                  stalled=self._stalled(t, now)),
                tcp=cursor.tcp.flows(sockets.get(t.pid, {})),
                cpus=None if cpus is None else HostCpus(*cpus),
            ))
            cursor.major_faults = faults
        return patterns

    @staticmethod
    def _identity(t: Target, comms) -> Identity:
        env = t.identity
        world = world_communicator(comms)
        if world is None:
            return env
        # The communicator is the job's own word on rank and size; the launcher's name for the job reads
        # better than a hash when there is one.
        job = env.job if env.source == "env" else f"nccl-{world.id_hash:016x}"
        return Identity(job=job, rank=world.rank, world_size=world.nranks, local_rank=env.local_rank, source="nccl")

    def _functions(self, cursor: _ProcessCursor, stats: dict[int, tuple]) -> dict[str, FunctionStats]:
        out = {}
        for fn, (count, total_ns, max_ns, nbytes, hist) in stats.items():
            d_count, d_ns, d_bytes, d_hist = cursor.functions.step(fn, (count, total_ns, nbytes, hist))
            if d_count <= 0 and d_ns == 0:
                continue
            max_s = histograms.window_max_s(max_ns, d_hist)
            symbol = self.program.symbol_of.get(fn, f"fn{fn}")
            probe = self.program.probe_of[symbol]
            out[symbol] = FunctionStats(
                name=symbol, role=probe.role, count=d_count, total_s=d_ns / 1e9,
                max_s=max_s, p50_s=min(histograms.percentile_s(d_hist, 0.5), max_s),
                p99_s=min(histograms.percentile_s(d_hist, 0.99), max_s), bytes=d_bytes,
            )
        return out

    def _stalled(self, t: Target, now: float) -> bool:
        cursor = self._cursors.get(t.pid)
        return now - ((cursor.last_progress if cursor else None) or t.attached_at) >= STALLED_AFTER_S

    @staticmethod
    def _where(state: str, op: str | None, stalled: bool) -> str:
        """Where a stalled rank is stuck ("" for a rank making progress): waiting for the collective `op` it
        enqueued (NCCL) or is inside of (gloo), or else `state`, its main thread's (thread_state.where)."""
        if not stalled:
            return ""
        return f"waiting for {op} ({state})" if op else state

    def _pending_ops(self, pending: dict[int, int]) -> dict[int, str]:
        """pid -> the collective it enqueued and has not seen complete (its seq in `pending`), from the
        kernel's ring of recent collectives; read only when a rank stalls."""
        if not pending:
            return {}
        out = {}
        for key, rec in self.program.bpf[COLL_RING].items():
            if pending.get(key.pid) == rec.seq and rec.fn in self.program.symbol_of:
                out[key.pid] = self.program.symbol_of[rec.fn]
        return out

    def _blocked_in(self, pids: set[int]) -> dict[int, str]:
        """pid -> the collective one of its threads is inside of, for the stalled processes: blocking
        collectives (gloo's run on the process group's worker threads) are in flight from entry to return.
        Read only when a rank stalls; the in-flight map is keyed by thread, so each entry's process is looked
        up in /proc."""
        out = {}
        for key, _val in self.program.bpf[INFLIGHT].items():
            symbol = self.program.symbol_of.get(key.fn)
            probe = self.program.probe_of.get(symbol) if symbol else None
            if probe is None or probe.role != Role.COMM:
                continue
            pid = thread_group(key.tid)
            if pid in pids:
                out.setdefault(pid, symbol)
        return out

    def _collectives(self, done: np.ndarray, mono_to_unix: float) -> list[CollectiveRecord]:
        """The window's completed collectives (bpf_program.DONE_RECORD rows), the latest `max_collectives`."""
        latest = done[-self.detail.max_collectives:][["fn", "enter_ns", "done_ns", "bytes"]].tolist()
        return [
            CollectiveRecord(op=self.program.symbol_of.get(fn, f"fn{fn}"), bytes=nbytes,
                             enter=enter_ns / 1e9 + mono_to_unix, done=done_ns / 1e9 + mono_to_unix)
            for fn, enter_ns, done_ns, nbytes in latest
        ]
