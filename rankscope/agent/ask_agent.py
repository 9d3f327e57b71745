"""`rankscope diagnose --agent`: the diagnosis from the node agent that already watches the job, instead of
attaching anew.

A standalone `diagnose` compiles its BPF programs in-process (bcc, LLVM: ~5 s of CPU and ~250 MB here)
before its window can open, and probes the job a second time beside the agent. Asking the agent costs an
HTTP round trip a poll: its programs are compiled and attached, its windows keep closing. What comes back is
the agent's own document for the job: the first of its windows that closes at least `duration` seconds
after the request (a window as long as the agent's `--window`, with the agent's rules for findings held
across windows).
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

POLL_S = 0.25  # between looks at the agent's latest document (each costs it one JSON encoding)
# How long past `duration` to wait for a window to close: an agent's window is 5 s by default, and one
# busy closing a window of many ranks may take a few more.
GRACE_S = 30.0


class AgentError(Exception):
    """The agent cannot answer for these processes; one line a user can act on."""


class _Status(AgentError):
    """The agent answered with an HTTP error status."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def ask_agent(url: str, pids: list[int], duration: float, token: str | None,
              watching: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The agent's diagnosis document of the job `pids` belong to, from its first window that closes at
    least `duration` seconds from now. AgentError when the agent is not there or does not watch them."""
    url = url.rstrip("/")
    asked = time.time()
    deadline = asked + duration + GRACE_S
    while True:  # an agent that has just started lists its processes once its first window closes
        listing = get_json(url, "/v1/targets", token)
        # (an agent older than `window_end` is taken at its word at once)
        if listing.get("window_end", asked) is not None or time.time() > deadline:
            break
        time.sleep(POLL_S)
    targets = {t["pid"]: t for t in listing["targets"]}
    missing = [p for p in pids if p not in targets]
    if missing:
        raise AgentError(f"the agent at {url} does not watch pid {', '.join(map(str, missing))} "
                         f"(it watches {len(targets)} processes): diagnose without --agent attaches to them itself")
    jobs = sorted({targets[p]["job"] for p in pids})
    if len(jobs) > 1:
        raise AgentError(f"the processes belong to different jobs ({', '.join(jobs)}): look at one job at a time")
    job = jobs[0]
    watching(f"rankscope: the agent at {url} watches {len(pids)} {'process' if len(pids) == 1 else 'processes'} "
             f"of job {job}; waiting for its window closing after {duration:g} s")
    query = "/v1/diagnosis?" + urllib.parse.urlencode({"job": job})
    while True:
        try:
            doc = get_json(url, query, token)
        except _Status as e:
            if e.status != 404:  # 404: a job whose first window has not closed yet has no document
                raise
            doc = None
        if doc is not None and (doc.get("window") or {}).get("end", 0) >= asked + duration:
            return doc
        if time.time() > deadline:
            raise AgentError(f"the agent at {url} closed no window of job {job} in {duration + GRACE_S:g} s")
        time.sleep(POLL_S)


def get_json(url: str, path: str, token: str | None) -> dict[str, Any]:
    request = urllib.request.Request(url + path, headers={"Accept": "application/json",
                                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise AgentError(f"the agent at {url} wants a token: --token-file FILE or $RANKSCOPE_TOKEN") from None
        raise _Status(f"the agent at {url} answered {path} with {e.code}: "
                      f"{e.read(200).decode(errors='replace').strip()}", e.code) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise AgentError(f"no agent answers at {url}: {reason}") from None
    except ValueError:
        raise AgentError(f"the agent at {url} answered {path} with something other than JSON") from None
