"""Builds librankscope_cupti.so with gcc against the CUPTI/CUDA headers of NVIDIA's pip wheels: the CUPTI
shim (shim.c, loaded by CUDA) and the NCCL profiler plugin (nccl_profiler.c, loaded by NCCL) in one library,
with the flush-period thread both use (periodic.c).

Cached per source and flags hash (rankscope.native); called by scripts/install and the tests."""
from __future__ import annotations

from pathlib import Path

from rankscope.cupti_shim import wheels
from rankscope.native import CC, BuildError, cached_build, fingerprint, run_compiler

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
    name = f"cupti-shim-{fingerprint((CC, CFLAGS, wheels.CUPTI, wheels.RUNTIME, wheels.NVCC), (*SOURCES, *HEADERS))}"

    def compile_into(folder: Path) -> None:
        try:
            includes = include_dirs()
        except wheels.WheelError as e:
            raise BuildError(f"cannot get the CUPTI headers: {e}") from e
        run_compiler([CC, *CFLAGS, *(f"-I{d}" for d in includes), "-o", str(folder / LIBRARY), *map(str, SOURCES),
                      "-ldl", "-pthread"], "the CUPTI shim")

    return cached_build(name, (LIBRARY,), compile_into) / LIBRARY


if __name__ == "__main__":
    print(build_shim())
