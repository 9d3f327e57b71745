"""NVIDIA's pip wheels as a source of headers and libraries, without a CUDA toolkit.

Wheels are downloaded once into a cache folder (kept between runs: each nccl's is ~310 MB) and the members
needed are extracted next to them, so building the shim or testing against the real libnccl works on a
fresh machine with only PyPI reachable."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from rankscope.native import cache_root

# The glibc baselines NVIDIA's wheels are tagged with (cu12: manylinux1 to 2014; CUDA 13's: 2_25 to 2_28); pip
# matches --platform tags exactly, so each is named.
PLATFORMS = ("manylinux1_x86_64", "manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_18_x86_64",
             "manylinux_2_25_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64")


class WheelError(RuntimeError):
    """A wheel could not be downloaded or read (the message says which and why)."""


def wheel_dir() -> Path:
    return cache_root() / "wheels"


def wheel(requirement: str) -> Path:
    """The cached wheel file of a pinned `name==version` requirement, downloaded with pip when absent."""
    name, version = requirement.split("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    found = sorted(wheel_dir().glob(pattern))
    if found:
        return found[0]
    wheel_dir().mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", *(f"--platform={p}" for p in PLATFORMS), "-d", str(wheel_dir()), requirement]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    found = sorted(wheel_dir().glob(pattern))
    if result.returncode != 0 or not found:
        raise WheelError(f"cannot download {requirement}: {result.stderr.strip()[-500:]}")
    return found[0]


def extract(requirement: str, prefixes: tuple[str, ...]) -> Path:
    """Extracts the wheel's members under `prefixes` (e.g. 'nvidia/cuda_cupti/include/') into a folder
    named after the wheel, once; returns that folder (the members keep their paths inside it)."""
    whl = wheel(requirement)
    out = whl.with_suffix("")
    stamp = out / (".extracted-" + "-".join(p.strip("/").replace("/", "_") for p in prefixes))
    if stamp.exists():
        return out
    try:
        with zipfile.ZipFile(whl) as z:
            for member in z.namelist():
                if member.startswith(prefixes):
                    z.extract(member, out)
    except (OSError, zipfile.BadZipFile) as e:
        raise WheelError(f"cannot extract {whl}: {e}") from e
    stamp.touch()
    return out
