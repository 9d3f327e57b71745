"""The agent's HTTP API (docs/api.md): thin handlers over the latest Snapshot (and, for /v1/stacks, a read of
the ranks' memory now; for /v1/trace, a bounded capture), behind the limits and the access check (auth.py)
that the cluster analyzer's API shares."""
from __future__ import annotations

import asyncio
import logging
import signal
import ssl
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from aiohttp import web

from rankscope.agent.service.agent_metrics import agent_metrics
from rankscope.agent.service.auth import Access, Handler, ListenError, access_check, capture_route
from rankscope.agent.service.page import add_page
from rankscope.agent.service.prometheus import CONTENT_TYPE_LATEST, exposition
from rankscope.agent.loader.trace_stream import CaptureBusy
from rankscope.agent.service.snapshot import Snapshot
from rankscope.agent.trace_capture import MAX_SECONDS
from rankscope.agent.views import trace as chrome
from rankscope.agent.views.folded import folded_diff
from rankscope.agent.views.formats import FORMATS, encode
from rankscope.agent.views.profile import DEFAULT_WHAT, WHATS, RankProfile, diff, diff_json, peers_of
from rankscope.agent.service.shard import MAX_REPLICAS, Shard
from rankscope.analyzer.diagnosis import empty_diagnosis
from rankscope.schema.wire import encode_patterns, pattern_to_json

log = logging.getLogger(__name__)

# (seconds, job or None, rank or None) -> the ranks' trace documents; LookupError: no such job or rank,
# ValueError: several jobs and none chosen, CaptureBusy: another capture runs.
TraceCapturer = Callable[[float, str | None, int | None], list[dict[str, Any]]]

MSGPACK = "application/msgpack"
MAX_BODY_BYTES = 4 * 1024  # no endpoint reads a body
MAX_LINE_BYTES = 4 * 1024  # request line and each header
HANDLER_TIMEOUT_S = 10.0
MAX_JOB_NAME = 256
MAX_RANK = 1 << 24  # above any world size; a rank parameter beyond it is a mistake or a probe
HEAD_TIMEOUT_S = 10.0  # a connection's request line and headers must arrive within this, before any check
MAX_CONNECTIONS = 256  # open connections at once; more are answered 503 and closed before they are read
MIN_COOLDOWN_S = 2.0  # after a capture the next waits as long as it took, at least this


@web.middleware
async def _time_limit(request: web.Request, handler: Handler) -> web.StreamResponse:
    # A route's handler may take longer by its own bound (a trace capture: its capped duration).
    limit = HANDLER_TIMEOUT_S + getattr(request.match_info.handler, "extra_time_s", 0.0)
    try:
        return await asyncio.wait_for(handler(request), limit)
    except asyncio.TimeoutError:
        raise web.HTTPServiceUnavailable(text=f"request took longer than {limit:.0f} s\n") from None


def secure_app(access: Access | str | None = None) -> web.Application:
    """An application with the request limits and the access check (a bare token: the read token alone)."""
    access = access if isinstance(access, Access) else Access(read=access)
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_time_limit, access_check(access)])

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app.router.add_get("/healthz", healthz)
    return app


def tls_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """A server context of a certificate chain and its key (PEM files); None without them. ListenError if they
    cannot be loaded."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ListenError("--tls-cert and --tls-key go together")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ListenError(f"cannot load the TLS certificate or key: {getattr(e, 'strerror', None) or e}") from None
    return context


class _Refused(asyncio.Protocol):
    """A connection over the cap: answered 503 and closed, nothing read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        transport.close()


