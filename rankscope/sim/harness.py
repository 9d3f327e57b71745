"""What tests and benchmarks need to drive processes from outside: waiting for a condition (never on the
clock alone), telling whether a process maps a library, a free port, an agent's JSON."""
from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from rankscope.agent.host import procfs


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
        return any(name in m.path for m in procfs.maps(pid))
    except OSError:
        return False


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, timeout: float = 10) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def terminate(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds; reaped either way."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
