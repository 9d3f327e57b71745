"""The step is the steps' own duration; a window's time outside steps (start-up, pauses such as a checkpoint's
save, the tail) is reported apart and never reads as a slower job. Hand-built collective sequences of known
steps and pauses."""
from __future__ import annotations

import numpy as np
import pytest

from rankscope.agent.report import render
from rankscope.analyzer.baseline import MIN_WINDOWS, Baseline
from rankscope.analyzer.diagnosis import diagnose_job
from rankscope.analyzer.steps import LEAD_DRIFT, step_split
from rankscope.schema.patterns import (CollectiveColumns, FunctionStats, PyFunction, RankPattern, Role,
                                       ThreadTimes)

T0 = 1_700_000_000.0
STEP = 0.1
SAVE = 1.5  # a checkpoint's save, every CKPT_EVERY steps
CKPT_EVERY = 25
CALL = 0.01  # seconds in each all-reduce
REDUCER = "Reducer_finalize_backward"


def _ranks(calls: list[tuple[str, int, float]], start: float, end: float, ranks: int = 2,
           shipped: int | None = None, ddp: bool = True) -> list[RankPattern]:
    """Every rank's pattern of a window [start, end] (unix s) whose collectives are `calls` (op, bytes, enter),
    each lasting CALL; the function statistics count all of them, the records are the last `shipped`. `ddp`:
    DDP's reducer waits for each step's buckets, once a step (whose first collective is the sequence's first)."""
    inside = [c for c in calls if start <= c[2] <= end]
    counts: dict[str, int] = {}
    for op, _, _ in inside:
        counts[op] = counts.get(op, 0) + 1
    functions = {op: FunctionStats(op, Role.COMM, n, n * CALL, CALL, CALL, CALL) for op, n in counts.items()}
    if ddp:
        steps = sum(c[:2] == inside[0][:2] for c in inside)
        functions[REDUCER] = FunctionStats(REDUCER, Role.EXPOSED, steps, steps * CALL, CALL, CALL, CALL)
    kept = inside[-shipped:] if shipped else inside
    records = CollectiveColumns.named([c[0] for c in kept], [c[1] for c in kept], [c[2] for c in kept],
                                      [c[2] + CALL for c in kept])
    return [RankPattern(job="j", rank=r, world_size=ranks, pid=100 + r, host="h", window_start=start,
                        window_end=end, functions=dict(functions), collectives=records) for r in range(ranks)]


def _steps(first: float, n: int, step: float = STEP, pause_every: int = 0, pause: float = 0.0,
           after: tuple[int, ...] = ()) -> np.ndarray:
    """The starts of n steps from `first`, a `pause` after every `pause_every`-th step and after those `after`."""
    gaps = np.full(n - 1, step)
    if pause_every:
        gaps[pause_every - 1::pause_every] += pause
    gaps[[i - 1 for i in after]] += pause
    return first + np.concatenate(([0.0], np.cumsum(gaps)))


def _one_bucket(starts: np.ndarray) -> list[tuple[str, int, float]]:
    return [("gloo_allreduce", 1 << 20, float(t)) for t in starts]


def test_a_checkpoints_pause_is_outside_steps_not_a_longer_step():
    # 100 steps of 100 ms, a 1.5 s save after every 25th: the window over its steps read 145 ms. One bucket a
    # step: its pauses fall every 25 calls, the lattice of a burst of 25 buckets but for DDP's count of steps.
    starts = _steps(T0 + 0.05, 100, pause_every=CKPT_EVERY, pause=SAVE)
    end = float(starts[-1]) + 0.08
    doc = diagnose_job(_ranks(_one_bucket(starts), T0, end))
    assert doc["step_time_s"] == pytest.approx(STEP, rel=0.02)
    outside = doc["outside_steps"]
    assert outside["seconds"] == pytest.approx(3 * SAVE, abs=0.1)  # three saves
    assert outside["longest_s"] == pytest.approx(SAVE, abs=0.05)
    assert outside["share"] == pytest.approx(3 * SAVE / (end - T0), abs=0.02)


def test_a_job_starting_up_in_the_window_is_timed_by_its_steps():
    # The first step 2.5 s into a 10 s window, then 60 steps of 125 ms: 10 s / 60 steps read 167 ms.
    starts = _steps(T0 + 2.5, 60, step=0.125)
    end = T0 + 10.0
    split = step_split(_ranks(_one_bucket(starts), T0, end))
    assert split.step_s == pytest.approx([0.125] * 2, rel=0.02)
    # Less the step the window's start may have cut, at the pace before the shipped steps may hold.
    assert split.outside_s == pytest.approx([2.5] * 2, abs=0.2)


