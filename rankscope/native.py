"""Native code rankscope compiles for itself (the CUPTI shim; the simulator's stand-in libraries): gcc into a
cache folder named by a hash of its sources and flags, installed whole or not at all.

Each folder carries SHA256SUMS, its outputs' sha256 written when they were built; a folder whose outputs do
not match it (or that lacks it) is built again rather than loaded. Hashing is paid once a process for a file
left unchanged."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

log = logging.getLogger(__name__)

CC = os.environ.get("RANKSCOPE_CC", "gcc")
SUMS = "SHA256SUMS"  # in a folder of built or shipped libraries: `sha256sum` lines of its files
CHUNK = 1 << 20

# Files whose sha256 matched, by path: the (inode, size, mtime) they had then; a change hashes them again.
_matched: dict[Path, tuple[int, int, int]] = {}


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
    """cache_root()/name holding `outputs`, made by build(folder) when any is missing or does not match the
    folder's SHA256SUMS.

    Builds into a temporary folder renamed into place, so concurrent builders are safe and a failed build
    leaves nothing behind.
    """
    outputs = tuple(outputs)
    root = cache_root()
    final = root / name
    if sums_mismatch(final, outputs) is None:
        return final
    if final.exists():
        log.warning("cached build %s: %s; building it again", final, sums_mismatch(final, outputs))
        _discard(final)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuildError(f"cannot create the cache folder {root}: {e.strerror}") from e
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        build(tmp)
        write_sums(tmp, outputs)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            # Someone else finished first (the folder exists and is not empty): use theirs. A folder left
            # incomplete or changed by some other tool is replaced.
            if sums_mismatch(final, outputs) is not None:
                _discard(final)
                os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def write_sums(folder: Path, names: Iterable[str]) -> None:
    """Writes folder/SHA256SUMS for the files `names` in it."""
    lines = [f"{sha256_of(folder / n)}  {n}\n" for n in names]
    (folder / SUMS).write_text("".join(lines))


def sums_mismatch(folder: Path, names: Iterable[str]) -> str | None:
    """What is wrong with the files `names` in `folder` against its SHA256SUMS (absent, unlisted, changed),
    or None when each matches."""
    try:
        listed = dict(reversed(line.split(maxsplit=1)) for line in (folder / SUMS).read_text().splitlines()
                      if line.strip())
    except (OSError, ValueError):
        return f"no readable {SUMS}"
    for n in names:
        if n not in listed:
            return f"{n} is not in {SUMS}"
        if not (folder / n).is_file() or not file_matches(folder / n, listed[n]):
            return f"{n} does not match its sha256 in {SUMS}"
    return None


def file_matches(path: Path, digest: str) -> bool:
    """Whether `path`'s bytes have sha256 `digest` (hex); hashed once a process while the file is unchanged."""
    st = path.stat()
    signature = (st.st_ino, st.st_size, st.st_mtime_ns)
    if _matched.get(path) == signature:
        return True
    if sha256_of(path) != digest.lower():
        return False
    _matched[path] = signature
    return True


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _discard(folder: Path) -> None:
    """Removes a cache folder: renamed aside first, so no process finds it half removed."""
    aside = folder.with_name(f".stale-{folder.name}-{os.getpid()}")
    try:
        os.rename(folder, aside)
    except OSError:
        return  # gone already (another process discarded it)
    shutil.rmtree(aside, ignore_errors=True)
