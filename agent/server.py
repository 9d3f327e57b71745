"""The agent's read-only HTTP API (contract.md): thin handlers over the latest Snapshot."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

from aiohttp import web
from rankscope.analyzer.patterns import encode_patterns, pattern_to_json

from .snapshot import Snapshot

MSGPACK = "application/msgpack"


def empty_diagnosis(job: str | None = None) -> dict:
    """The document before anything was observed: every key of a real one, nothing in them."""
    return {"job": job, "window": {"start": None, "end": None}, "step_time_s": None, "baseline": None,
            "ranks": [], "findings": []}


def make_app(current: Callable[[], Snapshot]) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def targets(_: web.Request) -> web.Response:
        snap = current()
        return web.json_response({"targets": [asdict(t) for t in snap.targets], "errors": snap.errors})

    async def patterns(request: web.Request) -> web.Response:
        snap = current()
        if MSGPACK in request.headers.get("Accept", ""):
            return web.Response(body=encode_patterns(snap.patterns), content_type=MSGPACK)
        return web.json_response({"patterns": [pattern_to_json(p) for p in snap.patterns]})

    async def diagnosis(request: web.Request) -> web.Response:
        snap = current()
        job = request.query.get("job")
        if job is not None:
            if job not in snap.diagnoses:
                raise web.HTTPNotFound(text=f"no such job: {job!r}; known: {sorted(snap.diagnoses)}\n")
            return web.json_response(snap.diagnoses[job])
        if len(snap.diagnoses) > 1:
            raise web.HTTPBadRequest(text=f"several jobs are watched, choose one with ?job=: {sorted(snap.diagnoses)}\n")
        return web.json_response(next(iter(snap.diagnoses.values()), empty_diagnosis()))

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=prometheus_text(current()), content_type="text/plain", charset="utf-8")

    app = web.Application(client_max_size=64 * 1024)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/targets", targets)
    app.router.add_get("/v1/patterns", patterns)
    app.router.add_get("/v1/diagnosis", diagnosis)
    app.router.add_get("/metrics", metrics)
    return app


def _label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(snap: Snapshot) -> str:
    """Prometheus exposition with low cardinality: job, rank and finding kind only, never function names."""
    out = [
        "# HELP rankscope_targets Processes watched by this agent.",
        "# TYPE rankscope_targets gauge",
        f"rankscope_targets {sum(t.state == 'running' for t in snap.targets)}",
        "# HELP rankscope_step_time_seconds Step time of each rank in the last window.",
        "# TYPE rankscope_step_time_seconds gauge",
    ]
    for job, doc in sorted(snap.diagnoses.items()):
        for r in doc["ranks"]:
            if r.get("step_time_s") is not None:
                out.append(f'rankscope_step_time_seconds{{job="{_label(job)}",rank="{r["rank"]}"}} {r["step_time_s"]:.6f}')
    out += [
        "# HELP rankscope_finding_cost Fraction of step time a finding costs the job (0 when absent).",
        "# TYPE rankscope_finding_cost gauge",
    ]
    for job, doc in sorted(snap.diagnoses.items()):
        for f in doc["findings"]:
            out.append(f'rankscope_finding_cost{{job="{_label(job)}",kind="{f["kind"]}"}} {f["cost"]:.4f}')
    return "\n".join(out) + "\n"
