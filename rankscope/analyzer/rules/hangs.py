"""Hangs: the job stopped making progress. Which ranks never reached the collective the others wait in?

A rank has made no progress when no collective completed on it for the hang timeout. When every running
rank is stalled, each one's side is read from what the kernel and its interpreter say it is doing (`side`):
- in a collective: seen entering one it has not left (a NCCL collective it enqueued, a gloo one a thread of
  it is inside of), or blocked (in any call) while its innermost Python frame is torch.distributed's, or
  autograd's backward, where DDP's reducer waits for its buckets' all-reduces: C++ runs under those frames;
- elsewhere: stopped (SIGSTOP, a debugger), computing on a CPU (running: a rank with a GPU may instead be
  spinning on it, waiting for a collective's kernel), or, outside those frames, asleep on a timer
  (time.sleep) or reading a pipe or a file;
- unknown: blocked in a futex, poll or socket call with nothing more to tell.
The ranks elsewhere never arrived (non-communication hang, C4D's classification), however many ranks, two
included; the unknown ones wait for them. Beside a rank known to be in a collective, an unknown one in another
state than every such rank's never arrived either. With neither side known (the job hung before rankscope
attached and its frames say nothing), ranks that wait share one state, so a minority in another state never
arrived; when all share one, they all entered and none completes (communication hang).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from rankscope.analyzer.thresholds import DEFAULT_HANG_TIMEOUT_S
from rankscope.schema.finding import Finding, Why
from rankscope.schema.patterns import RankPattern

HANGS = frozenset({"noncomm_hang", "comm_hang"})  # the kinds this module finds

_TIMER_SLEEPS = ("nanosleep", "clock_nanosleep")  # system calls; their kernel functions below
_TIMER_WCHANS = ("hrtimer_nanosleep", "do_nanosleep")
_READS = ("read", "pread64", "readv", "preadv")
# Innermost Python frames (outside the standard library: agent/sources/python_profile.py's `blamed`) that block
# only in a collective: torch.distributed's functions and DDP's own (its buffers' broadcast) ...
_COLLECTIVE_FRAMES = ("distributed_c10d.py:", "distributed.py:DistributedDataParallel.")
# ...and autograd's backward (graph.py since torch 2.3, autograd/__init__.py before), where DDP waits for its
# gradients' all-reduces.
_BACKWARD_FRAMES = ("graph.py:_engine_run_backward", "__init__.py:backward")


class Side(str, Enum):
    COLLECTIVE = "collective"  # waits in a collective
    ELSEWHERE = "elsewhere"  # not in a collective: never reached it
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Doing:
    """What a stalled rank is doing, as its side and in words ("sleeps in train.py:main (clock_nanosleep)")."""

    side: Side
    words: str


def _stalled_for(p: RankPattern) -> float:
    last = p.last_progress if p.last_progress is not None else (p.since or p.window_start)
    return p.window_end - last


def _state(p: RankPattern) -> str:
    """The comparable part of `where`: the system call (or "running"), not the kernel function nor the
    collective a rank is known to wait for (that is known only for collectives enqueued while watched)."""
    return _call(p.where).split(" (")[0] or "unknown"


def _call(where: str) -> str:
    """`where` without a known collective: "futex (futex_wait_queue)" of "waiting for X (futex (...))"."""
    if where.startswith("waiting for ") and " (" in where:
        return where.split(" (", 1)[1].removesuffix(")")
    return where


def _python_where(p: RankPattern) -> str | None:
    """The Python function a stalled rank spends its time in (sampled), if its frames are read."""
    return max(p.python, key=lambda f: f.self_s).name if p.python else None


def _last_op(p: RankPattern) -> str | None:
    if p.collectives:
        return p.collectives[-1].op
    comm = [f for f in p.functions.values() if f.role.value == "comm"]
    return max(comm, key=lambda f: f.count).name if comm else None


def _known_op(p: RankPattern) -> str | None:
    """The collective the rank was seen entering and not leaving, unless it is stopped."""
    if not p.where.startswith("waiting for ") or _stopped(p):
        return None
    return p.where.removeprefix("waiting for ").split(" (")[0]


def _stopped(p: RankPattern) -> bool:
    return "do_signal_stop" in p.where or p.where.startswith("stopped")


def _asleep_on_timer(call: str) -> bool:
    return call.split(" (")[0] in _TIMER_SLEEPS or any(f"({w})" in call for w in _TIMER_WCHANS)


def _reads_no_socket(call: str) -> str | None:
    """What a rank blocked reading reads ("pipe", "file"), unless it is a socket (a peer's) or unknown."""
    name, _, source = call.partition(" from ")
    if name.split(" (")[0] not in _READS or source in ("socket", "unknown", ""):
        return None
    return source


def side(p: RankPattern) -> Doing:
    """The rank's side in a hang, from what it is doing: see the module's docstring."""
    call, frame = _call(p.where), _python_where(p)
    state = call.split(" (")[0] or "unknown"
    inside = f" in {frame}" if frame else ""
    if _stopped(p):
        return Doing(Side.ELSEWHERE, f"is stopped{inside} ({call})")
    if op := _known_op(p):
        return Doing(Side.COLLECTIVE, f"waits in {op}{_place(frame)} ({state})")
    waits = _waits_in(frame, state)
    if call == "running":
        if p.gpu is None and p.gpu_health is None:
            return Doing(Side.ELSEWHERE, f"computes{inside} (running)")
        if waits:  # CUDA spins while it waits for a kernel, here a collective's
            return Doing(Side.COLLECTIVE, waits)
        return Doing(Side.UNKNOWN, f"runs{inside}, maybe waiting for its GPU")
    if waits:  # blocked in any call, a timer's sleep included: a C++ wait that polls (NCCL's blocking wait)
        return Doing(Side.COLLECTIVE, waits)
    if _asleep_on_timer(call):
        return Doing(Side.ELSEWHERE, f"sleeps{inside} ({state})")
    if source := _reads_no_socket(call):
        return Doing(Side.ELSEWHERE, f"reads a {source}{inside} ({state})")
    return Doing(Side.UNKNOWN, f"is blocked{inside} ({call})" if call else f"is in an unknown state{inside}")


def _waits_in(frame: str | None, state: str) -> str | None:
    """How a rank whose innermost Python frame is `frame` waits, if that frame waits only for collectives."""
    if frame and frame.startswith(_COLLECTIVE_FRAMES):
        return f"waits in {frame} ({state})"
    if frame and frame.startswith(_BACKWARD_FRAMES):
        return f"waits in backward for its gradients' all-reduce ({frame}, {state})"
    return None


def _place(frame: str | None) -> str:
    if not frame:
        return ""
    return " inside backward" if frame.startswith(_BACKWARD_FRAMES) else f" from {frame}"


@dataclass(frozen=True)
class Split:
    """The ranks that never reached the collective, what the others share, and what told them apart (the
    finding's criterion): "stopped" (every one of them is), "blocked_outside_comm" (what each rank does), or
    "minority_state" (the one state most ranks share)."""

    late: set[int]
    common: str  # the waiting ranks' state
    criterion: str


def _non_arrivals(running: list[RankPattern], doing: dict[int, Doing]) -> Split | None:
    """None: every rank entered the collective, or nothing tells which did not."""
    elsewhere = {p.rank for p in running if doing[p.rank].side == Side.ELSEWHERE}
    waiting = [p for p in running if doing[p.rank].side == Side.COLLECTIVE]
    if waiting:  # an unknown rank in a waiting rank's state waits too (entered before attach)
        states = {_state(p) for p in waiting}
        apart = {p.rank for p in running if doing[p.rank].side == Side.UNKNOWN and _state(p) not in states}
        late = elsewhere | apart
        return Split(late, _state(waiting[0]), _told_by(late, running)) if late else None
    if elsewhere:
        rest = [p for p in running if p.rank not in elsewhere]
        common = Counter(map(_state, rest or running)).most_common(1)[0][0]
        return Split(elsewhere, common, _told_by(elsewhere, running))
    common, n = Counter(map(_state, running)).most_common(1)[0]
    if n * 2 > len(running) and n < len(running):
        return Split({p.rank for p in running if _state(p) != common}, common, "minority_state")
    return None


def _told_by(late: set[int], running: list[RankPattern]) -> str:
    return "stopped" if all(_stopped(p) for p in running if p.rank in late) else "blocked_outside_comm"


def _told(ranks: list[int], doing: dict[int, Doing], shown: int = 3) -> str:
    """Each of the first `shown` ranks and what it does, then how many more: a summary of a few lines however
    large the job (a display limit, no threshold of the decision)."""
    told = "; ".join(f"rank {r} {doing[r].words}" for r in ranks[:shown])
    more = len(ranks) - shown
    return told + (f"; {more} more {'rank' if more == 1 else 'ranks'}" if more > 0 else "")


def hang(patterns: Sequence[RankPattern], timeout_s: float = DEFAULT_HANG_TIMEOUT_S) -> list[Finding]:
    running = [p for p in patterns if p.state == "running"]
    if len(running) < 2:
        return []
    stalled = min(map(_stalled_for, running))
    if stalled < timeout_s:
        return []
    doing = {p.rank: side(p) for p in running}
    split = _non_arrivals(running, doing)
    common = split.common if split else Counter(map(_state, running)).most_common(1)[0][0]
    per_rank = sorted(({"rank": p.rank, "pid": p.pid, "host": p.host, "where": p.where,
                        "python_function": _python_where(p), "stalled_for_s": _stalled_for(p),
                        "side": doing[p.rank].side.value, "doing": doing[p.rank].words}
                       for p in running), key=lambda r: r["rank"])
    evidence = {"timeout_s": timeout_s, "stalled_for_s": stalled, "waiting_state": common, "per_rank": per_rank}
    why = [Why("stalled_for_s", stalled, timeout_s, "s")]  # the least stalled running rank's
    op = next(filter(None, (_last_op(p) for p in running)), None)
    if split:
        odd = sorted(split.late)
        others = sorted(p.rank for p in running if p.rank not in split.late)
        ranks = f"{'rank' if len(odd) == 1 else 'ranks'} {', '.join(map(str, odd))}"
        outcome = f"{ranks} never reached the collective the others wait in" if others else "no rank is in a collective"
        return [Finding(
            kind="noncomm_hang", ranks=odd, function=_python_where(next(p for p in running if p.rank == odd[0])),
            component=None, score=float(len(others) or len(odd)), cost=1.0, criterion=split.criterion,
            why=[*why, Why("ranks_in_common_state", len(others), len(odd), "ranks", ">")]
            if split.criterion == "minority_state" else why,
            summary=(f"no progress for {stalled:.0f} s: {outcome}: {_told(odd, doing)}"
                     + (f"; {_told(others, doing)}" if others else "")),
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