class _Guarded(asyncio.Protocol):
    """aiohttp's handler of one connection, closed unless its first request's head (up to the blank line)
    arrives within `head_timeout_s`; later requests of the connection are bounded by the keep-alive timeout,
    which is the same (aiohttp closes a connection idle or mid-head at it)."""

    def __init__(self, inner: asyncio.Protocol, head_timeout_s: float, live: weakref.WeakSet[_Guarded]):
        self.inner, self.head_timeout_s, self.live = inner, head_timeout_s, live
        live.add(self)
        self._tail = b""
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._timer = asyncio.get_running_loop().call_later(self.head_timeout_s, transport.close)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._timer is not None:
            seen = self._tail + data
            if b"\r\n\r\n" in seen:
                self._timer.cancel()
                self._timer = None
            self._tail = seen[-3:]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.live.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class GuardedSite(web.TCPSite):
    """A TCP site whose connections are capped and must send their request head in time, before aiohttp
    parses anything further or the access check runs."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, ssl_context: ssl.SSLContext | None,
                 max_connections: int, head_timeout_s: float):
        super().__init__(runner, host, port, ssl_context=ssl_context)
        self.max_connections, self.head_timeout_s = max_connections, head_timeout_s
        self.live: weakref.WeakSet[_Guarded] = weakref.WeakSet()  # a handshake that fails never calls back

    def _protocol(self) -> asyncio.Protocol:
        if len(self.live) >= self.max_connections:
            return _Refused()
        assert self._runner.server is not None
        return _Guarded(self._runner.server(), self.head_timeout_s, self.live)

    async def start(self) -> None:
        await web.BaseSite.start(self)
        self._server = await asyncio.get_running_loop().create_server(
            self._protocol, self._host, self._port, ssl=self._ssl_context, backlog=self._backlog,
            ssl_handshake_timeout=self.head_timeout_s if self._ssl_context else None)


async def start_site(app: web.Application, host: str, port: int, tls: ssl.SSLContext | None = None,
                     max_connections: int = MAX_CONNECTIONS, head_timeout_s: float = HEAD_TIMEOUT_S) -> web.AppRunner:
    # Extra keywords reach aiohttp's request handler (handler_args belongs to web.Application).
    runner = web.AppRunner(app, access_log=None, max_line_size=MAX_LINE_BYTES, max_field_size=MAX_LINE_BYTES,
                           keepalive_timeout=head_timeout_s)
    await runner.setup()
    try:
        await GuardedSite(runner, host, port, tls, max_connections, head_timeout_s).start()
    except OSError as e:
        await runner.cleanup()
        raise ListenError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return runner


def job_query(request: web.Request) -> str | None:
    job = request.query.get("job")
    if job is not None and len(job) > MAX_JOB_NAME:
        raise web.HTTPBadRequest(text=f"job name longer than {MAX_JOB_NAME} characters\n")
    return job


def select_diagnosis(diagnoses: Mapping[str, dict[str, Any]], request: web.Request) -> dict[str, Any]:
    """The document `?job=` names; without it the only job's (an empty document when none is watched)."""
    job = job_query(request)
    if job is not None:
        if job not in diagnoses:
            raise web.HTTPNotFound(text=f"no such job: {job!r}; known: {sorted(diagnoses)[:64]}\n")
        return diagnoses[job]
    if len(diagnoses) > 1:
        raise web.HTTPBadRequest(text=f"several jobs are watched, choose one with ?job=: {sorted(diagnoses)[:64]}\n")
    return next(iter(diagnoses.values()), empty_diagnosis())


def metrics_response(body: bytes) -> web.Response:
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def int_query(request: web.Request, name: str, low: int, high: int) -> int | None:
    """`?name=` as an integer in [low, high]; 400 otherwise (checked before anything is computed from it)."""
    text = request.query.get(name)
    if text is None:
        return None
    value = int(text) if text.lstrip("-").isdigit() and len(text) <= 20 else None
    if value is None or not low <= value <= high:
        raise web.HTTPBadRequest(text=f"{name} must be an integer from {low} to {high}, not {text[:64]!r}\n")
    return value


def choice_query(request: web.Request, name: str, choices: tuple[str, ...], default: str | None) -> str | None:
    text = request.query.get(name, default)
    if text is not None and text not in choices:
        raise web.HTTPBadRequest(text=f"{name} must be one of {', '.join(choices)}, not {text[:64]!r}\n")
    return text


