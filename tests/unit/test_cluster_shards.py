"""The cluster analyzer sharded over replicas (a StatefulSet): which replica owns a job, agents answering a
replica with its jobs only, and three replicas on loopback that together diagnose every job exactly once, each
exactly as one analyzer over every agent does."""
from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from test_analyzer import simulate
from test_cluster import TOKEN, _url, agents, cluster_cli_error, serving

from rankscope.agent.service.cluster_analyzer import RESWEEP_WINDOWS, Cluster
from rankscope.agent.service.http import make_app
from rankscope.agent.service.shard import Shard, ordinal, owner
from rankscope.agent.service.snapshot import Snapshot
from rankscope.schema.wire import decode_patterns, encode_patterns

JOBS = range(10, 16)  # each of 4 ranks on 2 nodes; job j's rank j % 4 computes slowly; 2 jobs a replica of 3


def _nodes() -> dict[str, list]:
    out: dict[str, list] = {}
    for j in JOBS:
        for p in simulate(4, job=f"job{j}", seed=j, sync_extra={j % 4: 0.02}, ranks_per_host=2):
            p.host = f"j{j}-{p.host}"
            out.setdefault(p.host, []).append(p)
    return out


NODES = _nodes()


async def _windows(urls: list[str], shard: Shard, windows: int = 3) -> dict[str, dict]:
    """The diagnoses of the last of `windows` (a finding is reported once it held over HOLD_S: three of these
    2 s windows)."""
    c = Cluster(urls, TOKEN, timeout_s=5.0, concurrency=8, hang_timeout_s=30.0, window_s=1.0, shard=shard)
    try:
        for _ in range(windows):
            snap = await c.window()
        assert all(a.state == "up" for a in snap.agents)
        return snap.diagnoses
    finally:
        await c.close()


def test_three_replicas_diagnose_each_job_once_as_one_analyzer_does():
    async def go():
        async with agents(NODES) as servers:
            urls = [_url(s) for s in servers.values()]
            one = await _windows(urls, Shard())
            shards = [await _windows(urls, Shard(i, 3)) for i in range(3)]
        return one, shards

    one, shards = asyncio.run(go())
    assert sorted(one) == sorted(f"job{j}" for j in JOBS)
    assert all(one[f"job{j}"]["findings"][0]["ranks"] == [j % 4] for j in JOBS)
    counts = Counter(job for docs in shards for job in docs)
    assert counts == Counter(set(one))  # each job by exactly one replica
    for i, docs in enumerate(shards):
        assert all(owner(job, 3) == i for job in docs)
        assert docs == {job: one[job] for job in docs}  # the same document, findings, costs and all
    assert [len(docs) for docs in shards] == [2, 2, 2]


def test_an_agent_serves_a_replica_its_jobs_only():
    async def go():
        patterns = [p for ps in NODES.values() for p in ps]
        async with TestClient(TestServer(make_app(lambda: Snapshot(patterns=patterns), TOKEN))) as api:
            auth = {"Authorization": f"Bearer {TOKEN}", "Accept": "application/msgpack"}

            async def jobs(query: str) -> set[str]:
                r = await api.get(f"/v1/patterns{query}", headers=auth)
                assert r.status == 200
                return {p.job for p in decode_patterns(await r.read())}

            every = await jobs("")
            split = [await jobs(f"?replica={i}&replicas=3") for i in range(3)]
            bad = [(await api.get(f"/v1/patterns{q}", headers=auth)).status
                   for q in ("?replica=3&replicas=3", "?replica=0", "?replica=x&replicas=2")]
        return every, split, bad

    every, split, bad = asyncio.run(go())
    assert len(every) == len(JOBS) and set().union(*split) == every and sum(map(len, split)) == len(JOBS)
    assert bad == [400, 400, 400]


def test_a_replica_asks_agents_without_its_jobs_once_in_a_while():
    asked: Counter = Counter()
    payloads = {host: encode_patterns(ps) for host, ps in NODES.items()}

    def app(host: str) -> web.Application:  # an agent that ignores the replica's filter, as older ones do
        async def patterns(_):
            asked[host] += 1
            return web.Response(body=payloads[host], content_type="application/msgpack")

        a = web.Application()
        a.router.add_get("/v1/patterns", patterns)
        return a

    async def go():
        async with serving(*(app(h) for h in NODES)) as servers:
            c = Cluster([_url(s) for s in servers], None, 5.0, 8, 30.0, 1.0, Shard(0, 3))
            try:
                snaps = [await c.window() for _ in range(1 + RESWEEP_WINDOWS)]
            finally:
                await c.close()
        return snaps

    snaps = asyncio.run(go())
    mine = {h for h in NODES if owner(NODES[h][0].job, 3) == 0}
    assert mine and set(NODES) - mine
    assert all(asked[h] == 1 + RESWEEP_WINDOWS for h in mine)  # its own agents: every window
    assert all(asked[h] == 2 for h in set(NODES) - mine)  # the others: the first window and once in 12
    assert {p for s in snaps[1:] for p in s.diagnoses} == {NODES[h][0].job for h in mine}  # others' filtered out


def test_owner_spreads_jobs_and_moves_few_when_a_replica_is_added():
    jobs = [f"train-{i}" for i in range(3000)]
    three = {j: owner(j, 3) for j in jobs}
    share = Counter(three.values())
    assert all(abs(share[i] - 1000) < 120 for i in range(3))
    four = {j: owner(j, 4) for j in jobs}
    moved = [j for j in jobs if four[j] != three[j]]
    assert all(four[j] == 3 for j in moved)  # only to the new replica...
    assert abs(len(moved) - 750) < 120  # ...a quarter of the jobs
    assert all(owner(j, 1) == 0 for j in jobs[:10]) and Shard().owns("anything")


def test_ordinals_and_bad_shards():
    assert ordinal("rankscope-analyzer-2") == 2 and ordinal("a-0") == 0
    for bad in ("rankscope-analyzer", "analyzer-2a"):
        with pytest.raises(ValueError):
            ordinal(bad)
    for index, replicas in ((3, 3), (-1, 2), (0, 0)):
        with pytest.raises(ValueError):
            Shard(index, replicas)


@pytest.mark.parametrize("args,says", [
    (["--replicas", "3", "--replica", "3"], "need 0 <= replica < replicas"),
    (["--replicas", "0", "--replica", "0"], "need 0 <= replica < replicas"),
])
def test_cluster_cli_replica_errors(args, says, monkeypatch):
    assert says in cluster_cli_error(monkeypatch, "--agents", "http://a:1", *args)

