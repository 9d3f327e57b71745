"""A rank's Python profile for one window: where its wall time went, by Python function.

The sampler gives, per stack, on-CPU samples and off-CPU seconds. Wall time of a stack is both; a function's
self time is the wall time of the stacks it is innermost in, its total time of the stacks it appears in.
Background threads (stacks rooted in threading's bootstrap) wait forever by design, so only stacks of the
main thread (any other root) are summarized: that is the thread that paces the training loop.
"""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

from rankscope.agent.detail import Detail
from rankscope.agent.host.targets import Target
from rankscope.agent.interpreters import SPECIAL_FRAMES, Frame
from rankscope.agent.loader.trace_stream import TraceStream
from rankscope.agent.sources.python_sampler import PythonAttachError, PythonSampler, StackTime
from rankscope.agent.sources.source import Source
from rankscope.schema.patterns import PyFunction, RankPattern

log = logging.getLogger(__name__)


def function_name(frame: Frame) -> str:
    """The document's spelling of a Python function: "train.py:Model.forward"."""
    return f"{os.path.basename(frame.filename)}:{frame.qualname}"


def _is_background(stack: tuple[Frame, ...]) -> bool:
    return bool(stack) and stack[0].filename.endswith("threading.py") and stack[0].qualname.endswith("_bootstrap")


# The interpreter's own library (pyenv's .../lib/python3.12/, Debian's /usr/lib/python3.11/), not the packages
# installed beside it.
_STDLIB = re.compile(r"/lib/python3\.\d+/(?!(site|dist)-packages/)")


def blamed(stack: tuple[Frame, ...]) -> Frame:
    """The frame a stack's time is charged to: the innermost one outside the standard library. A main thread
    waiting for its DataLoader workers sleeps in selectors.select, under multiprocessing's queue, under the
    DataLoader's _try_get_data: the leaf names a mechanism, the caller names what waits (charged to the leaf, a
    slow loader would read as a compute straggler "in selectors.py:select"). A stack of the standard library
    alone keeps its leaf."""
    for frame in reversed(stack):
        if not _STDLIB.search(frame.filename):
            return frame
    return stack[-1]


def summarize(stacks: Mapping[tuple[Frame, ...], StackTime], frequency: float, top: int) -> list[PyFunction]:
    """The `top` functions by self time (each ~30 bytes of pattern); time in the standard library is the
    self time of its caller (see blamed)."""
    self_s: dict[Frame, float] = {}
    cpu_s: dict[Frame, float] = {}
    total_s: dict[Frame, float] = {}
    for stack, t in stacks.items():
        if not stack or _is_background(stack):
            continue
        on = t.samples / frequency
        wall = on + t.off_cpu_s
        owner = blamed(stack)
        self_s[owner] = self_s.get(owner, 0.0) + wall
        cpu_s[owner] = cpu_s.get(owner, 0.0) + on
        for frame in set(stack):
            total_s[frame] = total_s.get(frame, 0.0) + wall
    top = sorted((f for f in self_s if f not in SPECIAL_FRAMES), key=lambda f: -self_s[f])[:top]
    return [PyFunction(name=function_name(f), self_s=self_s[f], total_s=total_s[f], cpu_s=cpu_s[f]) for f in top]


class PythonFrames(Source):
    """Each rank's Python profile (`python` in the pattern), from the frame sampler."""

    def __init__(self, sampler: PythonSampler, detail: Detail):
        self.sampler = sampler
        self.detail = detail
        # The last window's full stacks per pid, for the profile views (GET /v1/profile): replaced each window.
        self.last: dict[int, dict[tuple[Frame, ...], StackTime]] = {}
        self.last_frequency = sampler.frequency

    def attach(self, target: Target) -> None:
        """Python frames are a bonus: a process whose interpreter cannot be read is still watched."""
        try:
            target.python = self.sampler.attach(target.pid)
        except PythonAttachError as e:
            target.python_error = str(e)
            log.warning("pid %d: no Python frames: %s", target.pid, e)

    def set_detail(self, detail: Detail) -> None:
        self.sampler.set_frequency(detail.python_hz)
        self.detail = detail

    def fill(self, patterns: list[RankPattern]) -> None:
        stacks = self.sampler.read()
        self.last, self.last_frequency = stacks, self.sampler.frequency
        for p in patterns:
            p.python = summarize(stacks.get(p.pid, {}), self.sampler.frequency, self.detail.top_python)

    def trace_streams(self) -> list[TraceStream]:
        return self.sampler.trace_streams()

    def detach(self, pid: int) -> None:
        self.sampler.detach(pid)

    def close(self) -> None:
        self.sampler.close()
