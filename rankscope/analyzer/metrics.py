"""Per-rank, per-step metrics as numpy arrays over ranks: the table the rules compare peers on.

Window totals differ with window length and step count, so everything is normalized to one step of the
rank (total x step / the window's time in steps) before ranks are compared.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from operator import attrgetter

import numpy as np

from rankscope.analyzer.functions import FunctionTable
from rankscope.analyzer.records import Collectives
from rankscope.analyzer.steps import step_split, window_seconds
from rankscope.analyzer.thresholds import PAUSE_MIN_S, PAUSE_STEPS
from rankscope.schema.patterns import PyFunction, PyTimed, RankPattern, Role, ThreadTimes

# Python functions of the input pipeline (data loaders, datasets, batch loading), by the words of their name
# (snake_case and CamelCase split: "OpOverloadPacket" loads nothing), unless a word says it communicates
# (torch.distributed.pipelining's "_wait_batch_p2p" waits for the other stage, not for data).
_WORDS = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")
_INPUT_WORDS = frozenset({"load", "loads", "loader", "loading", "batch", "batches", "next", "getitem", "fetch",
                          "fetcher", "collate", "dataset", "datasets", "dataloader"})
_COMM_WORDS = frozenset({"p2p", "send", "recv", "isend", "irecv", "allreduce", "broadcast", "barrier"})


class _InputNames:
    """`search(name)`: whether a function name is the input pipeline's (the regex interface the rules use)."""

    @staticmethod
    def search(name: str) -> bool:
        words = {w.lower() for w in _WORDS.findall(name)}
        return bool(words & _INPUT_WORDS) and not words & _COMM_WORDS


DATA_LOADING = _InputNames()
# Collectives that run on the host (gloo's, as agent/sources/probes/gloo.py names them): while a rank waits in
# one, its GPU holds none of the collective's work. NCCL's run on the GPU.
HOST_COLLECTIVES = re.compile(r"^(gloo_|ProcessGroupGloo_)")
HOST_P2P = re.compile(r"^gloo_(send|recv)$")  # their point-to-point transfers, waited for on the training thread


@dataclass(frozen=True)
class RankTable:
    """Rows are ranks (in the order of `patterns`); every time is seconds per step of that rank."""

    patterns: list[RankPattern]
    rank: np.ndarray  # global training rank per row
    step_s: np.ndarray  # NaN where the rank's step time is unknown
    window_s: np.ndarray  # the rank's window, seconds
    outside_s: np.ndarray  # ...of which outside steps (start-up, pauses, the tail); NaN: unknown
    longest_outside_s: np.ndarray  # the longest stretch of it
    comm_s: np.ndarray  # waiting for peers + transfer
    sync_s: np.ndarray  # waiting for its own GPU work
    host_s: np.ndarray  # outside every probed function: Python, data loading, CPU work
    work_s: np.ndarray  # step - comm: everything the rank does itself
    fn_names: list[str]  # columns of fn_s
    fn_roles: list[Role]
    fn_s: np.ndarray  # rows x functions; 0 where the rank never called the function
    gc_s: np.ndarray  # in the Python garbage collector
    runq_s: np.ndarray  # the main thread runnable but not running (waiting for a CPU); NaN: no scheduler view
    oncpu_s: np.ndarray  # the main thread running; NaN: no scheduler view
    kernel_s: np.ndarray  # ...of which in the kernel (page faults, system calls); NaN: unknown (an older agent)
    faults: np.ndarray  # the main thread's minor page faults; NaN: unknown
    py_names: list[str]  # columns of py_s
    py_s: np.ndarray  # rows x Python functions: self wall time per step; 0 where not among the rank's top
    timed_names: list[str]  # columns of timed_s
    timed_s: np.ndarray  # rows x exactly timed Python functions: time in their calls per step; NaN rows for
    # ranks not timed at all (the agent stops timing a process that enters eval too often): unknown, not 0
    records: Collectives  # the rows' collective records, read once for every rule

    def __len__(self) -> int:
        return len(self.patterns)

    @property
    def input_s(self) -> np.ndarray:
        """Host time in data-loading Python functions per step: the larger of the exactly timed ones (with their
        callees; NaN for untimed ranks, which fmax skips) and the sampled ones' self time, at most the host
        time, whose part it is (a sampled loader's wall time may hold a probed copy)."""
        def loading(names: list[str], per_step: np.ndarray) -> np.ndarray:
            cols = [j for j, name in enumerate(names) if DATA_LOADING.search(name)]
            return per_step[:, cols].sum(axis=1) if cols else np.zeros(len(self))

        return np.minimum(np.fmax(loading(self.timed_names, self.timed_s), loading(self.py_names, self.py_s)),
                          self.host_s)

    @cached_property
    def job_outside(self) -> tuple[float, float, float] | None:
        """The job's time outside steps: (seconds, share of the window, longest stretch), medians over the ranks
        whose steps were seen; None where none were."""
        known = np.isfinite(self.outside_s)
        if not known.any():
            return None
        return (float(np.median(self.outside_s[known])), float(np.median(self.outside_s[known] / self.window_s[known])),
                float(np.median(self.longest_outside_s[known])))

    @cached_property
    def outside_per_step_s(self) -> np.ndarray:
        """Per row: its time outside steps over its steps, as its window totals are read per step (0 where
        unknown): the most of a total's per-step excess that its pauses can hold."""
        outside = np.nan_to_num(self.outside_s)
        return outside * self.step_s / np.maximum(self.window_s - outside, 1e-9)

    @cached_property
    def job_step_s(self) -> float:
        """The job's step time: the median over ranks (ranks of a synchronous job share it). Once: the rules
        ask ~20 times (100,000 ranks: ~1.5 ms each)."""
        known = self.step_s[np.isfinite(self.step_s)]
        return float(np.median(known)) if known.size else float("nan")


