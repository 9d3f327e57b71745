"""`rankscope cluster`: pull every node agent's patterns each window, diagnose each job over all its nodes,
serve the result (/healthz, /v1/jobs, /v1/diagnosis, /metrics).

Agents are URLs (http://host:port); `dns+http://name:port` stands for every address the name resolves to,
re-resolved each window (a Kubernetes headless Service lists one address per node agent).
"""
from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from aiohttp import web
from yarl import URL

from rankscope.agent.service.auth import Access
from rankscope.agent.service.collector import WindowCollector
from rankscope.agent.service.history import StepHistory, Store
from rankscope.agent.service.http import MSGPACK, metrics_response, secure_app, select_diagnosis, serve_windows
from rankscope.agent.service.notify import Notifier
from rankscope.agent.service.page import add_page
from rankscope.agent.service.prometheus import build_info, exposition, finding_metrics, gauge, last_window
from rankscope.agent.service.pull import Puller, PullError
from rankscope.agent.service.shard import Shard
from rankscope.analyzer.baseline import Baseline
from rankscope.analyzer.cluster import diagnose_cluster
from rankscope.analyzer.rules.nodes import LostRanks
from rankscope.analyzer.stability import Confirmer
from rankscope.schema.patterns import RankPattern
from rankscope.schema.wire import MAX_PAYLOAD_BYTES, PatternDecodeError, decode_patterns

log = logging.getLogger(__name__)

DNS_PREFIX = "dns+"
FORGET_AFTER_WINDOWS = 60  # a node silent this long is forgotten (its job has likely been rescheduled)
# A replica of several asks an agent that served none of its jobs again once in this many windows (1 min at
# 5 s; each window asks its own 1/12 of them): a job that starts there is seen within that time, and a
# replica pulls its own agents and a twelfth of the others each window, not every agent.
RESWEEP_WINDOWS = 12
FULL_COLLECTION_WINDOWS = 60  # 5 min at 5 s: a full garbage collection then (~1 s at 100,000 ranks)


class AgentListError(ValueError):
    """An agent list entry that is not an agent URL."""


def parse_agent(text: str) -> str:
    """Validate one agent entry: http(s)://HOST[:PORT] or dns+http(s)://NAME[:PORT], nothing after."""
    entry = text.strip()
    try:
        url = URL(entry.removeprefix(DNS_PREFIX))
        ok = url.scheme in ("http", "https") and url.host and url.port and url.path in ("", "/") and not url.query_string
    except ValueError:  # unparsable, or a port out of range
        ok = False
    if not ok:
        raise AgentListError(f"agent {text!r} is not http(s)://HOST[:PORT] or dns+http(s)://NAME[:PORT]")
    return entry.rstrip("/")


def parse_agents(texts: Sequence[str]) -> list[str]:
    agents = list(dict.fromkeys(parse_agent(t) for t in texts if t.strip() and not t.lstrip().startswith("#")))
    if not agents:
        raise AgentListError("no agents given: --agents URL[,URL...] or --agents-file FILE")
    return agents


@dataclass
class AgentStatus:
    url: str
    state: str = "unknown"  # "up" | "down" | "unknown" (not pulled yet)
    error: str | None = None
    last_ok: float | None = None  # unix s of the last successful pull
    hosts: list[str] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)
    ranks: int = 0


@dataclass(frozen=True)
class _Served:
    """What an agent last served of one job: kept to tell its absence when it stops answering."""

    host: str
    ranks: tuple[int, ...]
    at: float


@dataclass(frozen=True)
class ClusterSnapshot:
    agents: list[AgentStatus] = field(default_factory=list)
    diagnoses: dict[str, dict[str, Any]] = field(default_factory=dict)
    history: StepHistory = field(default_factory=StepHistory)  # each job's windows (the page, /v1/history)
    # pull_s (wall, decoding included), diagnose_s (wall) and diagnose_cpu_s of the window
    timing: dict[str, float] = field(default_factory=dict)
    closed_at: float | None = None  # unix s when the window closed


