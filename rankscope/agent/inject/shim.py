"""The CUPTI shim brought into a running job that was not started with CUDA_INJECTION64_PATH: the shim of the
job's CUDA major (the libcudart.so.N or libcupti.so.N it maps) is loaded and its late-attach entry point
called, which sets CUPTI up on a thread of the shim's own. Kernels launched from then on are recorded;
NCCL's profiler plugin (the same library) is not: NCCL reads NCCL_PROFILER_PLUGIN once, at its init."""
from __future__ import annotations

import fnmatch
import logging
import os
import re
from pathlib import Path

from rankscope.agent.host import procfs
from rankscope.agent.host.containers import parse_cgroup
from rankscope.agent.host.targets import TargetError, environment
from rankscope.agent.inject.inject import DEFAULT_TIMEOUT_S, Injection, InjectError, inject
from rankscope.agent.sources.probes.cupti import SHIM_LIBRARY
from rankscope.cupti_shim.build import build_shim
from rankscope.cupti_shim.cuda_lines import BY_MAJOR, LINES
from rankscope.native import SUMS, BuildError, sums_mismatch

log = logging.getLogger(__name__)

ENTRY = "rankscope_shim_attach"
SHIM_DIR_ENV = "RANKSCOPE_SHIM_DIR"
INJECTION_ENV = "CUDA_INJECTION64_PATH"
CUDA_MAJOR_OF = re.compile(r"^lib(?:cudart|cupti)\.so\.(\d+)")  # the job's CUDA line, from what it maps


def cuda_major(pid: int) -> int | None:
    """The CUDA major of the runtime or CUPTI `pid` maps, when rankscope has a shim for it."""
    try:
        names = [m.name for m in procfs.maps(pid)]
    except OSError as e:
        raise InjectError(f"cannot read /proc/{pid}/maps: {e.strerror}") from e
    for name in names:
        m = CUDA_MAJOR_OF.match(name)
        if m and int(m.group(1)) in BY_MAJOR:
            return int(m.group(1))
    return None


def shim_library(major: int) -> str:
    """The shim of CUDA `major`: in $RANKSCOPE_SHIM_DIR when set (the image's /opt/rankscope/lib), used only
    when it matches that folder's SHA256SUMS (written with it: build.py --into); else built into the cache."""
    line = BY_MAJOR[major]
    folder = os.environ.get(SHIM_DIR_ENV)
    if folder:
        path = os.path.join(folder, line.shim_name)
        if not os.path.isfile(path):
            raise InjectError(f"no {line.shim_name} in ${SHIM_DIR_ENV} ({folder})")
        wrong = sums_mismatch(Path(folder), (line.shim_name,))
        if wrong:
            raise InjectError(f"not loading {path}: {wrong} (the folder's {SUMS} is written with its shims)")
        return path
    try:
        return str(build_shim(major))
    except BuildError as e:
        raise InjectError(f"cannot build the CUDA {major} shim: {e}") from e


def allowed(pid: int, patterns: tuple[str, ...]) -> bool:
    """Whether `pid` is among the processes `--inject-allow` names: one of its cgroup paths, its container's
    id or its pod's UID matches one of the shell patterns (fnmatch). No patterns: every process."""
    if not patterns:
        return True
    try:
        text = procfs.cgroup(pid)
    except OSError:
        return False
    container = parse_cgroup(text)
    names = [line.split(":", 2)[2] for line in text.splitlines() if line.count(":") >= 2]
    if container is not None:
        names += [n for n in (container.container_id, container.pod_uid) if n]
    return any(fnmatch.fnmatchcase(name, pattern) for name in names for pattern in patterns)


def inject_shim(pid: int, timeout_s: float = DEFAULT_TIMEOUT_S, start_time: int | None = None) -> Injection:
    """Loads the shim into `pid` (a no-op when any rankscope shim is mapped); InjectError says why not.
    `start_time`: the process as it was watched (inject.pin)."""
    try:
        mapped = next((m.path for m in procfs.maps(pid) if SHIM_LIBRARY.match(m.name)), None)
    except OSError as e:
        raise InjectError(f"cannot read /proc/{pid}/maps: {e.strerror}") from e
    if mapped is not None:
        log.info("pid %d: a CUPTI shim is already loaded (%s): nothing done", pid, mapped)
        return Injection(pid, mapped, loaded=False)
    try:
        opted_in = environment(pid).get(INJECTION_ENV)
    except TargetError as e:
        raise InjectError(str(e)) from e
    if opted_in:  # CUDA loads that library at cuInit (the shim, or another tool holding CUPTI): not twice
        raise InjectError(f"process {pid} names {opted_in} in {INJECTION_ENV}: CUDA loads it at cuInit; "
                          f"nothing done")
    major = cuda_major(pid)
    if major is None:  # e.g. a job that has not loaded its CUDA runtime yet: the newest line's shim
        major = LINES[-1].major
        log.info("pid %d maps no libcudart/libcupti: loading the CUDA %d shim", pid, major)
    library = shim_library(major)
    injection = inject(pid, library, ENTRY, timeout_s, start_time)
    if injection.result != 0:
        log.warning("pid %d: the CUPTI shim is loaded but could not start its set-up thread (error %d)",
                    pid, injection.result)
    else:
        log.info("pid %d: CUPTI shim loaded from %s (one thread held %.2f ms, %d tries)", pid, injection.library,
                 injection.stop_s * 1e3, injection.tries)
    return injection