def rank_table(patterns: Sequence[RankPattern], job_step_s: float | None = None,
               records: Collectives | None = None) -> RankTable:
    """The table of `patterns` (one job's ranks, or one peer group of them: then `job_step_s`, the job's step
    time, is every rank's that completed collectives, as the ranks of one synchronous job share it).
    `records`: their collectives, when read already."""
    patterns = list(patterns)
    n = len(patterns)
    records = Collectives.of(patterns) if records is None else records
    # The training thread's wait for its collectives (Role.EXPOSED) is their time on other threads seen again:
    # left out, the roles' times partition the step (rules/links.py reads it from the patterns).
    probed = FunctionTable.of(patterns)  # the steps read DDP's count of its steps (Role.EXPOSED) from it
    functions = probed.without(Role.EXPOSED)
    window_s = window_seconds(patterns)
    split = step_split(patterns, records, window_s, probed)
    step = split.step_s
    if job_step_s is not None and np.isfinite(job_step_s):
        step[records.counts > 0] = job_step_s
    # Window totals -> seconds per step: over the window's time in steps, so that the probed functions' time in
    # steps is not diluted by a pause. A pause's own work (a checkpoint's save) is still in the totals: the rules
    # take a rank's excess beyond its peers as step work only beyond what its pauses can hold (outside_per_step_s).
    per_step = step / np.maximum(window_s - np.nan_to_num(split.outside_s), 1e-9)

    fn_per_step = functions.total_s * per_step[:, None]
    roles = functions.roles
    role_arr = np.array([r.value for r in roles], dtype=object)

    def in_role(role: Role) -> np.ndarray:
        total = fn_per_step[:, role_arr == role.value].sum(axis=1) if roles else np.zeros(n)
        return np.where(np.isfinite(step), total, np.nan)  # unknown step: unknown per-step times

    pys, timeds = list(map(attrgetter("python"), patterns)), list(map(attrgetter("python_timed"), patterns))
    py_names, py = _named_columns(pys, "self_s")
    timed_names, timed = _named_columns(timeds, "total_s")
    timed[[not fs for fs in timeds]] = np.nan

    main = [s.get("main") for s in map(attrgetter("sched"), patterns)]
    # The rank's time in collectives, counted once where several overlap, less its waits across a pause.
    summed = in_role(Role.COMM) - _pause_waits(records, step) * per_step
    comm = summed * records.busy_share
    # Other probed calls on other threads may overlap too, so the remainder can dip below zero: clip.
    host = np.clip(step - fn_per_step.sum(axis=1) + (summed - comm), 0.0, None)
    return RankTable(
        patterns=patterns,
        rank=np.fromiter(map(attrgetter("rank"), patterns), np.int64, n),
        step_s=step,
        window_s=window_s,
        outside_s=split.outside_s,
        longest_outside_s=split.longest_s,
        comm_s=comm,
        sync_s=in_role(Role.SYNC),
        host_s=host,
        work_s=step - comm,
        fn_names=functions.names,
        fn_roles=roles,
        fn_s=fn_per_step,
        gc_s=in_role(Role.GC),
        runq_s=_main_thread(main, "runq_s") * per_step,
        oncpu_s=_main_thread(main, "on_cpu_s") * per_step,
        kernel_s=_known(patterns, "kernel_s") * per_step,
        faults=_known(patterns, "minor_faults") * per_step,
        py_names=list(py_names),
        py_s=py * per_step[:, None],
        timed_names=timed_names,
        timed_s=timed * per_step[:, None],
        records=records,
    )


