"""The diagnosis page (`GET /`) and the step-time history it draws (`GET /v1/history`), on the agent and the
cluster analyzer alike: one self-contained HTML file (inline CSS, JS and SVG; no CDN, no web fonts: clusters
are often air-gapped) whose script fetches /v1/history and each job's /v1/diagnosis every few seconds.
Behind the API's token (auth.py: a browser passes it once as `/?token=`)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from importlib.resources import files

from aiohttp import web

from rankscope.agent.service.history import StepPoint

PAGE = files(__package__).joinpath("page.html")
# Served as written; the page is static and fetches everything it shows.
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
           "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                      "img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
                                      "frame-ancestors 'none'"}


def add_page(app: web.Application, history: Callable[[], dict[str, list[StepPoint]]]) -> None:
    """Registers `/` and `/v1/history` on `app` (an application of http.secure_app)."""
    html = PAGE.read_bytes()  # ~20 KB, read once

    async def page(_: web.Request) -> web.Response:
        return web.Response(body=html, content_type="text/html", charset="utf-8", headers=HEADERS)

    async def steps(_: web.Request) -> web.Response:
        return web.json_response({"jobs": {job: [asdict(p) for p in points]
                                           for job, points in sorted(history().items())}})

    app.router.add_get("/", page)
    app.router.add_get("/v1/history", steps)
