"""Who may use the HTTP API, and for what.

Two scopes. `read`: the page, /metrics, diagnoses, targets, patterns, profiles of the last window. `capture`:
the actions that do something to the ranks now (/v1/stacks reads their memory, /v1/trace turns on event
emission): a capture token grants both. A read token alone, with no capture token configured, grants both as
the single token always did; with a capture token configured it grants reads only.

Loopback serves without a token by default (--require-token refuses that); any other bind address needs one,
because patterns name processes, hosts and Python functions of the jobs.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where served: a command that serves nothing does not load aiohttp (~0.3 s)
    from aiohttp import web

TOKEN_ENV = "RANKSCOPE_TOKEN"
CAPTURE_TOKEN_ENV = "RANKSCOPE_CAPTURE_TOKEN"
MAX_TOKEN_BYTES = 4096
OPEN_PATHS = frozenset({"/healthz"})  # liveness probes carry no credentials


class TokenError(Exception):
    """A token that cannot be used, or a bind address that needs one: exit 2 with this message."""


class Scope(Enum):
    READ = "read"
    CAPTURE = "capture"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # any other name may resolve anywhere
        return False


def load_token(path: str | None, env: str = TOKEN_ENV) -> str | None:
    """The token from `path`, else from $`env`, else None."""
    if path is None:
        text = os.environ.get(env)
        where = f"${env}"
    else:
        where = path
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_TOKEN_BYTES + 1)
        except OSError as e:
            raise TokenError(f"cannot read the token file: {e.strerror}: {path}") from None
        if len(raw) > MAX_TOKEN_BYTES:
            raise TokenError(f"token file {path} is larger than {MAX_TOKEN_BYTES} bytes")
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            raise TokenError(f"token file {path} is not ASCII") from None
    if text is None:
        return None
    token = text.strip()
    if not token or any(c.isspace() or not c.isprintable() for c in token):
        raise TokenError(f"the token in {where} is empty or contains spaces or control characters")
    return token


@dataclass(frozen=True)
class Access:
    """The tokens an API is served with; none: open (loopback only)."""

    read: str | None = None
    capture: str | None = None

    def __post_init__(self) -> None:
        if self.read is not None and self.read == self.capture:
            raise TokenError("the capture token must differ from the read token, else it grants nothing more")

    @property
    def open(self) -> bool:
        return self.read is None and self.capture is None

    @property
    def tokens(self) -> tuple[str, ...]:
        """Those granting reads (every configured token)."""
        return tuple(t for t in (self.read, self.capture) if t is not None)

    @property
    def capture_tokens(self) -> tuple[str, ...]:
        """Those granting captures: the capture token, else the read token (the single token's old scope)."""
        return (self.capture,) if self.capture is not None else self.tokens


class ListenError(Exception):
    """The address cannot be served on (in use, not local, not permitted)."""


def check_bind(host: str, access: Access, require_token: bool = False) -> None:
    if not access.open:
        return
    if require_token:
        raise TokenError(f"--require-token: pass --token-file or set ${TOKEN_ENV}")
    if not is_loopback(host):
        raise TokenError(f"refusing to serve on {host} without a token: pass --token-file or set ${TOKEN_ENV} "
                         "(or listen on 127.0.0.1)")


Handler = Callable[["web.Request"], Awaitable["web.StreamResponse"]]


def capture_route(handler: Handler) -> Handler:
    """Marks a route as an action on the ranks: it needs the capture scope."""
    handler.scope = Scope.CAPTURE  # type: ignore[attr-defined]
    return handler


def scope_of(request: web.Request) -> Scope:
    return getattr(request.match_info.handler, "scope", Scope.READ)


# A browser cannot add an Authorization header to a page it navigates to: `GET /?token=T` (the page) checks T
# once and answers with a session cookie and a redirect that drops T from the address bar and history. The
# cookie holds an HMAC of the token and the time it was issued, never the token: cookies ignore ports, so
# every service on the host receives it, and what they receive expires, grants reads only and is no token
# for Prometheus or the API. HttpOnly (the page's scripts never see it), SameSite=Strict, Secure under TLS.
SESSION_COOKIE = "rankscope_session"
LEGACY_COOKIE = "rankscope_token"  # the raw token, as older versions set it: no longer accepted, cleared
SESSION_S = 12 * 3600
TOKEN_QUERY = "token"
PAGE_PATH = "/"
PREFIX_HEADER = "X-Forwarded-Prefix"  # a proxy serving the page under a path says which
MAX_PREFIX = 256


def _same(given: str, expected: str) -> bool:
    # constant time: no oracle
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode("utf-8", "surrogateescape"))