def shard_query(request: web.Request) -> Shard:
    """The replica a pull names (`?replica=i&replicas=N`, N at most MAX_REPLICAS; neither: the only one)."""
    replicas = int_query(request, "replicas", 1, MAX_REPLICAS)
    replica = int_query(request, "replica", 0, MAX_REPLICAS - 1)
    if (replica is None) != (replicas is None):
        raise web.HTTPBadRequest(text="give replica and replicas together\n")
    try:
        return Shard(replica or 0, replicas or 1)
    except ValueError as e:
        raise web.HTTPBadRequest(text=f"{e}\n") from None


def select_profiles(snap: Snapshot, request: web.Request) -> list[RankProfile]:
    """The last window's profiles of `?rank=` (every rank without it) of `?job=` (needed if several jobs
    have such ranks)."""
    rank, job = int_query(request, "rank", 0, MAX_RANK), job_query(request)
    chosen = [p for p in snap.profiles if (rank is None or p.rank == rank) and (job is None or p.job == job)]
    if not chosen:
        raise web.HTTPNotFound(text=f"no profile of rank {rank} (job {job}) in the last window; ranks: "
                                    f"{sorted({(p.job, p.rank) for p in snap.profiles})[:64]}\n")
    if len({p.job for p in chosen}) > 1:
        raise web.HTTPBadRequest(text=f"several jobs have such ranks, choose one with ?job=: "
                                      f"{sorted({p.job for p in chosen})[:64]}\n")
    return chosen


PROFILE_FORMATS = (*FORMATS, "json")  # json: a differential profile only


def profile_response(snap: Snapshot, request: web.Request) -> web.Response:
    """GET /v1/profile?rank=R[&job=J][&format=folded|speedscope|pprof][&what=wall|cpu], or with
    &against=peers the rank's differential profile (format folded or json)."""
    fmt = choice_query(request, "format", PROFILE_FORMATS, "folded")
    what = choice_query(request, "what", WHATS, DEFAULT_WHAT)
    against = choice_query(request, "against", ("peers",), None)
    chosen = select_profiles(snap, request)
    try:
        if against is None:
            body, content_type = encode(chosen, fmt, what)
            return web.Response(body=body, headers={"Content-Type": content_type})
        if len(chosen) != 1:
            raise ValueError("against=peers compares one rank (?rank=R) with its peers")
        d = diff(chosen[0], peers_of(chosen[0], snap.profiles, snap.patterns), what)
    except ValueError as e:
        raise web.HTTPBadRequest(text=f"{e}\n") from None
    if fmt == "json":
        return web.json_response(diff_json(d))
    if fmt != "folded":
        raise web.HTTPBadRequest(text="a differential profile is written as folded or json\n")
    return web.Response(text=folded_diff(d))


@dataclass(frozen=True)
class TraceAsk:
    """What `/v1/trace?seconds=S[&rank=R][&job=J]` asks for, checked on the event loop before any capture."""

    seconds: float
    job: str | None
    rank: int | None

    @classmethod
    def of(cls, request: web.Request) -> TraceAsk:
        text = request.query.get("seconds", "5")
        try:
            seconds = float(text) if len(text) <= 32 else float("nan")
        except ValueError:
            raise web.HTTPBadRequest(text=f"seconds must be a number, not {text[:64]!r}\n") from None
        if not 0 < seconds <= MAX_SECONDS:
            raise web.HTTPBadRequest(text=f"seconds must be positive and at most {MAX_SECONDS:g}\n")
        return cls(seconds, job_query(request), int_query(request, "rank", 0, MAX_RANK))


def trace_response(ask: TraceAsk, trace: TraceCapturer) -> web.Response:
    """A capture of the job's ranks: a zip of their traces, or rank R's trace alone. Runs off the event loop."""
    try:
        docs = trace(ask.seconds, ask.job, ask.rank)
    except CaptureBusy as e:
        raise web.HTTPConflict(text=f"{e}\n") from None
    except LookupError as e:
        raise web.HTTPNotFound(text=f"{e.args[0]}\n") from None
    except ValueError as e:
        raise web.HTTPBadRequest(text=f"{e}\n") from None
    if ask.rank is not None:
        return web.Response(body=chrome.encode(docs[0]), content_type=chrome.CONTENT_TYPE)
    return web.Response(body=chrome.zipped(docs), content_type=chrome.ZIP_CONTENT_TYPE,
                        headers={"Content-Disposition": 'attachment; filename="rankscope-trace.zip"'})


