"""The agent's read-only HTTP API (docs/api.md): thin handlers over the latest Snapshot (and, for
/v1/stacks, a read of the ranks' memory now; for /v1/trace, a bounded capture), behind the limits and the bearer-token check that the cluster
analyzer's API shares."""
from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict
from typing import Any

from aiohttp import web

from rankscope.agent.service.agent_metrics import agent_metrics
from rankscope.agent.service.auth import Handler, ListenError, bearer_auth
from rankscope.agent.service.page import add_page
from rankscope.agent.service.prometheus import CONTENT_TYPE_LATEST, exposition
from rankscope.agent.loader.trace_stream import CaptureBusy
from rankscope.agent.service.snapshot import Snapshot
from rankscope.agent.trace_capture import MAX_SECONDS
from rankscope.agent.views import trace as chrome
from rankscope.agent.views.folded import folded_diff
from rankscope.agent.views.formats import encode
from rankscope.agent.views.profile import DEFAULT_WHAT, RankProfile, diff, diff_json, peers_of
from rankscope.agent.service.shard import Shard
from rankscope.analyzer.diagnosis import empty_diagnosis
from rankscope.schema.wire import encode_patterns, pattern_to_json

log = logging.getLogger(__name__)

# (seconds, job or None, rank or None) -> the ranks' trace documents; LookupError: no such job or rank,
# ValueError: several jobs and none chosen, CaptureBusy: another capture runs.
TraceCapturer = Callable[[float, str | None, int | None], list[dict[str, Any]]]

MSGPACK = "application/msgpack"
MAX_BODY_BYTES = 4 * 1024  # every endpoint is a GET: a body is never needed
MAX_LINE_BYTES = 4 * 1024  # request line and each header
HANDLER_TIMEOUT_S = 10.0
MAX_JOB_NAME = 256


@web.middleware
async def _time_limit(request: web.Request, handler: Handler) -> web.StreamResponse:
    # A route's handler may take longer by its own bound (a trace capture: its capped duration).
    limit = HANDLER_TIMEOUT_S + getattr(request.match_info.handler, "extra_time_s", 0.0)
    try:
        return await asyncio.wait_for(handler(request), limit)
    except asyncio.TimeoutError:
        raise web.HTTPServiceUnavailable(text=f"request took longer than {limit:.0f} s\n") from None


def secure_app(token: str | None) -> web.Application:
    """An application with the request limits and, given a token, the bearer check on every path but /healthz."""
    middlewares = [_time_limit] + ([bearer_auth(token)] if token is not None else [])
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app.router.add_get("/healthz", healthz)
    return app


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


def _int_query(request: web.Request, name: str) -> int | None:
    text = request.query.get(name)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name} must be an integer, not {text[:64]!r}\n") from None


def select_profiles(snap: Snapshot, request: web.Request) -> list[RankProfile]:
    """The last window's profiles of `?rank=` (every rank without it) of `?job=` (needed if several jobs
    have such ranks)."""
    rank, job = _int_query(request, "rank"), request.query.get("job")
    chosen = [p for p in snap.profiles if (rank is None or p.rank == rank) and (job is None or p.job == job)]
    if not chosen:
        raise web.HTTPNotFound(text=f"no profile of rank {rank} (job {job}) in the last window; ranks: "
                                    f"{sorted({(p.job, p.rank) for p in snap.profiles})[:64]}\n")
    if len({p.job for p in chosen}) > 1:
        raise web.HTTPBadRequest(text=f"several jobs have such ranks, choose one with ?job=: "
                                      f"{sorted({p.job for p in chosen})[:64]}\n")
    return chosen


def profile_response(snap: Snapshot, request: web.Request) -> web.Response:
    """GET /v1/profile?rank=R[&job=J][&format=folded|speedscope|pprof][&what=wall|cpu], or with
    &against=peers the rank's differential profile (format folded or json)."""
    chosen = select_profiles(snap, request)
    what = request.query.get("what", DEFAULT_WHAT)
    against = request.query.get("against")
    try:
        if against is None:
            body, content_type = encode(chosen, request.query.get("format", "folded"), what)
            return web.Response(body=body, headers={"Content-Type": content_type})
        if against != "peers" or len(chosen) != 1:
            raise ValueError("against=peers compares one rank (?rank=R) with its peers")
        d = diff(chosen[0], peers_of(chosen[0], snap.profiles, snap.patterns), what)
    except ValueError as e:
        raise web.HTTPBadRequest(text=f"{e}\n") from None
    fmt = request.query.get("format", "folded")
    if fmt == "json":
        return web.json_response(diff_json(d))
    if fmt != "folded":
        raise web.HTTPBadRequest(text="a differential profile is written as folded or json\n")
    return web.Response(text=folded_diff(d))


