"""Which container and Kubernetes pod a process runs in, from its cgroup path (/proc/PID/cgroup).

Kubelet names pod cgroups after the pod UID (`pod<uid>`; with the systemd driver `..._pod<uid_with_underscores>.slice`)
and container runtimes name theirs after the 64-hex container id (`<id>`, `cri-containerd-<id>.scope`,
`crio-<id>.scope`, `docker-<id>.scope`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from rankscope.agent.host import procfs

_POD = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?:\.slice)?$")
_CONTAINER = re.compile(r"^(?:(cri-containerd|crio|docker|libpod)-)?([0-9a-f]{64})(?:\.scope)?$")


@dataclass(frozen=True)
class Container:
    cgroup: str  # the cgroup v2 path (or the v1 path of the first controller that names a container)
    container_id: str | None = None  # 64 hex
    runtime: str | None = None  # "cri-containerd" | "crio" | "docker" | "libpod" | None (cgroupfs driver)
    pod_uid: str | None = None  # Kubernetes pod UID, dashed


def parse_cgroup(text: str) -> Container | None:
    """The container of a /proc/PID/cgroup text; None for a process outside any container."""
    paths = [line.split(":", 2)[2] for line in text.splitlines() if line.count(":") >= 2]
    for path in sorted(paths, key=lambda p: not p.startswith("/kubepods")):  # a kubepods path says most
        pod_uid = container_id = runtime = None
        for part in path.split("/"):
            if m := _POD.search(part):
                pod_uid = m.group(1).replace("_", "-")
            elif m := _CONTAINER.match(part):
                runtime, container_id = m.group(1), m.group(2)
        if pod_uid or container_id:
            return Container(cgroup=path, container_id=container_id, runtime=runtime, pod_uid=pod_uid)
    return None


def container_of(pid: int) -> Container | None:
    try:
        return parse_cgroup(procfs.cgroup(pid))
    except OSError:  # exited: nothing to attribute
        return None