def test_a_pause_before_the_shipped_collectives_is_outside_steps():
    # An agent's light window ships the last 30 collectives: a 1.5 s pause came among the 10 steps before them.
    starts = _steps(T0 + 0.05, 40, pause=SAVE, after=(5,))
    end = float(starts[-1]) + 0.08
    split = step_split(_ranks(_one_bucket(starts), T0, end, shipped=30))
    assert split.step_s == pytest.approx([STEP] * 2, rel=0.02)
    # Less what the 10 unseen steps and the one cut may have run slower than the shipped ones.
    allowed = LEAD_DRIFT * 11 * STEP
    assert (SAVE - allowed - 0.1 <= split.outside_s).all() and (split.outside_s <= SAVE + 0.05).all(), split


def test_steps_that_slow_down_before_the_shipped_collectives_are_steps():
    # The window's first 200 steps 30% slower than its last 64 (a neighbour's load went away): no pause.
    early = _steps(T0, 200, step=0.0083)
    late = _steps(float(early[-1]) + 0.0064, 64, step=0.0064)
    end = float(late[-1]) + 0.003
    split = step_split(_ranks(_one_bucket(np.concatenate((early, late))), T0, end, shipped=64))
    assert split.outside_s == pytest.approx([0.0] * 2)
    assert split.step_s == pytest.approx([(end - T0) / 264] * 2, rel=0.02)


def _fsdp2_step(start: float, step: float, blocks: int = 4) -> list[tuple[str, int, float]]:
    """One FSDP2 step over gloo: the root's and each block's all-gather in the forward, each block's again in
    the backward between its gradients' reduce-scatters (gloo all-reduces them), then the root's."""
    forward = [("gloo_allgather", 0)] * (blocks + 1)
    backward = [c for _ in range(blocks) for c in (("gloo_allgather", 0), ("gloo_allreduce", 796188))]
    calls = forward + backward + [("gloo_allreduce", 1089552)]
    return [(op, size, start + step * i / len(calls)) for i, (op, size) in enumerate(calls)]


def test_fsdp2s_many_gathers_a_step_are_one_step():
    # 9 all-gathers, 4 + 1 all-reduces a step, ~49 steps a window: a count tolerance of a tenth of each key's
    # count took 13 collectives (8 gathers) for the step, 8/9 of it.
    step = 0.21
    calls = [c for i in range(50) for c in _fsdp2_step(T0 + 0.02 + step * i, step)]
    split = step_split(_ranks(calls, T0, T0 + 10.4, ranks=3, ddp=False))
    assert split.step_s == pytest.approx([step] * 3, rel=0.01)


def test_the_collectives_of_a_jobs_start_up_are_not_its_steps():
    # The Trainer's start-up: a gather, DDP's two broadcasts of the module's state, then steps of a gather
    # and three all-reduce buckets.
    step = 0.13
    head = [("gloo_allgather", 0, T0 + 6.1), ("gloo_broadcast", 608, T0 + 6.11), ("gloo_broadcast", 2668544, T0 + 6.12)]
    steps = [(op, size, T0 + 6.15 + step * i + dt) for i in range(28)
             for op, size, dt in (("gloo_allgather", 0, 0.0), ("gloo_allreduce", 1619968, 0.09),
                                  ("gloo_allreduce", 1048576, 0.1), ("gloo_allreduce", 112, 0.11))]
    split = step_split(_ranks(head + steps, T0, T0 + 10.0))
    assert split.step_s == pytest.approx([step] * 2, rel=0.02)
    assert split.outside_s == pytest.approx([6.15] * 2, abs=0.25)  # less the step its start may have cut


def test_a_window_with_a_checkpoint_is_no_regression():
    """Steady windows make the baseline; windows that each hold a checkpoint's save read the same step, are
    not slower than it, and make no finding."""
    baseline = Baseline()
    t = T0
    docs = []
    for window in range(MIN_WINDOWS + 4):
        paused = window >= MIN_WINDOWS
        starts = _steps(t + 0.05, 35 if paused else 50, pause_every=20 if paused else 0, pause=SAVE)
        end = t + 5.0
        docs.append(diagnose_job(_ranks(_one_bucket(starts), t, end), baseline=baseline))
        t = end
    for doc in docs[MIN_WINDOWS:]:
        assert doc["findings"] == []
        assert doc["step_time_s"] == pytest.approx(STEP, rel=0.02)
        assert not doc["baseline"]["slower"]
        assert doc["outside_steps"]["longest_s"] == pytest.approx(SAVE, abs=0.05)
    assert all(doc["outside_steps"]["seconds"] == 0.0 for doc in docs[:MIN_WINDOWS])


def test_the_text_report_says_the_time_outside_steps():
    starts = _steps(T0 + 0.05, 60, pause_every=CKPT_EVERY, pause=SAVE)
    text = render(diagnose_job(_ranks(_one_bucket(starts), T0, float(starts[-1]) + 0.08)))
    assert "outside steps: 3.00 s of the window" in text
    steady = render(diagnose_job(_ranks(_one_bucket(_steps(T0 + 0.05, 60)), T0, T0 + 6.05)))
    assert "outside steps" not in steady


SAVE_CPU = 1.2  # of a save, seconds rank 0 spends on a CPU (the rest is its fsync, off a CPU)


