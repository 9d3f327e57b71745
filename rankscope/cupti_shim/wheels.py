"""NVIDIA's pip wheels as a source of headers and libraries, without a CUDA toolkit.

Wheels are downloaded once into a cache folder (kept between runs: each nccl's is ~310 MB) and the members
needed are extracted next to them, so building the shim or testing against the real libnccl works on a
fresh machine with only PyPI reachable.

Trust: each wheel is pinned by its sha256 (wheels.sha256) as well as its version, and is used only when its
bytes match: a cached wheel that does not is fetched again, a download that does not is refused. An
extracted member is used only when it matches the sha256 its verified wheel's RECORD gives it, else it is
extracted again. Hashing is paid once a process for a file left unchanged (the nccl wheel and
its library: ~1 s of CPU together)."""
from __future__ import annotations

import base64
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from functools import cache
from pathlib import Path

from rankscope.native import cache_root, file_matches

log = logging.getLogger(__name__)

PINS = Path(__file__).resolve().parent / "wheels.sha256"
# The glibc baselines NVIDIA's wheels are tagged with (cu12: manylinux1 to 2014; CUDA 13's: 2_25 to 2_28); pip
# matches --platform tags exactly, so each is named.
PLATFORMS = ("manylinux1_x86_64", "manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_18_x86_64",
             "manylinux_2_25_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64")


class WheelError(RuntimeError):
    """A wheel could not be downloaded or read, or its bytes are not the pinned ones (the message says which
    and why)."""


def wheel_dir() -> Path:
    return cache_root() / "wheels"


@cache
def pins(path: Path) -> dict[str, str]:
    """Wheel file name -> sha256, from a `sha256sum`-style file (# comments)."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            digest, name = line.split(maxsplit=1)
            out[name.strip()] = digest.lower()
    return out


def pinned(requirement: str) -> tuple[str, str]:
    """(file name, sha256) of the wheel pinned for `name==version`."""
    name, version = requirement.split("==")
    prefix = f"{name.replace('-', '_')}-{version}-"
    found = [(file, digest) for file, digest in pins(PINS).items() if file.lower().startswith(prefix.lower())]
    if len(found) != 1:
        raise WheelError(f"{len(found)} wheels of {requirement} pinned in {PINS.name}: one is needed (its sha256)")
    return found[0]


def wheel(requirement: str) -> Path:
    """The cached wheel file of a pinned `name==version` requirement, its bytes the pinned ones: downloaded
    with pip when absent or when the cached file's bytes differ."""
    file, digest = pinned(requirement)
    path = wheel_dir() / file
    if path.is_file():
        if file_matches(path, digest):
            return path
        log.warning("cached wheel %s does not match its pinned sha256: fetching it again", path)
        path.unlink()
    wheel_dir().mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=wheel_dir()))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", *(f"--platform={p}" for p in PLATFORMS), "-d", str(tmp), requirement]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if result.returncode != 0 or not (tmp / file).is_file():
            got = ", ".join(p.name for p in tmp.iterdir()) or "nothing"
            raise WheelError(f"cannot download {file} ({requirement}; got {got}): {result.stderr.strip()[-500:]}")
        if not file_matches(tmp / file, digest):
            raise WheelError(f"downloaded {file} does not match its pinned sha256 {digest}: refused")
        os.replace(tmp / file, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def extract(requirement: str, prefixes: tuple[str, ...]) -> Path:
    """Extracts the wheel's members under `prefixes` (e.g. 'nvidia/cuda_cupti/include/') into a folder
    named after the wheel; returns that folder (the members keep their paths inside it). A member already
    there is kept when it matches its RECORD sha256, else extracted again."""
    whl = wheel(requirement)
    out = whl.with_suffix("")
    redone = 0
    try:
        with zipfile.ZipFile(whl) as z:
            record = _record(z)
            for member in z.namelist():
                if not member.startswith(prefixes) or member.endswith("/"):
                    continue
                if member not in record:
                    raise WheelError(f"{whl.name}: {member} has no sha256 in its RECORD")
                target = out / member
                if target.is_file() and file_matches(target, record[member]):
                    continue
                redone += target.exists()
                z.extract(member, out)
                if not file_matches(target, record[member]):
                    raise WheelError(f"{whl.name}: {member} does not match its RECORD sha256")
    except (OSError, zipfile.BadZipFile) as e:
        raise WheelError(f"cannot extract {whl}: {e}") from e
    if redone:
        log.warning("%d files extracted from %s did not match its RECORD: extracted again", redone, whl.name)
    return out


def _record(z: zipfile.ZipFile) -> dict[str, str]:
    """Member -> sha256 (hex), from the wheel's .dist-info/RECORD."""
    name = next((n for n in z.namelist() if n.endswith(".dist-info/RECORD")), None)
    if name is None:
        raise WheelError(f"{z.filename} has no RECORD")
    out = {}
    for line in z.read(name).decode().splitlines():
        member, digest, _ = line.rsplit(",", 2)
        if digest.startswith("sha256="):
            out[member] = base64.urlsafe_b64decode(digest[7:] + "=" * (-len(digest[7:]) % 4)).hex()
    return out
