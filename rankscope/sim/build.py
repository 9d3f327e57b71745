"""Compiles the stand-in libcuda.so.1, libnccl.so.2 and libcudart.so.12 into a per-source-hash cache folder."""
from __future__ import annotations

from pathlib import Path

from rankscope.native import CC, BuildError, cached_build, fingerprint, run_compiler

__all__ = ["BuildError", "build_libraries"]

SOURCE_DIR = Path(__file__).resolve().parent
HEADERS = ("rsim.h",)
CFLAGS = ("-O2", "-fPIC", "-shared", "-fno-omit-frame-pointer", "-std=gnu11", "-Wall", "-Wextra", "-pthread")
# libcuda first: libnccl and libcudart link against it (DT_NEEDED libcuda.so.1, found next to it through
# $ORIGIN).
_ON_LIBCUDA = ("-L.", "-l:libcuda.so.1", "-Wl,-rpath,$ORIGIN")
LIBRARIES = (
    ("libcuda.so.1", "libcuda.c", ()),
    ("libnccl.so.2", "libnccl.c", _ON_LIBCUDA),
    ("libcudart.so.12", "libcudart.c", _ON_LIBCUDA),
)


def _compile(out_dir: Path) -> None:
    for lib, src, extra in LIBRARIES:
        cmd = [CC, *CFLAGS, f"-Wl,-soname,{lib}", "-I", str(SOURCE_DIR), "-o", lib, str(SOURCE_DIR / src), *extra]
        run_compiler(cmd, f"the simulator's {src}", cwd=out_dir)


def build_libraries() -> Path:
    """Folder holding the stand-in libraries, compiled when the sources (or flags) changed."""
    sources = (SOURCE_DIR / name for name in (*HEADERS, *(src for _, src, _ in LIBRARIES)))
    name = f"sim-{fingerprint((CC, CFLAGS, LIBRARIES), sources)}"
    return cached_build(name, (lib for lib, _, _ in LIBRARIES), _compile)


if __name__ == "__main__":
    print(build_libraries())
