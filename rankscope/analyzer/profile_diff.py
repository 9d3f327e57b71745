"""A differential profile: one rank's Python stacks against its peers', in time per step.

A straggler computes longer per step while its peers wait longer in the collective: the same step time,
another split. So each rank's time in a stack is divided by the steps it made in the window (or, where the
step time is unknown, by the window's seconds: ranks of a synchronous job make the same steps per second,
so the order of what grew is the same, in another unit), and the rank is compared with the median of its
peers, stack by stack (a stack a peer never sampled counts 0 for it) and function by function: self time
(the stacks it is the leaf of: where the time grew, what a flame graph's widened frame shows) and total time
(every stack it is in, once per stack, so recursion is not counted twice). Totals of the outer frames also
move with time the sampler cannot see on one side (a thread preempted, neither on nor off CPU by choice),
so the self times name what grew.

Pure: frames are anything hashable (the agent's Frames), stacks tuples of them, root first. Cost: one pass
over each rank's stacks and a median per stack or function over the peers (a few thousand stacks of 8 ranks:
milliseconds).
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

Stack = tuple[Hashable, ...]


@dataclass(frozen=True)
class RankStacks:
    """One rank's seconds per stack over a window, and what they are divided by (steps or seconds)."""

    rank: int
    seconds: Mapping[Stack, float]
    per: float  # steps made in the window (or the window's seconds)


@dataclass(frozen=True)
class Delta:
    """A stack's or a function's time per step (or per second) on the rank, the peers' median, and the
    difference (positive: it grew on the rank)."""

    key: Hashable  # a stack, or a frame for a function's inclusive time
    rank_s: float
    peers_s: float

    @property
    def delta_s(self) -> float:
        return self.rank_s - self.peers_s


@dataclass(frozen=True)
class ProfileDiff:
    rank: int
    peers: tuple[int, ...]
    unit: str  # "step" | "second": what the times are per
    stacks: list[Delta]  # every stack either side has, largest growth first
    self_time: list[Delta]  # every function that is a leaf somewhere, its self time, largest growth first
    total_time: list[Delta]  # every function, inclusive time, largest growth first


def _normalized(r: RankStacks) -> dict[Stack, float]:
    return {stack: s / r.per for stack, s in r.seconds.items()}


def _self(per_stack: Mapping[Stack, float]) -> dict[Hashable, float]:
    out: dict[Hashable, float] = {}
    for stack, s in per_stack.items():
        if stack:
            out[stack[-1]] = out.get(stack[-1], 0.0) + s
    return out


def _inclusive(per_stack: Mapping[Stack, float]) -> dict[Hashable, float]:
    out: dict[Hashable, float] = {}
    for stack, s in per_stack.items():
        for frame in set(stack):
            out[frame] = out.get(frame, 0.0) + s
    return out


def _deltas(mine: Mapping[Hashable, float], theirs: Sequence[Mapping[Hashable, float]]) -> list[Delta]:
    keys = list(mine.keys() | set().union(*theirs))
    if not keys:
        return []
    peers = np.array([[t.get(k, 0.0) for k in keys] for t in theirs])
    medians = np.median(peers, axis=0).tolist()
    out = [Delta(k, mine.get(k, 0.0), m) for k, m in zip(keys, medians)]
    return sorted(out, key=lambda d: (-d.delta_s, str(d.key)))


def diff_against_peers(rank: RankStacks, peers: Sequence[RankStacks], unit: str) -> ProfileDiff:
    """`rank`'s stacks and functions against the median of `peers` (at least one; the rank itself is left
    out of them)."""
    others = [p for p in peers if p.rank != rank.rank]
    if not others:
        raise ValueError(f"rank {rank.rank} has no peers to be compared with")
    if rank.per <= 0 or any(p.per <= 0 for p in others):
        raise ValueError("steps (or seconds) per window must be positive")
    mine, theirs = _normalized(rank), [_normalized(p) for p in others]
    return ProfileDiff(rank=rank.rank, peers=tuple(p.rank for p in others), unit=unit,
                       stacks=_deltas(mine, theirs), self_time=_deltas(_self(mine), [_self(t) for t in theirs]),
                       total_time=_deltas(_inclusive(mine), [_inclusive(t) for t in theirs]))
