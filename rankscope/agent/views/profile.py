"""A rank's full Python stacks over one window, as the frame sampler counted them: the record that every
profile format (folded, speedscope, pprof) and the differential profile read.

Two weights per stack: on-CPU samples (CPU seconds = samples / frequency) and seconds off CPU (asleep, then
waiting for a CPU). `wall` (their sum) is the default: a rank's step is wall time, and a rank that waits for
a lock, a queue or I/O shows only off CPU; `cpu` is what py-spy records without --idle. Every thread is in
the profile (idle background threads too: ten of them add ten seconds per second of wall time, under their
own roots).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rankscope.agent.interpreters import Frame
from rankscope.agent.sources.python_sampler import StackTime
from rankscope.analyzer.peers import peer_groups
from rankscope.analyzer.profile_diff import ProfileDiff, RankStacks, diff_against_peers
from rankscope.schema.patterns import RankPattern

WHATS = ("wall", "cpu")
DEFAULT_WHAT = "wall"
MAX_STACKS = 2000  # per rank kept by the agent (up to ~1 MB a rank); the rest are summed under OTHER
OTHER = Frame("<other stacks>", "<rankscope>", 0)

Stacks = Mapping[tuple[Frame, ...], StackTime]


@dataclass(frozen=True)
class RankProfile:
    job: str
    rank: int
    pid: int
    host: str
    start: float  # unix s
    end: float  # unix s
    frequency: int  # Hz of the on-CPU samples
    stacks: Stacks
    steps: float | None = None  # steps the rank made in the window, where the step time is known

    def seconds(self, what: str) -> dict[tuple[Frame, ...], float]:
        """Seconds per stack: on CPU (`cpu`) or on and off CPU (`wall`); stacks with none left out."""
        if what not in WHATS:
            raise ValueError(f"what must be one of {WHATS}, not {what!r}")
        out = {}
        for stack, t in self.stacks.items():
            s = t.samples / self.frequency + (t.off_cpu_s if what == "wall" else 0.0)
            if s > 0:
                out[stack] = s
        return out

    @property
    def label(self) -> str:
        return f"rank {self.rank} (pid {self.pid})"


def bounded(stacks: Stacks, frequency: int, limit: int = MAX_STACKS) -> dict[tuple[Frame, ...], StackTime]:
    """The `limit` - 1 stacks with the most wall time, the others summed under (OTHER,): totals stay whole."""
    if len(stacks) <= limit:
        return dict(stacks)
    ranked = sorted(stacks.items(), key=lambda kv: -(kv[1].samples / frequency + kv[1].off_cpu_s))
    kept = dict(ranked[: limit - 1])
    rest = [t for _, t in ranked[limit - 1 :]]
    kept[(OTHER,)] = StackTime(sum(t.samples for t in rest), sum(t.off_cpu_s for t in rest))
    return kept


def steps_of(doc: Mapping[str, Any], rank: int, window_s: float) -> float | None:
    """Steps `rank` made in a window of the diagnosis document `doc` (from its step time), if known."""
    step = next((r.get("step_time_s") for r in doc.get("ranks", []) if r.get("rank") == rank), None)
    step = step or doc.get("step_time_s")
    return window_s / step if step else None


def window_profiles(patterns: Sequence[RankPattern], stacks: Mapping[int, Stacks], frequency: int,
                    docs: Mapping[str, Mapping[str, Any]]) -> list[RankProfile]:
    """Each pattern's rank's profile of the window, bounded, with its steps from its job's document."""
    return [RankProfile(job=p.job, rank=p.rank, pid=p.pid, host=p.host, start=p.window_start, end=p.window_end,
                        frequency=frequency, stacks=bounded(stacks.get(p.pid, {}), frequency),
                        steps=steps_of(docs.get(p.job, {}), p.rank, p.window_s))
            for p in patterns]


def peers_of(target: RankProfile, profiles: Sequence[RankProfile],
             patterns: Sequence[RankPattern] = ()) -> list[RankProfile]:
    """The other ranks of `target`'s job that play its role (analyzer/peers.py: the same collectives) when
    the patterns tell; every other rank of the job otherwise."""
    same_job = [p for p in profiles if p.job == target.job and p.pid != target.pid]
    job_patterns = [p for p in patterns if p.job == target.job]
    for group in peer_groups(job_patterns) if job_patterns else []:
        pids = {job_patterns[i].pid for i in group}
        if target.pid in pids:
            return [p for p in same_job if p.pid in pids]
    return same_job


def diff(target: RankProfile, peers: Sequence[RankProfile], what: str = DEFAULT_WHAT) -> ProfileDiff:
    """`target` against the median of `peers`, per step when every rank's steps are known, else per second."""
    ranks = [target, *peers]
    per_step = all(r.steps for r in ranks)

    def stacks(r: RankProfile) -> RankStacks:
        return RankStacks(r.rank, r.seconds(what), r.steps if per_step else max(r.end - r.start, 1e-9))

    return diff_against_peers(stacks(target), [stacks(p) for p in peers], "step" if per_step else "second")


def diff_json(d: ProfileDiff, top: int = 50) -> dict[str, Any]:
    """The `top` functions (by self and by total time) and stacks that changed most (either way), largest
    growth first."""

    def rows(deltas: list, name: str, show) -> list[dict[str, Any]]:
        kept = sorted(sorted(deltas, key=lambda x: -abs(x.delta_s))[:top], key=lambda x: -x.delta_s)
        return [{name: show(x.key), "rank_s": x.rank_s, "peers_s": x.peers_s, "delta_s": x.delta_s} for x in kept]

    return {"rank": d.rank, "peers": list(d.peers), "unit": f"seconds per {d.unit}",
            "self": rows(d.self_time, "function", str), "total": rows(d.total_time, "function", str),
            "stacks": rows(d.stacks, "stack", lambda s: [str(f) for f in s])}


def diff_summary(d: ProfileDiff) -> str:
    """One line for people: the function whose self time grew most on the rank, per step (or second)."""
    grown = d.self_time[0] if d.self_time and d.self_time[0].delta_s > 0 else None
    peers = ",".join(map(str, d.peers))
    if grown is None:
        return f"rank {d.rank} against ranks {peers}: no function grew"
    return (f"rank {d.rank} against ranks {peers}: {grown.key} grew most, {grown.peers_s * 1e3:.1f} -> "
            f"{grown.rank_s * 1e3:.1f} ms per {d.unit} (+{grown.delta_s * 1e3:.1f} ms)")
