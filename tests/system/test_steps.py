"""The step time of real jobs outside steady state, against their own step logs: a job that pauses to save a
checkpoint, a Hugging Face Trainer diagnosed from its start-up, an FSDP2 job. The step is the steps' own (the
mean of the logged steps in the window less pauses, within STEP_TOLERANCE; of the checkpointing job, whose
steps beside a save run slower, their mean less its saves); start-up and pauses are `outside_steps`."""
from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import RANKSCOPE

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "jobs"))
import launch  # noqa: E402

STEP_TOLERANCE = 0.10  # the accuracy tests' margin: a neighbour's load moves a job's pace within a window
PAUSED = 2.5  # a logged step this many times the median holds a pause
# The checkpointing job's step against its own steps' mean less its saves: the same time in steps, however
# skewed they are.
CHECKPOINT_TOLERANCE = 0.05
SAVED = re.compile(r"step (\d+): checkpoint written in ([\d.]+) s")  # mlp_checkpoint.py's line of a save


@pytest.fixture
def job(tmp_path) -> Iterator[Callable[..., launch.TorchrunJob]]:
    started: list[launch.TorchrunJob] = []

    def start(script: str, ranks: int, *args: str, steady_steps: int = 20) -> launch.TorchrunJob:
        started.append(launch.start(script, ranks, list(args), tmp_path, steady_steps=steady_steps, timeout=120))
        return started[-1]

    yield start
    for j in started:
        j.kill()


def diagnose(job: launch.TorchrunJob, seconds: float) -> dict:
    out = subprocess.run([*RANKSCOPE, "diagnose", "--pid", ",".join(str(job.pids[r]) for r in range(job.ranks)),
                          "--duration", str(seconds), "--json"], capture_output=True, text=True, timeout=seconds + 90)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    job.wait_written(doc["window"]["end"])
    return doc


def logged_steps(job: launch.TorchrunJob, doc: dict) -> list[float]:
    """Rank 0's own step durations within the document's window."""
    w = doc["window"]
    ends = [t for t in job.step_ends(0) if w["start"] <= t <= w["end"]]
    return [b - a for a, b in zip(ends, ends[1:])]


def steps_less_saves(job: launch.TorchrunJob, doc: dict) -> list[float]:
    """Every rank's logged steps within the document's window, each less the save the job printed after the
    step it follows (rank 0 saves, the others wait for it at a barrier in the same step)."""
    saves = {int(n): float(s) for n, s in SAVED.findall(job.log.read_text(errors="replace"))}
    w = doc["window"]
    out = []
    for r in range(job.ranks):
        log = job.step_log(r)
        ends, first = log["ends"], log["steps"] - len(log["ends"]) + 1  # the step ends[0] ended
        out += [b - a - saves.get(first + k, 0.0) for k, (a, b) in enumerate(zip(ends, ends[1:]))
                if w["start"] <= a and b <= w["end"]]
    return out


def own_step_less_saves(job: launch.TorchrunJob, doc: dict) -> float:
    """The job's own step over the document's window: the mean of its steps less its saves, but for those
    still PAUSED times their median (the host held every rank: a pause, whoever caused it)."""
    steps = steps_less_saves(job, doc)
    median = statistics.median(steps)
    return statistics.fmean(s for s in steps if s <= PAUSED * median)


def assert_step(job: launch.TorchrunJob, doc: dict, tolerance: float = STEP_TOLERANCE) -> None:
    """The document's step against the job's own: the mean of rank 0's logged steps in the window, but for
    those PAUSED times their median (as the document's step leaves pauses out). The mean, not the median: a
    job whose pace changes within the window has a median of one pace and a mean of both."""
    steps = logged_steps(job, doc)
    median = statistics.median(steps)
    own = statistics.fmean(s for s in steps if s <= PAUSED * median)
    assert doc["step_time_s"] == pytest.approx(own, rel=tolerance), (doc["step_time_s"], own)


def test_a_checkpoints_save_is_outside_steps_not_a_slower_step(job, tmp_path):
    """Rank 0 saves model, optimizer and replay buffer every 25 steps (about a second, fsynced); the others
    wait at a barrier meanwhile. Spread over the steps, the saves would read as a step half again as long,
    and rank 0's save on a CPU as its extra work: nothing is named."""
    j = job("mlp_checkpoint.py", 2, "--ckpt-dir", str(tmp_path))
    doc = diagnose(j, 8.0)
    assert doc["findings"] == [], [f["summary"] for f in doc["findings"]]
    assert doc["step_time_s"] == pytest.approx(own_step_less_saves(j, doc), rel=CHECKPOINT_TOLERANCE)
    assert doc["outside_steps"]["seconds"] > 0
    steps = logged_steps(j, doc)
    median = statistics.median(steps)
    # The job's own pauses in the window: steps PAUSED times the median, and the wait from the window's start
    # to its first logged step (a save, or the attach, still running as the window opened).
    first = min(t for t in j.step_ends(0) if t >= doc["window"]["start"])
    leading = first - doc["window"]["start"] - median
    pauses = [d - median for d in steps if d > PAUSED * median] + ([leading] if leading > PAUSED * median else [])
    assert pauses, steps  # 8 s hold a save
    assert doc["outside_steps"]["longest_s"] == pytest.approx(max(pauses), rel=0.3), (doc["outside_steps"], pauses)
    assert doc["outside_steps"]["seconds"] >= 0.7 * sum(pauses), (doc["outside_steps"], pauses)


def test_a_trainer_diagnosed_from_its_start_up_is_timed_by_its_steps(job):
    """transformers.Trainer on a tiny GPT-2 (config only, random weights) with DDP over gloo, watched from
    before its first step: importing, building and wrapping the model take seconds of the window."""
    pytest.importorskip("transformers")
    j = job("hf_trainer_gpt2.py", 2, steady_steps=0)
    doc = diagnose(j, 10.0)
    assert_step(j, doc)
    first = min(t for t in j.step_ends(0) if t >= doc["window"]["start"])
    start_up = first - doc["window"]["start"]
    assert start_up > 1.0  # the window did open before the job stepped
    assert doc["outside_steps"]["seconds"] == pytest.approx(start_up, abs=max(0.5, 0.2 * start_up))


def test_an_fsdp2_jobs_step_is_its_whole_step(job):
    """fully_shard per block and on the whole model, 3 ranks: 9 all-gathers and 5 reduce-scatters (gloo
    all-reduces them) a step: a period one all-gather short would read 8/9 of the step."""
    j = job("fsdp2_lm.py", 3)
    launch.settle(j, 2.0)
    doc = diagnose(j, 6.0)
    assert_step(j, doc)
    assert doc["outside_steps"]["seconds"] == pytest.approx(0.0, abs=0.3)
