"""A watched process's libraries are a tenant's files: the agent opens the very file mapped (never a name the
container can swap), regular files only, and reads an ELF file within its size. A process whose library is
hostile is not watched, said in one line; the agent goes on. Root, real processes in mount namespaces of their
own (as a container's), real eBPF."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import RANKSCOPE, one_line_error
from crafted_elf import HUGE, crafted

from rankscope.agent.host.targets import TargetError
from rankscope.agent.loader.program import ProbeError
from rankscope.agent.session import Session

LIBC = "/lib/x86_64-linux-gnu/libc.so.6"  # an ELF file with none of CUDA's functions: a library with no probe
BOUND_S = 120  # for a one-shot diagnose on a busy machine; an agent stuck on a FIFO never returns


def _mapping_process(folder: Path, then: str = "true") -> subprocess.Popen:
    """A process in a mount namespace of its own that maps folder/libcuda.so.1, then runs `then` (shell, as
    its container's root) and says "ready"."""
    script = (f"import mmap, os, sys\nf = open('{folder}/libcuda.so.1', 'rb')\n"
              f"m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
              f"assert os.system({then!r}) == 0\nprint('ready', flush=True)\nsys.stdin.read()\n")
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", script],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


def test_a_fifo_put_at_a_library_s_path_does_not_hang_the_agent(tmp_path, processes):
    """After mapping its libcuda.so.1 the process's container hides the file under a FIFO of the same name (a
    tmpfs over its folder): the agent reads the file mapped, not what the name now is."""
    shutil.copyfile(LIBC, tmp_path / "libcuda.so.1")
    proc = _mapping_process(tmp_path, f"mount -t tmpfs none {tmp_path} && mkfifo {tmp_path}/libcuda.so.1")
    processes.append(proc)
    started = time.monotonic()
    result = subprocess.run([*RANKSCOPE, "diagnose", "--pid", str(proc.pid), "--duration", "1", "--json"],
                            capture_output=True, text=True, timeout=BOUND_S)
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < BOUND_S


@pytest.mark.parametrize("section", [".dynstr", ".dynsym"])
def test_a_crafted_libcuda_leaves_the_process_unwatched_with_one_line(tmp_path, processes, section):
    """The process maps a libcuda.so.1 whose symbol table claims a terabyte: not watched, said in one line,
    and the session goes on watching others."""
    crafted(LIBC, tmp_path / "libcuda.so.1", section, sh_size=HUGE)
    proc = _mapping_process(tmp_path)
    processes.append(proc)
    error = one_line_error(subprocess.run([*RANKSCOPE, "diagnose", "--pid", str(proc.pid), "--duration", "1"],
                                          capture_output=True, text=True, timeout=BOUND_S))
    assert "reaches past the end of the file" in error
    healthy = tmp_path / "healthy"
    healthy.mkdir()
    shutil.copyfile(LIBC, healthy / "libcuda.so.1")
    other = _mapping_process(healthy)
    processes.append(other)
    session = Session()
    try:
        with pytest.raises((ProbeError, TargetError)):
            session.add(proc.pid)
        assert session.add(other.pid).pid == other.pid
    finally:
        session.close()