def trace_response(request: web.Request, trace: TraceCapturer) -> web.Response:
    """GET /v1/trace?seconds=S[&rank=R][&job=J]: a capture of S seconds (at most MAX_SECONDS, one at a time)
    of the job's ranks: a zip of their traces, or rank R's trace alone. Runs off the event loop."""
    text = request.query.get("seconds", "5")
    try:
        seconds = float(text)
    except ValueError:
        raise web.HTTPBadRequest(text=f"seconds must be a number, not {text[:64]!r}\n") from None
    if not 0 < seconds <= MAX_SECONDS:
        raise web.HTTPBadRequest(text=f"seconds must be positive and at most {MAX_SECONDS:g}\n")
    rank, job = _int_query(request, "rank"), request.query.get("job")
    if job is not None and len(job) > MAX_JOB_NAME:
        raise web.HTTPBadRequest(text=f"job name longer than {MAX_JOB_NAME} characters\n")
    try:
        docs = trace(seconds, job, rank)
    except CaptureBusy as e:
        raise web.HTTPConflict(text=f"{e}\n") from None
    except LookupError as e:
        raise web.HTTPNotFound(text=f"{e.args[0]}\n") from None
    except ValueError as e:
        raise web.HTTPBadRequest(text=f"{e}\n") from None
    if rank is not None:
        return web.Response(body=chrome.encode(docs[0]), content_type=chrome.CONTENT_TYPE)
    return web.Response(body=chrome.zipped(docs), content_type=chrome.ZIP_CONTENT_TYPE,
                        headers={"Content-Disposition": 'attachment; filename="rankscope-trace.zip"'})


def make_app(current: Callable[[], Snapshot], token: str | None = None,
             stacks: Callable[[], dict[str, Any]] | None = None,
             trace: TraceCapturer | None = None) -> web.Application:
    async def targets(_: web.Request) -> web.Response:
        snap = current()
        return web.json_response({"targets": [asdict(t) for t in snap.targets], "errors": snap.errors,
                                  "skipped": snap.skipped,
                                  "window_end": snap.window_end})  # None until the first window closes

    async def patterns(request: web.Request) -> web.Response:
        try:  # a replica of a sharded cluster analyzer asks for its own jobs' patterns only
            shard = Shard.of_query(request.query)
        except ValueError as e:
            raise web.HTTPBadRequest(text=f"{e}\n") from None
        served = [p for p in current().patterns if shard.owns(p.job)]
        if MSGPACK in request.headers.get("Accept", ""):
            return web.Response(body=encode_patterns(served), content_type=MSGPACK)
        return web.json_response({"patterns": [pattern_to_json(p) for p in served]})

    async def diagnosis(request: web.Request) -> web.Response:
        return web.json_response(select_diagnosis(current().diagnoses, request))

    async def metrics(_: web.Request) -> web.Response:
        snap = current()
        return metrics_response(exposition(snap.diagnoses, agent_metrics(snap)))

    async def profile(request: web.Request) -> web.Response:
        return profile_response(current(), request)

    async def thread_stacks(_: web.Request) -> web.Response:
        # Reads /proc/PID/mem of every rank: off the event loop.
        return web.json_response(await asyncio.get_running_loop().run_in_executor(None, stacks))

    async def trace_capture(request: web.Request) -> web.Response:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, trace_response, request, trace)

    trace_capture.extra_time_s = MAX_SECONDS

    app = secure_app(token)
    app.router.add_get("/v1/targets", targets)
    if trace is not None:
        app.router.add_get("/v1/trace", trace_capture)
    app.router.add_get("/v1/profile", profile)
    if stacks is not None:
        app.router.add_get("/v1/stacks", thread_stacks)
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
