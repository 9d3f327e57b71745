"""cluster (#19): the cluster analyzer pulling and diagnosing 12,500 node agents of 8 ranks each (100,000 ranks)
every 5 s window, one analyzer and sharded over replicas.

    python -m benchmarks.cluster farm JOBS RANKS_PER_JOB       (from scripts/: the simulated agents)
    python -m benchmarks.cluster analyze PORT AGENTS WINDOWS REPLICA REPLICAS CPU   (one analyzer replica)

The agents are one process (the farm) listening on one port of every loopback address: agent a is
http://127.1.(a >> 8).(a & 255):PORT and serves its 8 ranks' patterns of one window, synthetic ranks of
synthetic data-parallel jobs (benchmarks.analyzer's, one compute straggler a job) encoded by the wire codec
as an agent encodes them. An analyzer is `Cluster` itself (what `rankscope cluster` runs), in a process
pinned to one CPU, the farm on the other.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from .harness import SCRIPTS, BenchError, Context, Row, log, row

RANKS_PER_AGENT = 8
WINDOW_S = 5.0


def agent_url(a: int, port: int) -> str:
    return f"http://127.1.{a >> 8}.{a & 255}:{port}"


def agent_of(address: str) -> int:
    _, _, hi, lo = map(int, address.split("."))
    return hi << 8 | lo


def job_patterns(jobs: int, ranks: int) -> list[list]:
    """Per agent, its ranks' patterns: job j's rank r on agent j * ranks / 8 + r // 8, job j's straggler at
    rank ranks // 3."""
    from benchmarks.analyzer import synthetic_patterns

    agents: list[list] = []
    for j in range(jobs):
        pats = synthetic_patterns(ranks, straggler=ranks // 3, seed=j, ranks_per_host=RANKS_PER_AGENT)
        for p in pats:
            p.job, p.host = f"job{j}", f"job{j}-{p.host}"
        agents += [pats[i:i + RANKS_PER_AGENT] for i in range(0, ranks, RANKS_PER_AGENT)]
    return agents


class _AgentProtocol(asyncio.Protocol):
    """HTTP/1.1 with keep-alive, answering every request with the agent's patterns (filtered by replica the
    way an agent's /v1/patterns is) from bytes encoded once."""

    def __init__(self, answer):
        self.answer = answer
        self.buf = b""

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.agent = agent_of(transport.get_extra_info("sockname")[0])

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, self.buf = self.buf.split(b"\r\n\r\n", 1)
            target = head.split(b" ", 2)[1].decode()
            self.transport.write(self.answer(self.agent, urlsplit(target).query))


def farm(jobs: int, ranks: int) -> None:
    from rankscope.agent.service.shard import Shard
    from rankscope.schema.wire import encode_patterns

    agents = job_patterns(jobs, ranks)
    cache: dict[tuple[int, str], bytes] = {}

    def answer(a: int, query: str) -> bytes:
        if (a, query) not in cache:
            asked = {k: int(v[0]) for k, v in parse_qs(query).items()}  # the analyzer's own, well formed
            shard = Shard(asked.get("replica", 0), asked.get("replicas", 1))
            body = encode_patterns([p for p in agents[a] if shard.owns(p.job)])
            cache[a, query] = (b"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\nContent-Length: %d\r\n\r\n"
                               % len(body)) + body
        return cache[a, query]

    for a in range(len(agents)):  # encoded before the first pull: the farm's own work is not timed
        answer(a, "")

    async def serve() -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", 0))  # every 127.x.y.z reaches it; a non-loopback peer gets no answer
        sock.listen(4096)
        server = await asyncio.get_running_loop().create_server(lambda: _AgentProtocol(answer), sock=sock)
        print(json.dumps({"port": sock.getsockname()[1], "agents": len(agents),
                          "bytes": sum(len(b) for b in cache.values())}), flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


def analyze(port: int, agents: int, windows: int, replica: int, replicas: int, cpu: int) -> dict:
    """Windows of one analyzer replica: per window the pull's wall and CPU time, diagnose's CPU time, RSS."""
    from rankscope.agent.service.cluster_analyzer import Cluster
    from rankscope.agent.service.shard import Shard

    os.sched_setaffinity(0, {cpu})

    async def run() -> list[dict]:
        cluster = Cluster([agent_url(a, port) for a in range(agents)], None, timeout_s=30, concurrency=256,
                          hang_timeout_s=60, window_s=WINDOW_S, shard=Shard(replica, replicas))
        out = []
        try:
            for _ in range(windows):
                w, c = time.perf_counter(), time.process_time()
                snap = await cluster.window()
                timing = dict(snap.timing)
                timing.update(window_wall_s=time.perf_counter() - w, window_cpu_s=time.process_time() - c,
                              rss_mb=_rss_mb(), agents_up=sum(a.state == "up" for a in snap.agents),
                              errors=sorted({a.error for a in snap.agents if a.state != "up"})[:5],
                              ranks=sum(len(d["ranks"]) for d in snap.diagnoses.values()),
                              verdicts={job: [(f["kind"], f["ranks"]) for f in d["findings"]]
                                        for job, d in snap.diagnoses.items()})
                out.append(timing)
        finally:
            await cluster.close()
        return out

    windows_out = asyncio.run(run())
    return {"windows": windows_out, "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _env() -> dict[str, str]:
    path = [str(SCRIPTS), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path))


@dataclass(frozen=True)
class Farm:
    port: int
    agents: int
    bytes: int  # of encoded patterns, all agents together


@contextmanager
def farm_process(jobs: int, ranks: int, cpu: int) -> Iterator[Farm]:
    """The farm as a subprocess (pinned to `cpu`), once its patterns are encoded and it serves."""
    from rankscope.sim.harness import terminate

    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.cluster", "farm", str(jobs), str(ranks)],
                            env=_env(), stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    try:
        line = proc.stdout.readline()
        if not line:
            raise BenchError(f"the agent farm exited with status {proc.wait()}")
        yield Farm(**json.loads(line))
    finally:
        terminate(proc, 10)


def run_replicas(farm: Farm, windows: int, replicas: int, cpu: int) -> list[dict]:
    """Each replica's windows, replicas one after another on the same CPU (each is its own process)."""
    out = []
    for replica in range(replicas):
        r = subprocess.run([sys.executable, "-m", "benchmarks.cluster", "analyze", str(farm.port), str(farm.agents),
                            str(windows), str(replica), str(replicas), str(cpu)],
                           env=_env(), capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            raise BenchError(f"analyzer replica {replica}/{replicas} failed:\n{r.stderr[-2000:]}")
        out.append(json.loads(r.stdout.strip().splitlines()[-1]))
    return out


def run(ctx: Context) -> tuple[list[Row], dict]:
    from benchmarks.analyzer import WINDOW

    from rankscope.analyzer.stability import HOLD_S

    jobs, ranks = (2, 64) if ctx.quick else (100, 1000)
    windows = math.ceil(HOLD_S / WINDOW)  # the farm's patterns span WINDOW: a finding is reported from this one
    shards = 3
    cpus = sorted(os.sched_getaffinity(0))
    farm_cpu, cpu = cpus[0], cpus[-1]
    details: dict = {"jobs": jobs, "ranks_per_job": ranks, "ranks_per_agent": RANKS_PER_AGENT, "windows": windows}
    rows: list[Row] = []
    with farm_process(jobs, ranks, farm_cpu) as farm:
        details.update(agents=farm.agents, payload_bytes=farm.bytes)
        log(f"cluster: {farm.agents:,} agents, {jobs * ranks:,} ranks, {farm.bytes / 2**20:.0f} MB of patterns")
        for replicas in (1, shards):
            results = run_replicas(farm, windows, replicas, cpu)
            details[f"replicas_{replicas}"] = results
            # The first window asks every agent (which of them hold this replica's jobs is not known yet).
            steady = [r["windows"][1:] or r["windows"] for r in results]
            for ws in steady:
                for w in ws:
                    w["pull_cpu_s"] = w["window_cpu_s"] - w["diagnose_cpu_s"]
            worst = {k: max(max(w[k] for w in ws) for ws in steady)
                     for k in ("pull_cpu_s", "diagnose_cpu_s", "window_cpu_s", "window_wall_s")}
            first = max(r["windows"][0]["window_cpu_s"] for r in results)
            rss = max(r["maxrss_mb"] for r in results)
            down = max(farm.agents - w["agents_up"] for ws in steady for w in ws)
            for r in results:  # once held: the last window
                last = r["windows"][-1]["verdicts"]
                missed = [j for j, v in last.items() if ("compute_straggler", [ranks // 3]) not in map(tuple, v)]
                if missed:
                    raise BenchError(f"jobs {missed[:5]} without their straggler: {last[missed[0]]}")
            owned = [sorted(r["windows"][-1]["verdicts"]) for r in results]
            if sorted(j for o in owned for j in o) != sorted(f"job{j}" for j in range(jobs)):
                raise BenchError("replicas do not diagnose every job exactly once")
            what = "one analyzer" if replicas == 1 else f"{replicas} replicas, the busiest"
            rows += [row("cluster", f"{what}: pull CPU a window (HTTP + decoding)", worst["pull_cpu_s"], "s"),
                     row("cluster", f"{what}: diagnose CPU a window", worst["diagnose_cpu_s"], "s"),
                     row("cluster", f"{what}: CPU a window, one core", worst["window_cpu_s"], "s", WINDOW_S,
                         f"first window (every agent asked) {first:.1f} s; wall {worst['window_wall_s']:.1f} s"),
                     row("cluster", f"{what}: analyzer peak RSS", rss, "MB"),
                     row("cluster", f"{what}: agents not pulled in a window (down)", down, "", 0,
                         "; ".join(sorted({e for ws in steady for w in ws for e in w["errors"]}))[:200])]
            log(f"cluster: {what}: pull {worst['pull_cpu_s']:.2f} s CPU, diagnose {worst['diagnose_cpu_s']:.2f} s CPU,"
                f" window {worst['window_cpu_s']:.2f} s CPU ({worst['window_wall_s']:.2f} s wall, first window "
                f"{first:.2f} s CPU), RSS {rss:.0f} MB")
    details["method"] = ("one farm process serves every agent's encoded patterns on its own loopback address "
                         "(CPU 0); each analyzer replica is Cluster.window() in a process pinned to the other CPU, "
                         "replicas one after another; the worst window after the first (which connects) counts")
    return rows, details


if __name__ == "__main__":
    if sys.argv[1] == "farm":
        farm(int(sys.argv[2]), int(sys.argv[3]))
    else:
        print(json.dumps(analyze(*map(int, sys.argv[2:8]))))
