"""The CUDA major lines rankscope builds for (12 and 13), each from its own NVIDIA pip wheels: the pins, and
where in them the headers and libraries sit (cu12 wheels use nvidia/cuda_<component>/, CUDA 13's nvidia/cu13/).

A job loads the shim of its libcupti's major. CUPTI hands over activity records in its own layout and the
shim reads them with the record types of the headers it was compiled against, so it accepts only a loaded
CUPTI whose API version lies in `cupti_api`: the releases whose headers were compared field by field with the
pinned ones (`checked_cupti`, compared by tests/system/test_cupti_layouts.py)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rankscope.cupti_shim import wheels


@dataclass(frozen=True)
class CudaLine:
    major: int
    cupti: str  # pinned requirements: cupti.h and its record types, libcupti.so.MAJOR
    runtime: str  # cuda.h (cupti.h includes it), libcudart.so.MAJOR
    host_defines: str  # crt/host_defines.h, which cuda.h's headers include
    nccl: str  # the line's libnccl.so.2
    cupti_api: tuple[int, int]  # CUPTI API versions (cuptiGetVersion) the shim accepts, inclusive
    checked_cupti: tuple[str, ...]  # the other CUPTI releases of the range, compared with the pinned one

    @property
    def shim_name(self) -> str:
        return f"librankscope_cupti{self.major}.so"

    def _folder(self, requirement: str, component: str, kind: str) -> Path:
        """A folder of a wheel's members (extracted once), e.g. the include/ of the CUPTI wheel."""
        folder = f"nvidia/cu{self.major}/{kind}/" if self.major >= 13 else f"nvidia/cuda_{component}/{kind}/"
        return wheels.extract(requirement, (folder,)) / folder

    def cupti_include(self, requirement: str | None = None) -> Path:
        """cupti.h's folder, of the pinned CUPTI or of `requirement` (another release of the line)."""
        return self._folder(requirement or self.cupti, "cupti", "include")

    def include_dirs(self) -> list[Path]:
        return [self.cupti_include(), self._folder(self.runtime, "runtime", "include"),
                self._folder(self.host_defines, "nvcc", "include")]

    def libcupti(self) -> Path:
        return self._folder(self.cupti, "cupti", "lib") / f"libcupti.so.{self.major}"

    def libcudart(self) -> Path:
        return self._folder(self.runtime, "runtime", "lib") / f"libcudart.so.{self.major}"

    def libnccl(self) -> Path:
        return wheels.extract(self.nccl, ("nvidia/nccl/lib/",)) / "nvidia/nccl/lib/libnccl.so.2"


LINES: tuple[CudaLine, ...] = (
    CudaLine(12, cupti="nvidia-cuda-cupti-cu12==12.8.90", runtime="nvidia-cuda-runtime-cu12==12.9.79",
             host_defines="nvidia-cuda-nvcc-cu12==12.9.86", nccl="nvidia-nccl-cu12==2.27.7",
             cupti_api=(18, 28),  # CUDA 12.0 .. 12.9 Update 1
             checked_cupti=tuple(f"nvidia-cuda-cupti-cu12=={v}"
                                 for v in ("12.0.146", "12.4.127", "12.6.80", "12.9.79"))),
    CudaLine(13, cupti="nvidia-cuda-cupti==13.0.85", runtime="nvidia-cuda-runtime==13.0.96",
             host_defines="nvidia-cuda-crt==13.0.88", nccl="nvidia-nccl-cu13==2.32.3",
             cupti_api=(130000, 130500),  # CUDA 13.0 .. 13.5
             checked_cupti=tuple(f"nvidia-cuda-cupti=={v}" for v in ("13.0.48", "13.2.86", "13.4.92", "13.5.25"))),
)
BY_MAJOR: dict[int, CudaLine] = {line.major: line for line in LINES}
