"""NVIDIA's pip wheels as a source of headers and libraries, without a CUDA toolkit.

Wheels are downloaded once into a cache folder (kept between runs: nccl's is ~320 MB) and the members
needed are extracted next to them, so building the shim or testing against the real libnccl works on a
fresh machine with only PyPI reachable."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from rankscope.native import cache_root

# Pinned so a build is reproducible; the headers' record layouts are what the shim is compiled against.
CUPTI = "nvidia-cuda-cupti-cu12==12.8.90"
RUNTIME = "nvidia-cuda-runtime-cu12==12.9.79"  # cuda.h, libcudart.so.12
NVCC = "nvidia-cuda-nvcc-cu12==12.9.86"  # crt/host_defines.h, which cuda.h's headers include
NCCL = "nvidia-nccl-cu12==2.27.7"


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
           "--only-binary=:all:", "--platform", "manylinux2014_x86_64", "-d", str(wheel_dir()), requirement]
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
