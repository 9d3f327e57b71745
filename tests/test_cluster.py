"""The cluster analyzer over in-process agents: merging nodes into one diagnosis, unreachable and
misbehaving agents, tokens, and its HTTP API."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from rankscope.agent.cluster import AgentListError, Cluster, ClusterSnapshot, make_cluster_app, parse_agents
from rankscope.agent.server import make_app
from rankscope.agent.snapshot import Snapshot
from rankscope.analyzer.cluster import merge
from test_analyzer import simulate

TOKEN = "cluster-token"
N, PER_HOST, SLOW = 8, 2, 5  # 4 nodes of 2 ranks; rank 5 on node2 computes slowly


def _job():
    return simulate(N, sync_extra={SLOW: 0.02}, ranks_per_host=PER_HOST)


def _by_host(patterns) -> dict[str, list]:
    out: dict[str, list] = {}
    for p in patterns:
        out.setdefault(p.host, []).append(p)
    return out


async def _agents(by_host: dict[str, list], token: str | None = TOKEN) -> dict[str, TestServer]:
    servers = {}
    for host, ps in by_host.items():
        snap = Snapshot(patterns=ps)
        servers[host] = TestServer(make_app(lambda snap=snap: snap, token))
        await servers[host].start_server()
    return servers


def _url(s: TestServer) -> str:
    return f"http://{s.host}:{s.port}"


def _cluster(urls: list[str], token: str | None = TOKEN) -> Cluster:
    return Cluster(urls, token, timeout_s=2.0, concurrency=2, hang_timeout_s=30.0, window_s=1.0)


def _dead_url() -> str:
    import socket
    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_one_diagnosis_over_all_nodes_and_a_down_agent_is_reported():
    async def go():
        servers = await _agents(_by_host(_job()))
        dead = _dead_url()
        c = _cluster([_url(s) for s in servers.values()] + [dead])
        try:
            return await c.window(), {h: _url(s) for h, s in servers.items()}, dead
        finally:
            await c.close()
            for s in servers.values():
                await s.close()

    snap, urls, dead = asyncio.run(go())
    assert list(snap.diagnoses) == ["job-a"]
    doc = snap.diagnoses["job-a"]
    assert sorted(r["rank"] for r in doc["ranks"]) == list(range(N))
    assert {r["host"] for r in doc["ranks"]} == {"node0", "node1", "node2", "node3"}
    top = doc["findings"][0]
    assert top["kind"] == "compute_straggler" and top["ranks"] == [SLOW]
    state = {a.url: (a.state, a.error) for a in snap.agents}
    assert state[dead][0] == "down" and "connect" in state[dead][1].lower()
    assert all(state[u] == ("up", None) for u in urls.values())
    # The dead agent never served a rank: no evidence of lost ranks
    assert not [f for f in doc["findings"] if f["kind"] == "node_unreachable"]


def test_a_node_that_stops_answering_is_evidence():
    async def go():
        servers = await _agents(_by_host(_job()))
        c = _cluster([_url(s) for s in servers.values()])
        try:
            await c.window()
            gone = _url(servers["node1"])
            await servers["node1"].close()
            return await c.window(), gone
        finally:
            await c.close()
            for s in servers.values():
                await s.close()

    snap, gone = asyncio.run(go())
    doc = snap.diagnoses["job-a"]
    assert sorted(r["rank"] for r in doc["ranks"]) == [0, 1, 4, 5, 6, 7]
    lost = [f for f in doc["findings"] if f["kind"] == "node_unreachable"]
    assert len(lost) == 1 and lost[0]["ranks"] == [2, 3]
    assert lost[0]["evidence"]["host"] == "node1" and lost[0]["evidence"]["agent"] == gone
    assert "node1" in lost[0]["summary"]
    assert next(a for a in snap.agents if a.url == gone).state == "down"


@pytest.mark.parametrize("cluster_token,expect", [(None, "HTTP 401"), ("wrong", "HTTP 401"), (TOKEN, None)])
def test_the_token_is_sent_to_agents(cluster_token, expect):
    async def go():
        servers = await _agents({"node0": _job()[:2]})
        c = _cluster([_url(s) for s in servers.values()], cluster_token)
        try:
            return (await c.window()).agents[0]
        finally:
            await c.close()
            for s in servers.values():
                await s.close()

    agent = asyncio.run(go())
    if expect is None:
        assert agent.state == "up" and agent.ranks == 2 and agent.hosts == ["node0"]
    else:
        assert agent.state == "down" and agent.error.startswith(expect)


@pytest.mark.parametrize("body,why", [(b"\x93\x01\x02", "bad patterns"), (b"{}", "bad patterns")])
def test_an_agent_answering_garbage_is_down_not_fatal(body, why):
    async def go():
        async def garbage(_):
            return web.Response(body=body)

        app = web.Application()
        app.router.add_get("/v1/patterns", garbage)
        server = TestServer(app)
        await server.start_server()
        c = _cluster([_url(server)])
        try:
            return (await c.window()).agents[0]
        finally:
            await c.close()
            await server.close()

    agent = asyncio.run(go())
    assert agent.state == "down" and agent.error.startswith(why)


def test_a_slow_agent_times_out():
    async def go():
        release = asyncio.Event()

        async def stall(_):
            await release.wait()
            return web.Response()

        app = web.Application()
        app.router.add_get("/v1/patterns", stall)
        server = TestServer(app)
        await server.start_server()
        c = Cluster([_url(server)], None, timeout_s=0.3, concurrency=1, hang_timeout_s=30, window_s=1)
        try:
            return (await c.window()).agents[0]
        finally:
            release.set()
            await c.close()
            await server.close()

    agent = asyncio.run(go())
    assert agent.state == "down" and "no answer within 0.3 s" in agent.error


def test_merge_counts_a_process_once():
    ps = _job()
    merged = merge(ps + ps[:3])  # an agent listed twice
    assert len(merged["job-a"]) == N


@pytest.mark.parametrize("entries", [["ftp://a:1"], ["http://a:1/v1/patterns"], ["http://a:1?x=1"], ["not a url"],
                                     ["http://a:99999"], [], ["# only a comment", ""]])
def test_bad_agent_lists(entries):
    with pytest.raises(AgentListError):
        parse_agents(entries)


def test_agent_list_forms():
    assert parse_agents(["http://10.0.0.1:9464/", " dns+http://agents.ns.svc:9464", "", "# c",
                         "http://10.0.0.1:9464"]) == ["http://10.0.0.1:9464", "dns+http://agents.ns.svc:9464"]


def test_dns_names_expand_to_every_address():
    async def go():
        servers = await _agents({"node0": _job()[:2]})
        port = next(iter(servers.values())).port
        c = _cluster([f"dns+http://localhost:{port}"])
        try:
            return await c.window(), port
        finally:
            await c.close()
            for s in servers.values():
                await s.close()

    snap, port = asyncio.run(go())
    assert [a.url for a in snap.agents if a.state == "up"] == [f"http://127.0.0.1:{port}"]
    assert len(snap.diagnoses["job-a"]["ranks"]) == 2


def _serve(snap: ClusterSnapshot, check: Callable) -> None:
    async def go():
        async with TestClient(TestServer(make_cluster_app(lambda: snap, TOKEN))) as c:
            await check(c)

    asyncio.run(go())


def test_cluster_api():
    async def pulled():
        servers = await _agents(_by_host(_job()))
        c = _cluster([_url(s) for s in servers.values()] + [_dead_url()])
        try:
            return await c.window()
        finally:
            await c.close()
            for s in servers.values():
                await s.close()

    snap = asyncio.run(pulled())
    auth = {"Authorization": f"Bearer {TOKEN}"}

    async def check(c):
        assert (await c.get("/healthz")).status == 200
        assert (await c.get("/v1/jobs")).status == 401
        jobs = await (await c.get("/v1/jobs", headers=auth)).json()
        assert [j["job"] for j in jobs["jobs"]] == ["job-a"] and jobs["jobs"][0]["ranks"] == N
        assert sorted(a["state"] for a in jobs["agents"]) == ["down", "up", "up", "up", "up"]
        doc = await (await c.get("/v1/diagnosis?job=job-a", headers=auth)).json()
        assert doc["findings"][0]["ranks"] == [SLOW] and len(doc["agents"]) == 5
        assert (await c.get("/v1/diagnosis?job=nope", headers=auth)).status == 404
        text = await (await c.get("/metrics", headers=auth)).text()
        assert 'rankscope_cluster_agents{state="down"} 1.0' in text
        assert 'rankscope_cluster_agents{state="up"} 4.0' in text
        assert 'rankscope_finding_cost{job="job-a",kind="compute_straggler"}' in text

    _serve(snap, check)


def _kinds(patterns) -> dict[str, list]:
    from rankscope.analyzer.diagnosis import diagnose_job
    return {f["kind"]: f for f in diagnose_job(patterns)["findings"]}


def test_every_rank_of_one_node_slow_is_a_node_fault():
    found = _kinds(simulate(N, sync_extra={4: 0.02, 5: 0.021}, ranks_per_host=PER_HOST))
    nf = found["node_fault"]
    assert nf["ranks"] == [4, 5] and nf["evidence"]["host"] == "node2" and "node node2" in nf["summary"]
    assert nf["cost"] > 0.2 and found["compute_straggler"]["ranks"] == [4, 5]


@pytest.mark.parametrize("slow,per_host", [({5: 0.02}, 2), ({4: 0.02, 6: 0.02}, 2), ({0: 0.02, 1: 0.02}, 8)])
def test_no_node_fault_for_one_rank_ranks_of_several_nodes_or_a_single_node(slow, per_host):
    assert "node_fault" not in _kinds(simulate(N, sync_extra=slow, ranks_per_host=per_host))


@pytest.mark.parametrize("args,says", [
    (["--agents", "ftp://x:1"], "is not http(s)://HOST[:PORT]"),
    ([], "--agents URL[,URL...] or --agents-file FILE"),
    (["--agents", "http://a:1", "--agents-file", "f"], "(one of them)"),
    (["--agents-file", "/nonexistent/agents"], "cannot read the agents file"),
    (["--agents", "http://a:1", "--listen", "0.0.0.0:9465"], "without a token"),
    (["--agents", "http://a:1", "--timeout", "0"], "must be positive"),
])
def test_cluster_cli_errors(args, says, monkeypatch):
    from test_cli_errors import one_line_error, run

    monkeypatch.delenv("RANKSCOPE_TOKEN", raising=False)
    assert says in one_line_error(run("cluster", *args))


def test_cluster_cli_port_in_use():
    import socket

    from test_cli_errors import one_line_error, run

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        line = one_line_error(run("cluster", "--agents", "http://127.0.0.1:1", "--listen",
                                  f"127.0.0.1:{s.getsockname()[1]}"))
    assert "cannot listen on 127.0.0.1" in line
