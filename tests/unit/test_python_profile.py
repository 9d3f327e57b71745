"""A rank's Python profile: which function a sampled stack's time is charged to."""
from __future__ import annotations

import pytest

from rankscope.agent.interpreters import Frame
from rankscope.agent.sources.python_profile import summarize
from rankscope.agent.sources.python_sampler import StackTime

LIB = "/root/.pyenv/versions/3.12.7/lib/python3.12"
TORCH = "/work/main/.venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py"

TRAIN = Frame("train", "/job/cnn_classifier.py", 40)
NEXT = Frame("_BaseDataLoaderIter.__next__", TORCH, 620)
TRY_GET = Frame("_MultiProcessingDataLoaderIter._try_get_data", TORCH, 1120)
# What the main thread of a job whose DataLoader workers are slow sleeps in (multiprocessing's queue).
WAIT = (Frame("Queue.get", f"{LIB}/multiprocessing/queues.py", 98),
        Frame("Connection.poll", f"{LIB}/multiprocessing/connection.py", 253),
        Frame("wait", f"{LIB}/multiprocessing/connection.py", 1114),
        Frame("PollSelector.select", f"{LIB}/selectors.py", 402))
RUNPY = Frame("_run_code", f"{LIB}/runpy.py", 86)


def test_time_in_the_standard_library_is_its_callers():
    stacks = {(RUNPY, TRAIN, NEXT, TRY_GET, *WAIT): StackTime(samples=2, off_cpu_s=0.5),
              (RUNPY, TRAIN): StackTime(samples=10)}
    top = summarize(stacks, frequency=100.0, top=5)
    by_name = {f.name: f for f in top}
    assert list(by_name) == ["dataloader.py:_MultiProcessingDataLoaderIter._try_get_data", "cnn_classifier.py:train"]
    wait = by_name["dataloader.py:_MultiProcessingDataLoaderIter._try_get_data"]
    assert (wait.self_s, wait.cpu_s) == pytest.approx((0.52, 0.02))
    assert by_name["cnn_classifier.py:train"].total_s == pytest.approx(0.62)  # its own 0.1 s and the wait under it


def test_site_and_dist_packages_are_not_the_standard_library():
    debian = Frame("fetch", "/usr/local/lib/python3.11/dist-packages/loader/fetch.py", 3)
    stacks = {(TRAIN, debian, WAIT[-1]): StackTime(off_cpu_s=1.0)}
    assert [f.name for f in summarize(stacks, 100.0, 5)] == ["fetch.py:fetch"]


def test_a_stack_of_the_standard_library_alone_keeps_its_leaf():
    stacks = {(RUNPY, *WAIT): StackTime(off_cpu_s=1.0)}
    assert [f.name for f in summarize(stacks, 100.0, 5)] == ["selectors.py:PollSelector.select"]
