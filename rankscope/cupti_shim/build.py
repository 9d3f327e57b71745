"""Builds the shim library of each CUDA line, librankscope_cupti12.so and librankscope_cupti13.so, with gcc
against that line's CUPTI/CUDA headers from NVIDIA's pip wheels (cuda_lines.py): the CUPTI shim (shim.c,
loaded by CUDA) and the NCCL profiler plugin (nccl_profiler.c, loaded by NCCL, the same in both) in one
library, with the flush-period thread both use (periodic.c).

Cached per source, flags and pins hash (rankscope.native); called by scripts/install and the tests."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from rankscope.cupti_shim import wheels
from rankscope.cupti_shim.cuda_lines import BY_MAJOR, LINES, CudaLine
from rankscope.native import CC, BuildError, cached_build, fingerprint, run_compiler, write_sums

HERE = Path(__file__).resolve().parent
SOURCES = tuple(HERE / name for name in ("shim.c", "nccl_profiler.c", "periodic.c"))
HEADERS = (HERE / "periodic.h",)
# -z nodelete: NCCL dlcloses its plugin with its last communicator while the plugin's watcher thread runs.
CFLAGS = ("-O2", "-fPIC", "-shared", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden",
          "-Wl,-z,nodelete")


def _line_flags(line: CudaLine) -> tuple[str, ...]:
    """What the shim is told about its line: the libcupti it opens and the CUPTI API versions it accepts."""
    low, high = line.cupti_api
    return (f"-DRANKSCOPE_CUPTI_MAJOR={line.major}", f"-DRANKSCOPE_CUPTI_API_MIN={low}",
            f"-DRANKSCOPE_CUPTI_API_MAX={high}")


def build_shim(major: int) -> Path:
    """Path of the compiled shim of CUDA `major`, rebuilt when its source, flags or pinned wheels change."""
    line = BY_MAJOR[major]
    flags = (*CFLAGS, *_line_flags(line))
    pins = (line.cupti, line.runtime, line.host_defines)
    name = f"cupti-shim{major}-{fingerprint((CC, flags, pins), (*SOURCES, *HEADERS))}"

    def compile_into(folder: Path) -> None:
        try:
            includes = line.include_dirs()
        except wheels.WheelError as e:
            raise BuildError(f"cannot get the CUDA {major} CUPTI headers: {e}") from e
        run_compiler([CC, *flags, *(f"-I{d}" for d in includes), "-o", str(folder / line.shim_name),
                      *map(str, SOURCES), "-ldl", "-pthread"], f"the CUDA {major} CUPTI shim")

    return cached_build(name, (line.shim_name,), compile_into) / line.shim_name


def build_shims() -> list[Path]:
    """Every line's shim: what a node needs for jobs of either CUDA major."""
    return [build_shim(line.major) for line in LINES]


def install_shims(folder: Path) -> list[Path]:
    """Every line's shim copied into `folder`, with the SHA256SUMS that $RANKSCOPE_SHIM_DIR is checked
    against before a shim from it is loaded into a job."""
    folder.mkdir(parents=True, exist_ok=True)
    copied = [Path(shutil.copy2(shim, folder / shim.name)) for shim in build_shims()]
    write_sums(folder, [p.name for p in copied])
    return copied


if __name__ == "__main__":
    # build.py: every shim's path; build.py MAJOR: that line's; build.py --into DIR: install_shims(DIR).
    if sys.argv[1:2] == ["--into"]:
        shims = install_shims(Path(sys.argv[2]))
    else:
        shims = build_shims() if len(sys.argv) < 2 else [build_shim(int(sys.argv[1]))]
    print("\n".join(map(str, shims)))
