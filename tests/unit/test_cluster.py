"""The cluster analyzer over in-process agents: merging nodes into one diagnosis, unreachable, vanished and
misbehaving agents, tokens, DNS names, its CLI and its HTTP API."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from conftest import one_line_error, run
from test_analyzer import simulate
from test_patterns import typical

from rankscope.agent.cli import main
from rankscope.agent.service import cluster_analyzer
from rankscope.agent.service.cluster_analyzer import AgentListError, Cluster, make_cluster_app, parse_agents
from rankscope.agent.service.http import make_app
from rankscope.agent.service.snapshot import Snapshot
from rankscope.analyzer.cluster import merge
from rankscope.analyzer.diagnosis import diagnose_job
from rankscope.schema.wire import encode_patterns

TOKEN = "cluster-token"
N, PER_HOST, SLOW = 8, 2, 5  # 4 nodes of 2 ranks; rank 5 on node2 computes slowly


def _by_host(patterns) -> dict[str, list]:
    out: dict[str, list] = {}
    for p in patterns:
        out.setdefault(p.host, []).append(p)
    return out


JOB = _by_host(simulate(N, sync_extra={SLOW: 0.02}, ranks_per_host=PER_HOST))


def _url(s: TestServer) -> str:
    return f"http://{s.host}:{s.port}"


@asynccontextmanager
async def serving(*apps: web.Application) -> AsyncIterator[list[TestServer]]:
    servers = [TestServer(app) for app in apps]
    try:
        for s in servers:
            await s.start_server()
        yield servers
    finally:
        for s in servers:
            await s.close()


@asynccontextmanager
async def agents(by_host: dict[str, list], token: str | None = TOKEN) -> AsyncIterator[dict[str, TestServer]]:
    """One in-process agent per host, serving that host's patterns."""
    snaps = [Snapshot(patterns=ps) for ps in by_host.values()]
    async with serving(*(make_app(lambda s=s: s, token) for s in snaps)) as servers:
        yield dict(zip(by_host, servers))


@asynccontextmanager
async def cluster(urls: list[str], token: str | None = TOKEN, timeout_s: float = 2.0) -> AsyncIterator[Cluster]:
    c = Cluster(urls, token, timeout_s=timeout_s, concurrency=2, hang_timeout_s=30.0, window_s=1.0)
    try:
        yield c
    finally:
        await c.close()


