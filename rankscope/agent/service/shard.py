"""Jobs sharded over the replicas of the cluster analyzer.

A cluster too large for one analyzer runs it as a Kubernetes StatefulSet of N replicas: replica i (pod
`<name>-i`, its stable ordinal) diagnoses the jobs whose rendezvous hash over the ordinals is highest at i, so
each job has exactly one replica, every replica computes the same split from the job name alone (no
coordination), and a change of N moves only the jobs that the added or removed replica wins or held (1/N).
Every replica still pulls every agent, asking it for the patterns of its own jobs only
(`GET /v1/patterns?replica=i&replicas=N`): the bytes decoded and the ranks diagnosed split N ways.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass


MAX_REPLICAS = 1024  # each pull hashes its jobs once per replica: bounded, and far beyond any cluster's need


@dataclass(frozen=True)
class Shard:
    """Replica `index` of `replicas` (0 <= index < replicas <= MAX_REPLICAS)."""

    index: int = 0
    replicas: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= MAX_REPLICAS or not 0 <= self.index < self.replicas:
            raise ValueError(f"replica {self.index} of {self.replicas}: need 0 <= replica < replicas <= {MAX_REPLICAS}")

    def owns(self, job: str) -> bool:
        return self.replicas == 1 or owner(job, self.replicas) == self.index

    @property
    def query(self) -> dict[str, str]:
        """What a replica adds to its pulls (nothing when it is the only one: an older agent needs none)."""
        return {} if self.replicas == 1 else {"replica": str(self.index), "replicas": str(self.replicas)}


def owner(job: str, replicas: int) -> int:
    """The replica of `job`: the ordinal with the highest hash of (ordinal, job) (rendezvous hashing)."""
    return max(range(replicas), key=lambda i: hashlib.blake2b(f"{i}\0{job}".encode(), digest_size=8).digest())


def ordinal(hostname: str) -> int:
    """A StatefulSet pod's ordinal: the number its name ends with (`rankscope-analyzer-2` -> 2)."""
    m = re.search(r"-(\d+)$", hostname)
    if m is None:
        raise ValueError(f"{hostname!r} is not a StatefulSet pod name (NAME-ORDINAL)")
    return int(m.group(1))
