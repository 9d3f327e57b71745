"""Hangs: the job stopped making progress. Which ranks never reached the collective the others wait in?

A rank has made no progress when no collective completed on it for the hang timeout. When every running
rank is stalled, the ranks known to wait in a collective (one they enqueued, NCCL, or are inside of, gloo,
while watched) are the waiting side, and the others never arrived (non-communication hang, C4D's
classification); this decides with two ranks too. A stopped rank (SIGSTOP, a debugger) never arrives.
Without such knowledge (the job hung before rankscope attached), ranks that wait in a collective share one
state (blocked in the same system call), so a minority in another state is the one that never arrived;
when all share one state, they all entered and none completes (communication hang).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from rankscope.analyzer.thresholds import DEFAULT_HANG_TIMEOUT_S
from rankscope.schema.finding import Finding, Why
from rankscope.schema.patterns import RankPattern

HANGS = frozenset({"noncomm_hang", "comm_hang"})  # the kinds this module finds


def _stalled_for(p: RankPattern) -> float:
    last = p.last_progress if p.last_progress is not None else (p.since or p.window_start)
    return p.window_end - last


def _state(p: RankPattern) -> str:
    """The comparable part of `where`: the system call (or "running"), not the kernel function nor the
    collective a rank is known to wait for (that is known only for collectives enqueued while watched)."""
    where = p.where
    if where.startswith("waiting for ") and " (" in where:
        where = where.split(" (", 1)[1]
    return where.split(" (")[0] or "unknown"


def _python_where(p: RankPattern) -> str | None:
    """The Python function a stalled rank spends its time in (sampled), if its frames are read."""
    return max(p.python, key=lambda f: f.self_s).name if p.python else None


def _last_op(p: RankPattern) -> str | None:
    if p.collectives:
        return p.collectives[-1].op
    comm = [f for f in p.functions.values() if f.role.value == "comm"]
    return max(comm, key=lambda f: f.count).name if comm else None


def _waiting(p: RankPattern) -> bool:
    """Known to wait in a collective, and not stopped."""
    return p.where.startswith("waiting for ") and not _stopped(p)


def _stopped(p: RankPattern) -> bool:
    return "do_signal_stop" in p.where or p.where.startswith("stopped")


def _non_arrivals(running: list[RankPattern]) -> tuple[set[int], str, str] | None:
    """The ranks that never reached the collective, what the others share, and the test that told them
    (the finding's criterion); None: all entered it."""
    stopped = {p.rank for p in running if _stopped(p)}
    waiting = [p for p in running if _waiting(p)]
    if waiting:  # a rank in the same state whose entry was not seen (enqueued before attach) waits too
        states = {_state(p) for p in waiting}
        late = {p.rank for p in running if not _waiting(p) and (_stopped(p) or _state(p) not in states)}
        return (late, _state(waiting[0]), "blocked_outside_comm") if late else None
    if stopped and len(stopped) < len(running):
        return stopped, Counter(_state(p) for p in running if p.rank not in stopped).most_common(1)[0][0], "stopped"
    common, n = Counter(_state(p) for p in running).most_common(1)[0]
    if n * 2 > len(running) and n < len(running):
        return {p.rank for p in running if _state(p) != common}, common, "minority_state"
    return None


def hang(patterns: Sequence[RankPattern], timeout_s: float = DEFAULT_HANG_TIMEOUT_S) -> list[Finding]:
    running = [p for p in patterns if p.state == "running"]
    if len(running) < 2:
        return []
    stalled = min(map(_stalled_for, running))
    if stalled < timeout_s:
        return []
    split = _non_arrivals(running)
    common = split[1] if split else Counter(_state(p) for p in running).most_common(1)[0][0]
    per_rank = sorted(({"rank": p.rank, "pid": p.pid, "host": p.host, "where": p.where,
                        "python_function": _python_where(p), "stalled_for_s": _stalled_for(p)}
                       for p in running), key=lambda r: r["rank"])
    evidence = {"timeout_s": timeout_s, "stalled_for_s": stalled, "waiting_state": common, "per_rank": per_rank}
    why = [Why("stalled_for_s", stalled, timeout_s, "s")]  # the least stalled running rank's
    op = next(filter(None, (_last_op(p) for p in running)), None)
    if split:
        odd = sorted(split[0])
        n = len(running) - len(odd)
        stuck = [r for r in per_rank if r["rank"] in odd]
        where = "; ".join(f"rank {r['rank']}: " + (f"in {r['python_function']}, " if r["python_function"] else "")
                          + (r["where"] or "unknown") for r in stuck)
        return [Finding(
            kind="noncomm_hang", ranks=odd, function=stuck[0]["python_function"], component=None,
            score=float(n), cost=1.0, criterion=split[2],
            why=[*why, Why("ranks_in_common_state", n, len(odd), "ranks", ">")] if split[2] == "minority_state"
            else why,
            summary=(f"no progress for {stalled:.0f} s: {n} {'ranks wait' if n > 1 else 'rank waits'} in "
                     f"{op or 'a collective'} ({common}) "
                     f"that {'rank' if len(odd) == 1 else 'ranks'} {', '.join(map(str, odd))} never reached; "
                     f"{where}"),
            evidence=evidence,
        )]
    ranks = sorted(p.rank for p in running)
    return [Finding(
        kind="comm_hang", ranks=ranks, function=op, component="link", score=float(len(running)), cost=1.0,
        criterion="all_in_collective", why=why,
        summary=(f"no progress for {stalled:.0f} s: every rank is in {op or 'a collective'} ({common}) and none "
                 f"completes"),
        evidence=evidence,
    )]