@contextmanager
def _dead_url() -> Iterator[str]:
    """A port bound but not listening, for the test's duration: connections are refused, and no server the
    test starts meanwhile can be given it (a port merely freed was, once: the "dead" agent answered)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def _one_agent(app: web.Application, **kw):
    """The status of an agent served by `app` after one pull."""
    async def go():
        async with serving(app) as (server,), cluster([_url(server)], **kw) as c:
            return (await c.window()).agents[0]

    return asyncio.run(go())


def _lost(doc: dict) -> list[dict]:
    return [f for f in doc["findings"] if f["kind"] == "node_unreachable"]


def test_one_diagnosis_over_all_nodes_and_a_down_agent_is_reported():
    async def go(dead: str):
        async with agents(JOB) as servers, cluster([_url(s) for s in servers.values()] + [dead]) as c:
            first = await c.window()
            assert first.diagnoses["job-a"]["findings"] == []  # one window: unconfirmed (hysteresis)
            assert first.diagnoses["job-a"]["unconfirmed"][0]["ranks"] == [SLOW]
            await c.window()  # reported once held over HOLD_S: three of these 2 s windows
            return await c.window(), [_url(s) for s in servers.values()]

    with _dead_url() as dead:
        snap, up = asyncio.run(go(dead))
    assert list(snap.diagnoses) == ["job-a"]
    doc = snap.diagnoses["job-a"]
    assert sorted(r["rank"] for r in doc["ranks"]) == list(range(N))
    assert {r["host"] for r in doc["ranks"]} == {"node0", "node1", "node2", "node3"}
    assert doc["findings"][0]["kind"] == "compute_straggler" and doc["findings"][0]["ranks"] == [SLOW]
    state = {a.url: (a.state, a.error) for a in snap.agents}
    assert state[dead][0] == "down" and "connect" in state[dead][1].lower()
    assert all(state[u] == ("up", None) for u in up)
    assert not _lost(doc)  # the dead agent never served a rank: nothing of the job is missing


def test_a_node_that_stops_answering_is_evidence():
    async def go():
        async with agents(JOB) as servers, cluster([_url(s) for s in servers.values()]) as c:
            await c.window()
            gone = _url(servers["node1"])
            await servers["node1"].close()
            return await c.window(), gone

    snap, gone = asyncio.run(go())
    doc = snap.diagnoses["job-a"]
    assert sorted(r["rank"] for r in doc["ranks"]) == [0, 1, 4, 5, 6, 7]
    (lost,) = _lost(doc)
    assert lost["ranks"] == [2, 3] and lost["evidence"]["host"] == "node1" and lost["evidence"]["agent"] == gone
    assert "node1" in lost["summary"]
    assert next(a for a in snap.agents if a.url == gone).state == "down"


def test_an_agent_its_dns_name_no_longer_lists_is_evidence(monkeypatch):
    async def go():
        async with agents(JOB) as servers:
            urls = [_url(s) for s in servers.values()]
            async with cluster(["dns+http://agents.test:9464"]) as c:
                listed = urls
                monkeypatch.setattr(c, "_urls", lambda: asyncio.sleep(0, listed))
                await c.window()
                listed = urls[:2] + urls[3:]  # node2's agent is gone from the headless Service
                return await c.window(), urls[2]

    snap, gone = asyncio.run(go())
    (lost,) = _lost(snap.diagnoses["job-a"])
    assert lost["ranks"] == [4, 5] and lost["evidence"]["host"] == "node2"
    assert next(a for a in snap.agents if a.url == gone).error == "no longer listed by its DNS name"


@pytest.mark.parametrize("cluster_token,expect", [(None, "HTTP 401"), ("wrong", "HTTP 401"), (TOKEN, None)])
def test_the_token_is_sent_to_agents(cluster_token, expect):
    agent = _one_agent(make_app(lambda: Snapshot(patterns=JOB["node0"]), TOKEN), token=cluster_token)
    if expect is None:
        assert agent.state == "up" and agent.ranks == 2 and agent.hosts == ["node0"]
    else:
        assert agent.state == "down" and agent.error.startswith(expect)


def test_a_large_answer_arrives_whole():
    """An answer of many reads: over 1 MiB, sixteen times the 64 KiB the client reads at once."""
    many = [dataclasses.replace(typical(r), pid=10_000 + r) for r in range(1200)]
    assert len(encode_patterns(many)) > 1 << 20
    agent = _one_agent(make_app(lambda: Snapshot(patterns=many), TOKEN))
    assert agent.state == "up" and agent.ranks == 1200


def _app(handler) -> web.Application:
    app = web.Application()
    app.router.add_get("/v1/patterns", handler)
    return app


@pytest.mark.parametrize("body", [b"\x93\x01\x02", b"{}", b"\xc1"])
def test_an_agent_answering_garbage_is_down_not_fatal(body):
    async def garbage(_):
        return web.Response(body=body)

    agent = _one_agent(_app(garbage))
    assert agent.state == "down" and agent.error.startswith("bad patterns")


def test_a_slow_agent_times_out():
    async def stall(_):
        await asyncio.sleep(30)  # longer than the pull's timeout; cancelled when the server closes
        return web.Response()

    agent = _one_agent(_app(stall), timeout_s=0.3)
    assert agent.state == "down" and "no answer within 0.3 s" in agent.error


def test_merge_counts_a_process_once():
    ps = [p for ps in JOB.values() for p in ps]
    assert len(merge(ps + ps[:3])["job-a"]) == N  # an agent listed twice


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
        async with agents({"node0": JOB["node0"]}) as servers:
            port = servers["node0"].port
            async with cluster([f"dns+http://localhost:{port}", "dns+http://no-such-name.invalid:1"]) as c:
                return await c.window(), port

    snap, port = asyncio.run(go())
    assert [a.url for a in snap.agents if a.state == "up"] == [f"http://127.0.0.1:{port}"]
    unresolved = next(a for a in snap.agents if "invalid" in a.url)
    assert unresolved.state == "down" and unresolved.error.startswith("cannot resolve no-such-name.invalid")
    assert len(snap.diagnoses["job-a"]["ranks"]) == 2


def test_cluster_api():
    async def go():
        with _dead_url() as dead:
            async with agents(JOB) as servers, cluster([_url(s) for s in servers.values()] + [dead]) as c:
                for _ in range(2):  # a finding is reported once it held over HOLD_S: three 2 s windows
                    await c.window()
                snap = await c.window()
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with TestClient(TestServer(make_cluster_app(lambda: snap, TOKEN))) as api:
            assert (await api.get("/healthz")).status == 200
            assert (await api.get("/v1/jobs")).status == 401
            jobs = await (await api.get("/v1/jobs", headers=auth)).json()
            assert [j["job"] for j in jobs["jobs"]] == ["job-a"] and jobs["jobs"][0]["ranks"] == N
            assert sorted(a["state"] for a in jobs["agents"]) == ["down", "up", "up", "up", "up"]
            doc = await (await api.get("/v1/diagnosis?job=job-a", headers=auth)).json()
            assert doc["findings"][0]["ranks"] == [SLOW] and len(doc["agents"]) == 5
            assert (await api.get("/v1/diagnosis?job=nope", headers=auth)).status == 404
            text = await (await api.get("/metrics", headers=auth)).text()
        assert 'rankscope_cluster_agents{state="down"} 1.0' in text
        assert 'rankscope_cluster_agents{state="up"} 4.0' in text
        assert 'rankscope_finding_cost{job="job-a",kind="compute_straggler"}' in text

    asyncio.run(go())


def _kinds(patterns) -> dict[str, dict]:
    return {f["kind"]: f for f in diagnose_job(patterns)["findings"]}


def test_every_rank_of_one_node_slow_is_a_node_fault():
    found = _kinds(simulate(N, sync_extra={4: 0.02, 5: 0.021}, ranks_per_host=PER_HOST))
    nf = found["node_fault"]
    assert nf["ranks"] == [4, 5] and nf["evidence"]["host"] == "node2" and "node node2" in nf["summary"]
    assert nf["cost"] > 0.2 and found["compute_straggler"]["ranks"] == [4, 5]


@pytest.mark.parametrize("slow,per_host", [({5: 0.02}, 2), ({4: 0.02, 6: 0.02}, 2), ({0: 0.02, 1: 0.02}, 8)])
def test_no_node_fault_for_one_rank_ranks_of_several_nodes_or_a_single_node(slow, per_host):
    assert "node_fault" not in _kinds(simulate(N, sync_extra=slow, ranks_per_host=per_host))


def cluster_cli_error(monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    """The one line `rankscope cluster ARGS` refuses ARGS with, its exit status 2: the command line's main run in
    this process (a fresh interpreter would take most of a second importing the agent). Serving fails the test."""
    def serve(*_):
        raise AssertionError(f"rankscope cluster {' '.join(args)} serves")

    monkeypatch.delenv("RANKSCOPE_TOKEN", raising=False)
    monkeypatch.setattr(cluster_analyzer, "serve_cluster", serve)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(["cluster", *args])
        except SystemExit as e:  # argparse's own errors
            status = e.code
    return one_line_error(subprocess.CompletedProcess(["rankscope", "cluster", *args], status, out.getvalue(),
                                                      err.getvalue()))


@pytest.mark.parametrize("args,says", [
    (["--agents", "ftp://x:1"], "is not http(s)://HOST[:PORT]"),
    ([], "--agents URL[,URL...] or --agents-file FILE"),
    (["--agents", "http://a:1", "--agents-file", "f"], "(one of them)"),
    (["--agents-file", "/nonexistent/agents"], "cannot read the agents file"),
    (["--agents", "http://a:1", "--listen", "0.0.0.0:9465"], "without a token"),
    (["--agents", "http://a:1", "--timeout", "0"], "must be positive"),
])
def test_cluster_cli_errors(args, says, monkeypatch):
    assert says in cluster_cli_error(monkeypatch, *args)


def test_cluster_cli_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        line = one_line_error(run("cluster", "--agents", "http://127.0.0.1:1", "--listen",
                                  f"127.0.0.1:{s.getsockname()[1]}"))
    assert "cannot listen on 127.0.0.1" in line


class _Recorder:
    """Stands in for --notify-url's notifier: what each window handed it."""

    def __init__(self):
        self.windows: list[dict] = []

    def update(self, diagnoses: dict) -> None:
        self.windows.append({job: [f["kind"] for f in doc["findings"]] for job, doc in diagnoses.items()})

    def close(self) -> None:
        pass


