"""Who may read the HTTP API: loopback by default; any other bind address needs a bearer token.

The endpoints are read-only, but patterns name processes, hosts and Python functions of the jobs, so they are
not served to the network without a shared secret.
"""
from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where served: a command that serves nothing does not load aiohttp (~0.3 s)
    from aiohttp import web

TOKEN_ENV = "RANKSCOPE_TOKEN"
MAX_TOKEN_BYTES = 4096
OPEN_PATHS = frozenset({"/healthz"})  # liveness probes carry no credentials


class TokenError(Exception):
    """A token that cannot be used, or a bind address that needs one: exit 2 with this message."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # any other name may resolve anywhere
        return False


def load_token(path: str | None) -> str | None:
    """The token from `path`, else from $RANKSCOPE_TOKEN, else None."""
    if path is None:
        text = os.environ.get(TOKEN_ENV)
        where = f"${TOKEN_ENV}"
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


class ListenError(Exception):
    """The address cannot be served on (in use, not local, not permitted)."""


def check_bind(host: str, token: str | None) -> None:
    if token is None and not is_loopback(host):
        raise TokenError(f"refusing to serve on {host} without a token: pass --token-file or set ${TOKEN_ENV} "
                         "(or listen on 127.0.0.1)")


Handler = Callable[["web.Request"], Awaitable["web.StreamResponse"]]

# A browser cannot add an Authorization header to a page it navigates to: `GET /?token=T` (the page) checks T
# once and answers with a cookie holding it (HttpOnly: the page's scripts never see it; SameSite=Strict: other
# sites' pages cannot make the browser send it) and a redirect that drops T from the address bar and history.
# No Path attribute: the cookie is scoped to the directory it was set from, so the page works behind a
# path-prefixed proxy (kubectl proxy). Plain HTTP carries the cookie as it carries the header: in the clear.
TOKEN_COOKIE = "rankscope_token"
TOKEN_QUERY = "token"
PAGE_PATH = "/"


def _same(given: str, expected: bytes) -> bool:
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected)  # constant time: no oracle


def bearer_auth(token: str) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    from aiohttp import web

    header, raw = f"Bearer {token}".encode(), token.encode()

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        if _same(request.headers.get("Authorization", ""), header) or _same(request.cookies.get(TOKEN_COOKIE, ""), raw):
            return await handler(request)
        if request.path == PAGE_PATH and _same(request.query.get(TOKEN_QUERY, ""), raw):
            found = web.HTTPSeeOther("./")  # relative: keeps a proxy's path prefix
            found.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="Strict")
            raise found
        raise web.HTTPUnauthorized(text="missing or wrong bearer token (a browser: open /?token=TOKEN once)\n",
                                   headers={"WWW-Authenticate": 'Bearer realm="rankscope"'})

    return middleware
