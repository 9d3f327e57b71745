"""rankscope: which rank, function and component slows a training job, found with eBPF while it runs."""
from __future__ import annotations

import functools

__version__ = "0.1.0"  # what a source tree without installed metadata reports; pyproject.toml's version


@functools.cache
def version() -> str:
    """The installed package's version, read once (the metadata lookup scans sys.path: ~1.4 ms), else
    `__version__`."""
    from importlib import metadata  # here: loading it costs every command ~0.05 s

    try:
        return metadata.version("rankscope")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return __version__
