"""The agent's read-only HTTP API (contract.md): thin handlers over the latest Snapshot, behind the limits and
the bearer-token check that the cluster analyzer's API shares."""
from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict
from typing import Any

from aiohttp import web

from rankscope.agent.service.agent_metrics import agent_metrics
from rankscope.agent.service.auth import Handler, bearer_auth
from rankscope.agent.service.page import add_page
from rankscope.agent.service.prometheus import CONTENT_TYPE_LATEST, exposition
from rankscope.agent.service.snapshot import Snapshot
from rankscope.schema.wire import encode_patterns, pattern_to_json

log = logging.getLogger(__name__)

MSGPACK = "application/msgpack"
MAX_BODY_BYTES = 4 * 1024  # every endpoint is a GET: a body is never needed
MAX_LINE_BYTES = 4 * 1024  # request line and each header
HANDLER_TIMEOUT_S = 10.0
MAX_JOB_NAME = 256


def empty_diagnosis(job: str | None = None) -> dict:
    """The document before anything was observed: every key of a real one, nothing in them."""
    return {"job": job, "window": {"start": None, "end": None}, "step_time_s": None, "baseline": None,
            "ranks": [], "findings": []}


@web.middleware
async def _time_limit(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await asyncio.wait_for(handler(request), HANDLER_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise web.HTTPServiceUnavailable(text=f"request took longer than {HANDLER_TIMEOUT_S:.0f} s\n") from None


def secure_app(token: str | None) -> web.Application:
    """An application with the request limits and, given a token, the bearer check on every path but /healthz."""
    middlewares = [_time_limit] + ([bearer_auth(token)] if token is not None else [])
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app.router.add_get("/healthz", healthz)
    return app


class ListenError(Exception):
    """The address cannot be served on (in use, not local, not permitted)."""


async def start_site(app: web.Application, host: str, port: int) -> web.AppRunner:
    # Extra keywords reach aiohttp's request handler (handler_args belongs to web.Application).
    runner = web.AppRunner(app, access_log=None, max_line_size=MAX_LINE_BYTES, max_field_size=MAX_LINE_BYTES)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as e:
        await runner.cleanup()
        raise ListenError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return runner


def select_diagnosis(diagnoses: Mapping[str, dict[str, Any]], request: web.Request) -> dict[str, Any]:
    """The document `?job=` names; without it the only job's (an empty document when none is watched)."""
    job = request.query.get("job")
    if job is not None:
        if len(job) > MAX_JOB_NAME:
            raise web.HTTPBadRequest(text=f"job name longer than {MAX_JOB_NAME} characters\n")
        if job not in diagnoses:
            raise web.HTTPNotFound(text=f"no such job: {job!r}; known: {sorted(diagnoses)}\n")
        return diagnoses[job]
    if len(diagnoses) > 1:
        raise web.HTTPBadRequest(text=f"several jobs are watched, choose one with ?job=: {sorted(diagnoses)}\n")
    return next(iter(diagnoses.values()), empty_diagnosis())


def metrics_response(body: bytes) -> web.Response:
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def make_app(current: Callable[[], Snapshot], token: str | None = None) -> web.Application:
    async def targets(_: web.Request) -> web.Response:
        snap = current()
        return web.json_response({"targets": [asdict(t) for t in snap.targets], "errors": snap.errors,
                                  "skipped": snap.skipped})

    async def patterns(request: web.Request) -> web.Response:
        snap = current()
        if MSGPACK in request.headers.get("Accept", ""):
            return web.Response(body=encode_patterns(snap.patterns), content_type=MSGPACK)
        return web.json_response({"patterns": [pattern_to_json(p) for p in snap.patterns]})

    async def diagnosis(request: web.Request) -> web.Response:
        return web.json_response(select_diagnosis(current().diagnoses, request))

    async def metrics(_: web.Request) -> web.Response:
        snap = current()
        return metrics_response(exposition(snap.diagnoses, agent_metrics(snap)))

    app = secure_app(token)
    app.router.add_get("/v1/targets", targets)
    app.router.add_get("/v1/patterns", patterns)
    app.router.add_get("/v1/diagnosis", diagnosis)
    app.router.add_get("/metrics", metrics)
    add_page(app, lambda: current().history)
    return app


async def serve_windows(app: web.Application, host: str, port: int, window_s: float,
                        tick: Callable[[], Awaitable[Any]], name: str,
                        first: Callable[[], Awaitable[Any]] | None = None) -> None:
    """Serve `app`, await `first()` once, then `tick()` every window until SIGTERM/SIGINT; a failing window
    keeps the last good snapshot."""
    runner = await start_site(app, host, port)
    log.info("%s serving on http://%s:%d", name, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        if first is not None:
            await first()
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=window_s)
            except asyncio.TimeoutError:
                try:
                    await tick()
                except Exception:  # keep serving the last good snapshot; the next window may succeed
                    log.exception("window failed")
    finally:
        await runner.cleanup()
