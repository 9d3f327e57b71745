"""Interpreters whose own call stacks the agent can sample: one module per interpreter (CPython only, so far).

Every version-specific fact (struct offsets, how a version is recognised, how it is verified) lives in the
interpreter's module; the samplers only consume a verified layout.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Frame:
    """One function of a sampled stack: the code object's qualified name, file and first line."""

    qualname: str
    filename: str
    firstlineno: int

    def __str__(self) -> str:
        return f"{self.qualname} ({self.filename}:{self.firstlineno})"


# Stand-ins for samples that are not, or not entirely, a Python stack. They keep shares honest: every
# sample of a watched process is counted under some stack.
NATIVE_THREAD = Frame("<native thread>", "<native>", 0)  # a thread with no Python thread state
NO_PYTHON_FRAME = Frame("<native>", "<native>", 0)  # a Python thread that runs no Python function
UNREADABLE = Frame("<unreadable>", "<unreadable>", 0)  # the interpreter's memory could not be read
TRUNCATED = Frame("<truncated>", "<truncated>", 0)  # deeper than the sampler keeps: outer frames missing
UNKNOWN_CODE = Frame("<unknown>", "<unknown>", 0)  # a code object that could not be resolved any more

SPECIAL_FRAMES = frozenset({NATIVE_THREAD, NO_PYTHON_FRAME, UNREADABLE, TRUNCATED, UNKNOWN_CODE})
