"""The GPU kit's comparison of the CUPTI shim's kernel records with torch.profiler's kernels: the shim's steps
are those between the two marker kernels; times per step, counts and the top kernels by demangled name."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from gpu_kit.steps import KIND_MEMCPY, MARKER, PROFILE_STEPS, between_markers, compare  # noqa: E402

KERNEL, KIND_KERNEL = "_Z4gemmPKfPf", 10


def record(start: int, end: int, name: str | None = KERNEL, kind: int = KIND_KERNEL) -> dict:
    r = {"kind": kind, "start": start, "end": end}
    if name is not None:
        r["name"] = name
    return r


def test_kernels_between_the_markers_only():
    records = [record(0, 50), record(100, 200, f"_ZN2at4cuda11{MARKER}El"), record(250, 300),
               record(300, 310, None, KIND_MEMCPY), record(320, 400), record(500, 600, f"_ZN2at4cuda11{MARKER}El"),
               record(700, 800)]
    kernels, markers = between_markers(records)
    assert markers == 2
    assert kernels == [record(250, 300), record(320, 400)]
    assert between_markers(records[:3]) == (None, 1)


def test_shim_against_profiler_per_step():
    # Each step: one 40 us gemm. The shim's records are ns on the GPU's clock, the profiler's durations us.
    kernels = [record(i * 1000, i * 1000 + 40_000) for i in range(PROFILE_STEPS)]
    profiled = [{"name": "gemm(float const*, float*)", "ts": i, "dur": 41.0} for i in range(PROFILE_STEPS)]
    figures = compare(kernels, profiled)
    assert figures["kernel_counts_equal"] and figures["shim_kernels_per_step"] == 1
    assert figures["shim_kernel_ms_per_step"] == 0.04 and figures["profiler_kernel_ms_per_step"] == 0.041
    assert figures["difference"] == round(40 / 41 - 1, 4)
    assert figures["top_kernels_us"] == {"gemm(float const*, float*)": {"shim_mean": 40.0, "profiler_mean": 41.0}}
    assert not compare(kernels[1:], profiled)["kernel_counts_equal"]