def _pause_waits(records: Collectives, step: np.ndarray) -> np.ndarray:
    """Per pattern: its time in host collectives (gloo's, whose records time the wait its functions count)
    beyond its usual wait in one (the median of its host collectives'), in those lasting PAUSE_STEPS steps and
    PAUSE_MIN_S beyond one: no wait within a step is so long, and a rank whose peer pauses (to write a
    checkpoint) waits for it in its next collective. That wait is outside its steps, as the pause is
    (steps.py), not its time in collectives a step."""
    host = np.fromiter((bool(HOST_COLLECTIVES.match(op)) for op in records.ops), bool, len(records.ops))[records.op]
    row, wait = records.row, records.done - records.enter
    with np.errstate(invalid="ignore"):  # NaN step: unknown, no pause
        held = host & (wait > np.maximum(PAUSE_STEPS * step[row], step[row] + PAUSE_MIN_S))
    if not held.any():
        return np.zeros(records.counts.size)
    mine = host & np.isin(row, row[held])  # the host collectives of the ranks that waited across a pause
    usual = _lower_medians(row[mine], wait[mine], records.counts.size)
    return np.bincount(row[held], weights=wait[held] - usual[row[held]], minlength=records.counts.size)


def _lower_medians(row: np.ndarray, x: np.ndarray, n: int) -> np.ndarray:
    """Per row of n: the lower median of its values of `x` (`row`: each value's row; NaN where it has none)."""
    order = np.lexsort((x, row))
    counts = np.bincount(row, minlength=n)
    middle = np.cumsum(counts) - counts + (counts - 1) // 2
    return np.where(counts > 0, x[order][middle], np.nan)  # a row of none reads another's, then NaN


def _named_columns(rows: list[list[PyFunction]] | list[list[PyTimed]], field: str) -> tuple[list[str], np.ndarray]:
    """Per rank, its named records' `field` as a matrix over the union of names (0 where a rank lacks one; of
    a name listed twice, the last)."""
    filled = [i for i, row in enumerate(rows) if row]  # most ranks have none (no Python view)
    names: dict[str, int] = {}
    for i in filled:
        for f in rows[i]:
            names.setdefault(f.name, len(names))
    out = np.zeros((len(rows), len(names)))
    for i in filled:
        for f in rows[i]:
            out[i, names[f.name]] = getattr(f, field)
    return list(names), out


def _main_thread(main: list[ThreadTimes | None], field: str) -> np.ndarray:
    """Per rank: one of its main thread's scheduler times in the window (`main`: its ThreadTimes); NaN without
    that view."""
    return np.fromiter((np.nan if t is None else getattr(t, field) for t in main), float, len(main))


def _known(patterns: list[RankPattern], field: str) -> np.ndarray:
    """Per rank: a window total the pattern may lack (None), NaN where it does."""
    return np.fromiter((np.nan if (x := getattr(p, field)) is None else x for p in patterns), float, len(patterns))