def _matches(given: str, tokens: tuple[str, ...], form: str = "{}") -> bool:
    return any([_same(given, form.format(t)) for t in tokens])  # a list: every token compared, whichever matches


def session_value(token: str, issued: int) -> str:
    mac = hmac.new(token.encode(), f"rankscope-session\0{issued}".encode(), hashlib.sha256).hexdigest()
    return f"{issued}.{mac}"


def session_valid(value: str, tokens: tuple[str, ...], now: float) -> bool:
    issued_text, _, _ = value.partition(".")
    if not issued_text.isdigit() or len(issued_text) > 12:
        return False
    issued = int(issued_text)
    return 0 <= now - issued <= SESSION_S and _matches(value, tuple(session_value(t, issued) for t in tokens))


def cookie_path(request: web.Request) -> str:
    """Where the page lives as the browser sees it: a proxy's prefix when it names one, else the root."""
    prefix = request.headers.get(PREFIX_HEADER, "").rstrip("/")
    safe = prefix.startswith("/") and len(prefix) <= MAX_PREFIX and all(c.isalnum() or c in "/-._~%" for c in prefix)
    return (prefix if safe else "") + "/"


def from_another_site(request: web.Request) -> bool:
    """A browser request that another page made: Fetch metadata says so, or its Origin is not this server's."""
    if request.headers.get("Sec-Fetch-Site", "none") not in ("none", "same-origin"):
        return True
    origin = request.headers.get("Origin")
    return origin is not None and origin != f"{request.scheme}://{request.host}"


def _refuse(status: type[web.HTTPException], text: str) -> web.HTTPException:
    return status(text=text + "\n", headers={"WWW-Authenticate": 'Bearer realm="rankscope"'})


def access_check(access: Access, clock: Callable[[], float] = time.time
                 ) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """The middleware: every path but /healthz needs a read credential, a capture route the capture token in
    an Authorization header (a cookie never starts a capture). Open (no token): loopback only, and no
    capture that another site's page asked for."""
    from aiohttp import web

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        capture = scope_of(request) is Scope.CAPTURE
        if access.open:
            if "Host" in request.headers and not is_loopback(request.url.host or ""):  # DNS rebinding
                raise web.HTTPForbidden(text="served on loopback without a token: address it by a loopback host\n")
            if capture and from_another_site(request):
                raise web.HTTPForbidden(text="a capture cannot be started by another site's page\n")
            return await handler(request)
        bearer = request.headers.get("Authorization", "")
        if capture:
            if _matches(bearer, access.capture_tokens, "Bearer {}"):
                return await handler(request)
            if _matches(bearer, access.tokens, "Bearer {}") or _has_session(request):
                raise _refuse(web.HTTPForbidden, "captures need the capture token (Authorization: Bearer)")
            raise _refuse(web.HTTPUnauthorized, "missing or wrong capture token (Authorization: Bearer)")
        if _matches(bearer, access.tokens, "Bearer {}") or _has_session(request):
            return await handler(request)
        if request.path == PAGE_PATH and _matches(request.query.get(TOKEN_QUERY, ""), access.tokens):
            raise _signed_in(request)
        raise _refuse(web.HTTPUnauthorized, "missing or wrong bearer token (a browser: open /?token=TOKEN once)")

    def _has_session(request: web.Request) -> bool:
        return session_valid(request.cookies.get(SESSION_COOKIE, ""), access.tokens, clock())

    def _signed_in(request: web.Request) -> web.HTTPException:
        found = web.HTTPSeeOther("./")  # relative: keeps a proxy's path prefix
        token = access.tokens[0]
        found.set_cookie(SESSION_COOKIE, session_value(token, int(clock())), path=cookie_path(request),
                         max_age=SESSION_S, httponly=True, samesite="Strict", secure=request.secure)
        found.del_cookie(LEGACY_COOKIE)
        return found

    return middleware