class Cluster:
    def __init__(self, agents: Sequence[str], token: str | None, timeout_s: float, concurrency: int,
                 hang_timeout_s: float, window_s: float, shard: Shard = Shard(), history: Store | None = None,
                 notifier: Notifier | None = None, agents_tls: ssl.SSLContext | None = None):
        self.sources = list(agents)
        self.shard = shard  # this replica's jobs only
        # https agents' certificates are checked against agents_tls (None: the system's)
        self.puller = Puller({"Accept": MSGPACK, **({"Authorization": f"Bearer {token}"} if token else {})},
                             timeout_s, concurrency, MAX_PAYLOAD_BYTES, agents_tls)
        self.hang_timeout_s = hang_timeout_s
        self.baselines: dict[str, Baseline] = {}  # job -> its recent windows over all nodes
        self.confirmer = Confirmer()  # a finding is reported once it held (stability.py)
        self.history = StepHistory(store=history)
        self.notifier = notifier  # --notify-url: a POST when a finding starts and ends
        self.forget_after_s = FORGET_AFTER_WINDOWS * window_s
        self.status: dict[str, AgentStatus] = {}
        self.served: dict[str, dict[str, _Served]] = {}  # agent -> job -> what it last served
        self.snapshot = ClusterSnapshot(history=self.history)
        self.windows = 0
        self.idle: set[str] = set()  # sharded: agents whose last answer held none of this replica's jobs
        self.collector = WindowCollector(full_every=FULL_COLLECTION_WINDOWS)

    async def close(self) -> None:
        self.puller.close()
        self.history.close()
        if self.notifier is not None:
            self.notifier.close()

    async def _urls(self) -> list[str]:
        urls: list[str] = []
        loop = asyncio.get_running_loop()
        for source in self.sources:
            if not source.startswith(DNS_PREFIX):
                urls.append(source)
                continue
            url = URL(source.removeprefix(DNS_PREFIX))
            try:
                infos = await loop.getaddrinfo(url.host, url.port, type=socket.SOCK_STREAM)
            except OSError as e:
                self.status[source] = AgentStatus(source, state="down", error=f"cannot resolve {url.host}: {e}")
                continue
            self.status.pop(source, None)
            addresses = sorted({info[4][0] for info in infos})
            urls += [str(url.with_host(a)) for a in addresses]
        return list(dict.fromkeys(urls))

    async def _pull(self, url: str) -> list[RankPattern]:
        answer = await self.puller.get(url, "/v1/patterns", self.shard.query)
        if answer.status != 200:
            raise PullError(f"HTTP {answer.status}: {answer.body[:200].decode(errors='replace').strip()}")
        try:  # an agent older than sharding serves every job: the others' are some other replica's
            return [p for p in decode_patterns(answer.body) if self.shard.owns(p.job)]
        except PatternDecodeError as e:
            raise PullError(f"bad patterns: {e}") from None

    async def window(self) -> ClusterSnapshot:
        with self.collector.paused():
            return await self._window()

    async def _window(self) -> ClusterSnapshot:
        started = time.perf_counter()
        urls = await self._urls()
        asked = [u for u in urls if self._due(u)]
        results = await asyncio.gather(*(self._pull(u) for u in asked), return_exceptions=True)
        self.windows += 1
        now = time.time()
        patterns: list[RankPattern] = []
        for url, result in zip(asked, results):
            st = self.status.setdefault(url, AgentStatus(url))
            if isinstance(result, BaseException):
                if not isinstance(result, PullError):
                    raise result
                st.state, st.error = "down", str(result)
                continue
            patterns += result
            st.state, st.error, st.last_ok = "up", None, now
            st.hosts = sorted({p.host for p in result})
            st.jobs = sorted({p.job for p in result})
            st.ranks = len(result)
            served: dict[str, _Served] = {}
            for p in result:
                if p.state != "exited":
                    s = served.get(p.job)
                    served[p.job] = _Served(p.host, (s.ranks if s else ()) + (p.rank,), now)
            self.served[url] = served
            if self.shard.replicas > 1 and not result:
                self.idle.add(url)
            else:
                self.idle.discard(url)
        self._unlisted(set(urls), now)
        lost = self._lost(now)
        pulled, pulled_cpu = time.perf_counter(), time.thread_time()
        diagnoses = diagnose_cluster(patterns, lost, self.hang_timeout_s, self.baselines)
        self.baselines = {job: b for job, b in self.baselines.items() if job in diagnoses}
        self.confirmer.confirm(diagnoses)
        if self.notifier is not None:
            self.notifier.update(diagnoses)
        self.snapshot = ClusterSnapshot(agents=sorted(self.status.values(), key=lambda s: s.url),
                                        diagnoses=diagnoses, history=self.history.record(diagnoses),
                                        timing={"pull_s": pulled - started, "diagnose_s": time.perf_counter() - pulled,
                                                "diagnose_cpu_s": time.thread_time() - pulled_cpu},
                                        closed_at=time.time())
        return self.snapshot

    def _due(self, url: str) -> bool:
        """Whether this window pulls `url`: always, unless it is idle and not in its twelfth of the windows."""
        return url not in self.idle or (self.windows + zlib.crc32(url.encode())) % RESWEEP_WINDOWS == 0

    def _unlisted(self, listed: set[str], now: float) -> None:
        """Agents a DNS name no longer lists (a node or its agent pod gone) are down until forgotten."""
        for url, st in list(self.status.items()):
            if url in listed or url in self.sources:
                continue
            if now - (st.last_ok or 0.0) > self.forget_after_s:
                del self.status[url]
                self.served.pop(url, None)
            else:
                st.state, st.error = "down", "no longer listed by its DNS name"

    def _lost(self, now: float) -> dict[str, list[LostRanks]]:
        """job -> ranks of agents that served the job before and are down now."""
        lost: dict[str, list[LostRanks]] = {}
        for url, jobs in list(self.served.items()):
            st = self.status.get(url)
            if st is None or st.state == "up":
                continue
            jobs = {job: s for job, s in jobs.items() if now - s.at < self.forget_after_s}
            self.served[url] = jobs
            for job, s in jobs.items():
                lost.setdefault(job, []).append(LostRanks(url, s.host, s.ranks, s.at, st.error or "down"))
        return lost


