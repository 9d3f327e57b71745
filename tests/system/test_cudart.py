"""The CUDA runtime probes (libcudart.so.12 and .so.13). On NVIDIA's real library of each CUDA line without a
GPU, whose calls fail (no driver) after their entry, where the probes fire and decode their arguments; and on the stand-in, whose calls
go through the stand-in driver as the real runtime's go through the real one: a driver call made inside a
runtime call is the runtime call's work, accounted once."""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import CommandProcess

from rankscope.agent.session import Session
from rankscope.cupti_shim.cuda_lines import LINES, CudaLine
from rankscope.sim.build import build_libraries

DRIVER = Path(__file__).parent.parent / "cudart_driver.py"
HOST_TO_DEVICE, DEVICE_TO_HOST = 1, 2
CUDA_ERROR_INSUFFICIENT_DRIVER = "35"  # what the real runtime answers on a machine without NVIDIA's driver


def _runtime_process(command_process, *libraries: Path) -> CommandProcess:
    return command_process(sys.executable, str(DRIVER), *map(str, libraries))


@pytest.fixture
def session() -> Iterator[Session]:
    s = Session()
    yield s
    s.close()


def _functions(session: Session, pid: int) -> dict[str, tuple[int, int]]:
    """name -> (calls, bytes) of the process's probed functions in one window."""
    pattern = next(p for p in session.window() if p.pid == pid)
    return {name: (f.count, f.bytes) for name, f in pattern.functions.items()}


@pytest.mark.parametrize("line", LINES, ids=lambda line: f"cuda{line.major}")
def test_probes_decode_real_cudart_calls(command_process, session, line: CudaLine):
    proc = _runtime_process(command_process, line.libcudart())
    target = session.add(proc.pid)
    assert os.readlink(target.libraries["cudart"]).endswith(f"libcudart.so.{line.major}")  # the file mapped
    for line in ("memcpy 4096 1", "memcpyasync 100 2", "malloc 1048576", "sync", "sync"):
        assert proc.call(line) == [CUDA_ERROR_INSUFFICIENT_DRIVER], line
    assert _functions(session, proc.pid) == {
        "cudaMemcpy": (1, 4096), "cudaMemcpyAsync": (1, 100), "cudaMalloc": (1, 1 << 20),
        "cudaStreamSynchronize": (2, 0)}


def test_driver_calls_inside_a_runtime_call_are_not_counted_twice(command_process, session):
    sim = build_libraries()
    proc = _runtime_process(command_process, sim / "libcudart.so.12", sim / "libcuda.so.1")
    target = session.add(proc.pid)
    assert set(target.libraries) >= {"cuda", "cudart"}
    # The first runtime call also initializes the driver (cuInit, cuCtxCreate_v2) inside it.
    for line in ("sync", "sync", "sync", f"memcpy 8192 {DEVICE_TO_HOST}", f"memcpy 8192 {DEVICE_TO_HOST}",
                 f"memcpyasync 512 {HOST_TO_DEVICE}", "driver-sync", "driver-sync"):
        assert proc.call(line) == ["0"], line
    # Only the driver's own calls from outside the runtime: the two direct cuStreamSynchronize.
    assert _functions(session, proc.pid) == {
        "cudaStreamSynchronize": (3, 0), "cudaMemcpy": (2, 16384), "cudaMemcpyAsync": (1, 512),
        "cuStreamSynchronize": (2, 0)}