def _saving_job(seed: int, spin: float = 0.0, steps: int = 100, barrier: bool = True) -> list[RankPattern]:
    """Two ranks of one-bucket steps, every rank's arrival jittered alike; rank 0 writes a checkpoint after
    every CKPT_EVERY-th step (SAVE long, SAVE_CPU of it on a CPU) while rank 1 waits for it asleep, at a
    barrier or (`barrier` False) in its next all-reduce, and rank 0 computes `spin` seconds longer in every
    step, which its peer waits for in the all-reduce. The scheduler's, /proc's and the Python sampler's
    totals hold the save as they hold the steps."""
    rng = np.random.default_rng(seed)
    work = STEP - CALL
    arrive = T0 + 0.05 + work + rng.normal(0.0, 0.004, (steps, 2)).clip(-0.01, 0.01)
    arrive[:, 0] += spin
    done = np.zeros(steps)
    for i in range(steps):
        if i:  # the step begins where the last one's all-reduce ended, after a save
            arrive[i] += done[i - 1] - (T0 + 0.05) + (SAVE if i % CKPT_EVERY == 0 else 0.0) * np.array([1, barrier])
        done[i] = arrive[i].max() + CALL
    start, end = T0, float(done[-1]) + 0.05
    saves = (steps - 1) // CKPT_EVERY
    out = []
    for r in range(2):
        waits = done - arrive[:, r]
        on_cpu = steps * (work + (spin if r == 0 else 0.0)) + (saves * SAVE_CPU if r == 0 else 0.0)
        kernel = 0.05 * on_cpu + (saves * 0.3 if r == 0 else 0.0)  # a save writes in the kernel
        functions = {"gloo_allreduce": FunctionStats("gloo_allreduce", Role.COMM, steps, float(waits.sum()),
                                                     CALL, CALL, CALL),
                     REDUCER: FunctionStats(REDUCER, Role.EXPOSED, steps, steps * CALL, CALL, CALL, CALL)}
        records = CollectiveColumns.named(["gloo_allreduce"] * steps, [1 << 20] * steps, arrive[:, r], done)
        main = ThreadTimes("main", 1, on_cpu, 0.01 * steps, end - start - on_cpu, 0.0, 0.0, 0, 0.001)
        python = [PyFunction("model.py:forward", steps * work, steps * work, steps * work)]
        if r == 0:
            python += [PyFunction("serialization.py:_save", saves * SAVE, saves * SAVE, saves * SAVE_CPU),
                       PyFunction("model.py:spin", steps * spin, steps * spin, steps * spin)]
        out.append(RankPattern(job="j", rank=r, world_size=2, pid=100 + r, host="h", window_start=start,
                               window_end=end, functions=functions, collectives=records, sched={"main": main},
                               kernel_s=kernel, minor_faults=1000 * steps, python=python))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_the_rank_that_writes_a_checkpoint_is_no_straggler(seed):
    """Its save's time on a CPU, in user mode and in the kernel is in its window's totals but in no step: its
    peer waits for it outside the steps, and nothing is named."""
    doc = diagnose_job(_saving_job(seed))
    assert doc["findings"] == [] and doc.get("unconfirmed", []) == []
    assert doc["step_time_s"] == pytest.approx(STEP, rel=0.05)
    assert doc["outside_steps"]["longest_s"] == pytest.approx(SAVE, abs=0.05)


@pytest.mark.parametrize("seed", range(4))
def test_a_rank_its_peer_waits_for_in_its_next_collective_is_no_straggler(seed):
    """Without a barrier the peer waits out the save in its next all-reduce: that wait lies outside its
    steps, as the save does, and is no longer time in collectives a step than the saver's."""
    doc = diagnose_job(_saving_job(seed, barrier=False))
    assert doc["findings"] == [] and doc.get("unconfirmed", []) == []
    assert doc["step_time_s"] == pytest.approx(STEP, rel=0.05)
    ranks = doc["ranks"]
    assert ranks[1]["comm_s"] == pytest.approx(ranks[0]["comm_s"], abs=0.01 * STEP)


@pytest.mark.parametrize(("seed", "barrier"), [(0, True), (1, True), (2, False), (3, False)])
def test_a_rank_that_both_writes_a_checkpoint_and_computes_longer_is_named(seed, barrier):
    """Spinning a fifth of the step longer in every step, beside its saves: its peer waits for it in every
    step, and it is named for that, at what the spin costs the steps, not for its save. (Where in its steps
    the spin lies, window totals cannot tell from its saves beside it.)"""
    spin = 0.2 * STEP
    doc = diagnose_job(_saving_job(seed, spin=spin, barrier=barrier))
    [f] = doc["findings"]
    assert (f["kind"], f["ranks"]) == ("compute_straggler", [0])
    assert f["function"] != "serialization.py:_save"  # its save is no step's: not where its extra time lies
    assert f["cost"] == pytest.approx(spin / doc["step_time_s"], rel=0.3)