def make_cluster_app(current: Callable[[], ClusterSnapshot], token: Access | str | None) -> web.Application:
    def agents_of(snap: ClusterSnapshot, job: str | None) -> list[dict[str, Any]]:
        return [asdict(a) for a in snap.agents if job is None or job in a.jobs or a.state != "up"]

    async def jobs(_: web.Request) -> web.Response:
        snap = current()
        return web.json_response({
            "jobs": [{"job": job, "ranks": len(doc["ranks"]), "hosts": sorted({r["host"] for r in doc["ranks"]}),
                      "findings": [f["kind"] for f in doc["findings"]]} for job, doc in sorted(snap.diagnoses.items())],
            "agents": agents_of(snap, None),
        })

    async def diagnosis(request: web.Request) -> web.Response:
        snap = current()
        doc = dict(select_diagnosis(snap.diagnoses, request))
        doc["agents"] = agents_of(snap, doc["job"])
        return web.json_response(doc)

    async def metrics(_: web.Request) -> web.Response:
        snap = current()
        states: dict[tuple[str, ...], float] = {("up",): 0, ("down",): 0}
        for a in snap.agents:
            states[(a.state,)] = states.get((a.state,), 0) + 1
        return metrics_response(exposition(snap.diagnoses, [
            build_info("cluster"),
            gauge("rankscope_cluster_agents", "Node agents by the state of their last pull.", states, ("state",)),
            gauge("rankscope_cluster_jobs", "Jobs observed over all agents.", len(snap.diagnoses)),
            last_window("cluster", socket.gethostname(), snap.closed_at),
            *finding_metrics(snap.diagnoses, snap.history.held())]))

    app = secure_app(token)
    app.router.add_get("/v1/jobs", jobs)
    app.router.add_get("/v1/diagnosis", diagnosis)
    app.router.add_get("/metrics", metrics)
    add_page(app, lambda: current().history)
    return app


async def serve_cluster(cluster: Cluster, host: str, port: int, window_s: float, access: Access,
                        tls: ssl.SSLContext | None = None) -> None:
    try:
        await serve_windows(make_cluster_app(lambda: cluster.snapshot, access), host, port, window_s,
                            cluster.window, "cluster analyzer", first=cluster.window, tls=tls)
    finally:
        await cluster.close()
