"""Builds librankscope_cupti.so with gcc against the CUPTI/CUDA headers of NVIDIA's pip wheels: the CUPTI
shim (shim.c, loaded by CUDA) and the NCCL profiler plugin (nccl_profiler.c, loaded by NCCL) in one library,
with the flush-period thread both use (periodic.c).

Cached per source and flags hash like the simulator's stand-ins; called by scripts/install and the tests."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from rankscope.sim.build import CC, BuildError, cache_root

from . import wheels

HERE = Path(__file__).resolve().parent
SOURCES = tuple(HERE / name for name in ("shim.c", "nccl_profiler.c", "periodic.c"))
HEADERS = (HERE / "periodic.h",)
LIBRARY = "librankscope_cupti.so"
# -z nodelete: NCCL dlcloses its plugin with its last communicator while the plugin's watcher thread runs.
CFLAGS = ("-O2", "-fPIC", "-shared", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden",
          "-Wl,-z,nodelete")


def include_dirs() -> list[Path]:
    """cupti.h, cuda.h and crt/host_defines.h, from the three wheels that ship them."""
    return [wheels.extract(wheels.CUPTI, ("nvidia/cuda_cupti/include/",)) / "nvidia/cuda_cupti/include",
            wheels.extract(wheels.RUNTIME, ("nvidia/cuda_runtime/include/",)) / "nvidia/cuda_runtime/include",
            wheels.extract(wheels.NVCC, ("nvidia/cuda_nvcc/include/",)) / "nvidia/cuda_nvcc/include"]


def cupti_library() -> Path:
    """The real libcupti.so.12 of the wheel the shim is built against (tests load it without a GPU)."""
    return wheels.extract(wheels.CUPTI, ("nvidia/cuda_cupti/lib/",)) / "nvidia/cuda_cupti/lib/libcupti.so.12"


def build_shim() -> Path:
    """Path of the compiled shim, rebuilt when its source, flags or pinned wheels change."""
    h = hashlib.sha256(repr((CC, CFLAGS, wheels.CUPTI, wheels.RUNTIME, wheels.NVCC)).encode())
    for source in (*SOURCES, *HEADERS):
        h.update(source.read_bytes())
    final = cache_root() / f"cupti-shim-{h.hexdigest()[:16]}" / LIBRARY
    if final.is_file():
        return final
    try:
        includes = include_dirs()
    except wheels.WheelError as e:
        raise BuildError(f"cannot get the CUPTI headers: {e}") from e
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{LIBRARY}-", dir=final.parent)
    os.close(fd)
    cmd = [CC, *CFLAGS, *(f"-I{d}" for d in includes), "-o", tmp, *map(str, SOURCES), "-ldl", "-pthread"]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise BuildError(f"compiling the CUPTI shim failed ({' '.join(cmd)}):\n{result.stderr.strip()}")
        os.chmod(tmp, 0o755)
        os.rename(tmp, final)  # atomic: concurrent builders each install a complete file
    except FileNotFoundError as e:
        raise BuildError(f"cannot build the CUPTI shim: compiler {CC!r} not found (install gcc)") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final


if __name__ == "__main__":
    print(build_shim())
