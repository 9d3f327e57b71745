"""The diagnosis page (`GET /`) and the step-time history it draws (`GET /v1/history`), on the agent and the
cluster analyzer alike: one self-contained HTML file (inline CSS, JS and SVG; no CDN, no web fonts: clusters
are often air-gapped) whose script fetches /v1/history and each job's /v1/diagnosis every few seconds.
Behind the API's token (auth.py: a browser passes it once as `/?token=`)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from importlib.resources import files

from aiohttp import web

from rankscope.agent.service.history import StepHistory, history_answer

PAGE = files(__package__).joinpath("page.html")
# Served as written; the page is static and fetches everything it shows.
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
           "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                      "img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
                                      "frame-ancestors 'none'"}


def add_page(app: web.Application, history: Callable[[], StepHistory]) -> None:
    """Registers `/` and `/v1/history` on `app` (an application of http.secure_app)."""
    html = PAGE.read_bytes()  # ~20 KB, read once

    async def page(_: web.Request) -> web.Response:
        return web.Response(body=html, content_type="text/html", charset="utf-8", headers=HEADERS)

    async def steps(request: web.Request) -> web.Response:
        query, now = dict(request.query), time.time()
        try:  # reads the disk: off the event loop
            answer = await asyncio.get_running_loop().run_in_executor(None, history_answer, history(), query, now)
        except ValueError as e:
            raise web.HTTPBadRequest(text=f"{e}\n") from None
        return web.json_response(answer)

    app.router.add_get("/", page)
    app.router.add_get("/v1/history", steps)