class CaptureGate:
    """Captures (stacks, traces) one at a time on a thread of their own, never the windows' executor, and
    after each a cool-down as long as it took (at least `min_cooldown_s`): a trace emits events in the ranks
    at most half the time, however often it is asked for. Busy: 409; cooling down: 429 with Retry-After."""

    def __init__(self, min_cooldown_s: float = MIN_COOLDOWN_S, clock: Callable[[], float] = time.monotonic):
        self.min_cooldown_s, self.clock = min_cooldown_s, clock
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="rankscope-capture")
        self.running = False
        self.ready_at = 0.0

    async def run(self, work: Callable[[], web.StreamResponse]) -> web.StreamResponse:
        now = self.clock()
        if self.running:
            raise web.HTTPConflict(text="another capture is running\n")
        if now < self.ready_at:
            wait = self.ready_at - now
            raise web.HTTPTooManyRequests(text=f"captures cool down: try again in {wait:.1f} s\n",
                                          headers={"Retry-After": str(int(wait) + 1)})
        self.running = True
        loop = asyncio.get_running_loop()
        future = self.executor.submit(work)
        # Released when the thread ends, not when the request does (a timeout or a client gone leaves it running).
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._done, now))
        return await asyncio.shield(asyncio.wrap_future(future))

    def _done(self, started: float) -> None:
        end = self.clock()
        self.running = False
        self.ready_at = end + max(self.min_cooldown_s, end - started)


def make_app(current: Callable[[], Snapshot], token: Access | str | None = None,
             stacks: Callable[[], dict[str, Any]] | None = None,
             trace: TraceCapturer | None = None, gate: CaptureGate | None = None) -> web.Application:
    gate = gate or CaptureGate()

    async def targets(_: web.Request) -> web.Response:
        snap = current()
        return web.json_response({"targets": [asdict(t) for t in snap.targets], "errors": snap.errors,
                                  "skipped": snap.skipped,
                                  "window_end": snap.window_end})  # None until the first window closes

    async def patterns(request: web.Request) -> web.Response:
        shard = shard_query(request)  # a replica of a sharded cluster analyzer asks for its own jobs' patterns only
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

    @capture_route
    async def thread_stacks(_: web.Request) -> web.StreamResponse:
        # Reads /proc/PID/mem of every rank.
        return await gate.run(lambda: web.json_response(stacks()))

    @capture_route
    async def trace_capture(request: web.Request) -> web.StreamResponse:
        ask = TraceAsk.of(request)
        return await gate.run(lambda: trace_response(ask, trace))

    trace_capture.extra_time_s = MAX_SECONDS

    app = secure_app(token)
    app.router.add_get("/v1/targets", targets)
    if trace is not None:
        app.router.add_get("/v1/trace", trace_capture)
        app.router.add_post("/v1/trace", trace_capture)
    app.router.add_get("/v1/profile", profile)
    if stacks is not None:
        app.router.add_get("/v1/stacks", thread_stacks)
        app.router.add_post("/v1/stacks", thread_stacks)
    app.router.add_get("/v1/patterns", patterns)
    app.router.add_get("/v1/diagnosis", diagnosis)
    app.router.add_get("/metrics", metrics)
    add_page(app, lambda: current().history)
    return app


async def serve_windows(app: web.Application, host: str, port: int, window_s: float,
                        tick: Callable[[], Awaitable[Any]], name: str,
                        first: Callable[[], Awaitable[Any]] | None = None, tls: ssl.SSLContext | None = None) -> None:
    """Serve `app`, await `first()` once, then `tick()` every window until SIGTERM/SIGINT; a failing window
    keeps the last good snapshot."""
    runner = await start_site(app, host, port, tls)
    log.info("%s serving on %s://%s:%d", name, "https" if tls else "http", host, port)
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
