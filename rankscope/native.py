"""Native code rankscope compiles for itself (the CUPTI shim; the simulator's stand-in libraries): gcc into a
cache folder named by a hash of its sources and flags, installed whole or not at all."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

CC = os.environ.get("RANKSCOPE_CC", "gcc")


class BuildError(RuntimeError):
    """Native code could not be built (no compiler, or it failed: the message has its stderr)."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rankscope"


def fingerprint(settings: object, files: Iterable[Path]) -> str:
    """16 hex digits of a hash over the build settings (compiler, flags, pins) and the sources' bytes."""
    h = hashlib.sha256(repr(settings).encode())
    for path in files:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def run_compiler(cmd: list[str], what: str, cwd: Path | None = None) -> None:
    """Runs one compiler command; a missing compiler, a timeout or a failure is a BuildError naming `what`."""
    try:
        result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)
    except FileNotFoundError as e:
        raise BuildError(f"cannot build {what}: compiler {cmd[0]!r} not found (install gcc)") from e
    except subprocess.TimeoutExpired as e:
        raise BuildError(f"compiling {what} timed out") from e
    if result.returncode != 0:
        raise BuildError(f"compiling {what} failed ({' '.join(cmd)}):\n{result.stderr.strip()}")


def cached_build(name: str, outputs: Iterable[str], build: Callable[[Path], None]) -> Path:
    """cache_root()/name holding `outputs`, made by build(folder) when any is missing.

    Builds into a temporary folder renamed into place, so concurrent builders are safe and a failed build
    leaves nothing behind.
    """
    outputs = tuple(outputs)
    root = cache_root()
    final = root / name
    if all((final / out).is_file() for out in outputs):
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuildError(f"cannot create the cache folder {root}: {e.strerror}") from e
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            # Someone else finished first (the folder exists and is not empty): use theirs. A folder left
            # incomplete by some other tool is replaced.
            if not all((final / out).is_file() for out in outputs):
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
