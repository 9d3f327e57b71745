"""What the one BPF program (loader/program.py) saw of each rank in a window: its library calls (uprobes,
probes/), the collectives they completed, its threads' scheduler times and whom it waited for a CPU behind,
its TCP flows, and where a stalled rank is stuck.

The kernel only ever adds; this source keeps the previous reading and reports differences, so a window's
numbers never depend on a reset racing with the probes, and nothing collected is lost. It is the one source
a process cannot be watched without: its attach raises ProbeError where the others log and go on.
"""
from __future__ import annotations

import time

import numpy as np

from rankscope.agent.detail import Detail
from rankscope.agent.host.targets import Target, thread_group
from rankscope.agent.host.thread_state import where
from rankscope.agent.loader import histograms
from rankscope.agent.loader.maps import entries
from rankscope.agent.loader.program import COLL_RING, DONE_RECORD, FN_STATS, INFLIGHT, WATCHED, ProbeProgram
from rankscope.agent.loader.trace_stream import TraceStream
from rankscope.agent.sources.deltas import Deltas
from rankscope.agent.sources.probes import net, sched
from rankscope.agent.sources.probes.nccl import communicators, world_communicator
from rankscope.agent.sources.source import Source
from rankscope.schema.patterns import CollectiveColumns, FunctionColumns, FunctionStats, RankPattern, Role

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


class ProgramSource(Source):
    def __init__(self, program: ProbeProgram, detail: Detail):
        self.program = program
        self.program.hot = detail.hot_probes
        self.detail = detail
        self._cursors: dict[int, _ProcessCursor] = {}

    def attach(self, target: Target) -> None:
        """Probe `target`'s libraries and account its calls from now on; ProbeError says why not."""
        self.program.attach(target)

    def set_detail(self, detail: Detail) -> None:
        self.program.set_hot(detail.hot_probes)
        self.detail = detail

    def trace_streams(self) -> list[TraceStream]:
        return [self.program.trace_stream]

    def detach(self, pid: int) -> None:
        self.program.detach(pid)

    def forget(self, pid: int) -> None:
        self._cursors.pop(pid, None)
        self.program.purge(pid)

    def close(self) -> None:
        self.program.close()

    def fill(self, patterns: list[RankPattern]) -> None:
        if not patterns:
            return
        now = patterns[0].window_end  # one window for all
        mono_to_unix = time.time() - time.monotonic()  # bpf_ktime_get_ns() is CLOCK_MONOTONIC
        bpf = self.program.bpf
        stats: dict[int, dict[int, tuple]] = {}
        for key, val in entries(bpf[FN_STATS]):
            stats.setdefault(key.pid, {})[key.fn] = (val.count, val.total_ns, val.max_ns, val.bytes, list(val.hist))
        completed = self.program.completed()
        comms = communicators(bpf)
        pending = {k.value: v.pending_last for k, v in entries(bpf[WATCHED]) if v.pending_last}
        stalled = {p.pid for p in patterns if self._stalled(p, now)}  # before this window's progress: a superset
        blocked_in = self._blocked_in(stalled) if stalled else {}
        pending_op = self._pending_ops({pid: pending[pid] for pid in stalled if pid in pending})
        states = where(stalled, samples=STALLED_SAMPLES)  # all together: a few ms, however many stalled
        threads = sched.threads(bpf)
        thieves = sched.thieves(bpf)
        sockets = net.sockets(bpf)

        for p in patterns:
            if p.pid not in self._cursors:
                self._cursors[p.pid] = _ProcessCursor(p.pid)
            cursor = self._cursors[p.pid]
            p.collectives = self._collectives(completed.get(p.pid, _NONE_DONE), mono_to_unix)
            if p.collectives:
                cursor.last_progress = p.collectives[-1].done
            p.last_progress = cursor.last_progress
            self._identify(p, comms.get(p.pid, []))
            p.functions = self._functions(cursor, stats.get(p.pid, {}))
            p.sched = cursor.sched.thread_times(threads.get(p.pid, {}))
            p.where = self._where(states.get(p.pid, ""), pending_op.get(p.pid) or blocked_in.get(p.pid),
                                  stalled=self._stalled(p, now))
            p.tcp = cursor.tcp.flows(sockets.get(p.pid, {}))
        ranks: dict[str, set[int]] = {}  # job -> its ranks' pids (after _identify: a communicator names the job)
        for p in patterns:
            ranks.setdefault(p.job, set()).add(p.pid)
        jobs = {job: frozenset(pids) for job, pids in ranks.items()}
        for p in patterns:
            p.neighbours = self._cursors[p.pid].sched.neighbours(thieves.get(p.pid, {}), jobs[p.job])

    @staticmethod
    def _identify(p: RankPattern, comms) -> None:
        """The communicator is the job's own word on rank and size (the pattern came with the launcher's);
        the launcher's name for the job reads better than a hash when there is one."""
        world = world_communicator(comms)
        if world is None:
            return
        if p.identity_source != "env":
            p.job = f"nccl-{world.id_hash:016x}"
        p.rank, p.world_size, p.identity_source = world.rank, world.nranks, "nccl"

    def _functions(self, cursor: _ProcessCursor, stats: dict[int, tuple]) -> FunctionColumns:
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
        return FunctionColumns.of(out)

    def _stalled(self, p: RankPattern, now: float) -> bool:
        cursor = self._cursors.get(p.pid)
        return now - ((cursor.last_progress if cursor else None) or p.since) >= STALLED_AFTER_S

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
        for key, rec in entries(self.program.bpf[COLL_RING]):
            if pending.get(key.pid) == rec.seq and rec.fn in self.program.symbol_of:
                out[key.pid] = self.program.symbol_of[rec.fn]
        return out

    def _blocked_in(self, pids: set[int]) -> dict[int, str]:
        """pid -> the collective one of its threads is inside of, for the stalled processes: blocking
        collectives (gloo's run on the process group's worker threads) are in flight from entry to return.
        Read only when a rank stalls; the in-flight map is keyed by thread, so each entry's process is looked
        up in /proc."""
        out = {}
        for key, _val in entries(self.program.bpf[INFLIGHT]):
            symbol = self.program.symbol_of.get(key.fn)
            probe = self.program.probe_of.get(symbol) if symbol else None
            if probe is None or probe.role != Role.COMM:
                continue
            pid = thread_group(key.tid)
            if pid in pids:
                out.setdefault(pid, symbol)
        return out

    def _collectives(self, done: np.ndarray, mono_to_unix: float) -> CollectiveColumns:
        """The window's completed collectives (bpf_program.DONE_RECORD rows), the latest `max_collectives`."""
        latest = done[-self.detail.max_collectives:]
        return CollectiveColumns.named([self.program.symbol_of.get(fn, f"fn{fn}") for fn in latest["fn"].tolist()],
                                       latest["bytes"], latest["enter_ns"] / 1e9 + mono_to_unix,
                                       latest["done_ns"] / 1e9 + mono_to_unix)
