"""Compiles the stand-in libcuda.so.1, libnccl.so.2 and libcudart.so.12 into a per-source-hash cache folder."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
HEADERS = ("rsim.h",)
CC = os.environ.get("RANKSCOPE_SIM_CC", "gcc")
CFLAGS = ("-O2", "-fPIC", "-shared", "-fno-omit-frame-pointer", "-std=gnu11", "-Wall", "-Wextra", "-pthread")
# libcuda first: libnccl and libcudart link against it (DT_NEEDED libcuda.so.1, found next to it through
# $ORIGIN).
_ON_LIBCUDA = ("-L.", "-l:libcuda.so.1", "-Wl,-rpath,$ORIGIN")
LIBRARIES = (
    ("libcuda.so.1", "libcuda.c", ()),
    ("libnccl.so.2", "libnccl.c", _ON_LIBCUDA),
    ("libcudart.so.12", "libcudart.c", _ON_LIBCUDA),
)


class BuildError(RuntimeError):
    """The stand-in libraries could not be compiled (no compiler, or it failed: the message has its stderr)."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rankscope"


def _fingerprint() -> str:
    h = hashlib.sha256()
    h.update(repr((CC, CFLAGS, LIBRARIES)).encode())
    for name in (*HEADERS, *(src for _, src, _ in LIBRARIES)):
        h.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _compile(out_dir: Path) -> None:
    for lib, src, extra in LIBRARIES:
        cmd = [CC, *CFLAGS, f"-Wl,-soname,{lib}", "-I", str(SOURCE_DIR), "-o", lib, str(SOURCE_DIR / src), *extra]
        try:
            result = subprocess.run(cmd, cwd=out_dir, capture_output=True, text=True, timeout=120)
        except FileNotFoundError as e:
            raise BuildError(f"cannot build the simulator's stand-in libraries: compiler {CC!r} not found "
                             f"(install gcc)") from e
        except subprocess.TimeoutExpired as e:
            raise BuildError(f"compiling {src} timed out") from e
        if result.returncode != 0:
            raise BuildError(f"compiling {src} failed ({' '.join(cmd)}):\n{result.stderr.strip()}")


def build_libraries() -> Path:
    """Folder holding the stand-in libraries, compiled when the sources (or flags) changed.

    Builds into a temporary folder renamed into place, so concurrent callers are safe.
    """
    root = cache_root()
    final = root / f"sim-{_fingerprint()}"
    if all((final / lib).is_file() for lib, _, _ in LIBRARIES):
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuildError(f"cannot create the cache folder {root}: {e.strerror}") from e
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        _compile(tmp)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            # Someone else finished first (the folder exists and is not empty): use theirs. A folder left
            # incomplete by some other tool is replaced.
            if not all((final / lib).is_file() for lib, _, _ in LIBRARIES):
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


if __name__ == "__main__":
    print(build_libraries())
