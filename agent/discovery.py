"""Node-wide discovery: every process that maps a library of a training job (CUDA, NCCL, torch), in any
container."""
from __future__ import annotations

import os
import re

from .targets import TargetError, mapped_libraries


def training_processes(patterns: dict[str, re.Pattern[str]], exclude: set[int]) -> list[int]:
    """PIDs mapping a library of `patterns` (kind -> basename pattern: the job-identifying kinds only)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude:
            continue
        try:
            if mapped_libraries(int(entry), patterns):
                pids.append(int(entry))
        except TargetError:  # exited or unreadable since the listing
            continue
    return sorted(pids)
