"""What tests and benchmarks need to drive processes from outside: waiting for a condition (never on the
clock alone) and telling whether a process maps a library."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Polls `condition` until it returns something truthy (returned); TimeoutError naming `what` after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def maps_library(pid: int, name: str) -> bool:
    """Whether `pid` maps a file whose path contains `name` (False once it exited)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return name in f.read()
    except OSError:
        return False