def test_the_analyzer_keeps_its_history_on_disk_and_hands_each_window_to_the_notifier(tmp_path):
    from rankscope.agent.service.history_store import HistoryStore

    job = {host: [dataclasses.replace(p) for p in ps] for host, ps in JOB.items()}
    old = 1e10  # the simulated windows closed long ago: kept all the same
    assert {p.window_end for ps in job.values() for p in ps} == {1700000002.0}

    async def go():
        notified = _Recorder()
        async with agents(job) as servers:
            c = Cluster([_url(s) for s in servers.values()], TOKEN, timeout_s=2.0, concurrency=2, hang_timeout_s=30.0,
                        window_s=1.0, history=HistoryStore(str(tmp_path), "cluster", max_age_s=old), notifier=notified)
            for _ in range(3):
                await c.window()
                for p in (p for ps in job.values() for p in ps):  # the agents' next window
                    p.window_start, p.window_end = p.window_end, 2 * p.window_end - p.window_start
            await c.close()  # the writer finishes what it was given
        again = Cluster(["http://127.0.0.1:1"], TOKEN, timeout_s=2.0, concurrency=2, hang_timeout_s=30.0,
                        window_s=1.0, history=HistoryStore(str(tmp_path), "cluster", max_age_s=old))
        kept = again.snapshot.history.query(since=0)
        await again.close()
        return notified.windows, kept

    windows, kept = asyncio.run(go())
    assert windows == [{"job-a": []}] * 3  # each window's documents, findings held or not (none held here)
    assert [p.end for p in kept["job-a"].points] == [1700000002.0, 1700000004.0, 1700000006.0]
