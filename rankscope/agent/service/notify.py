"""--notify-url: a JSON POST when a finding starts and when it ends, once each (not every window), to every
URL given. The body is Alertmanager's webhook payload (version 4: `status`, `alerts` with `labels`,
`annotations`, `startsAt`, `endsAt`), so its receivers take it as they take Alertmanager's, plus a `text`
line that chat webhooks (Slack, Mattermost, Teams' workflows) show as the message, and `event`, `job` and
`finding` (the finding as the diagnosis document has it, evidence included).

A window only compares its findings with the last window's and queues the events: each URL has a thread of
its own that posts them in order, waits at most `timeout_s` an attempt, retries a failure (no answer, a
5xx) with backoff, and sends at most `per_minute` events a minute (the rest are dropped with one log line).
So a URL that hangs or fails never delays a window, nor the other URLs. Events are kept in memory: a
restarted service announces the findings it still sees as started again."""
from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from rankscope.agent.service.history import FindingKey, finding_key

log = logging.getLogger(__name__)

TIMEOUT_S = 5.0
ATTEMPTS = 4  # the first and three retries
BACKOFF_S = 2.0  # before the first retry; doubled before each next one
PER_MINUTE = 30  # events sent to one URL in a minute at most
QUEUE_EVENTS = 256  # events waiting for one URL
ZERO_TIME = "0001-01-01T00:00:00Z"  # Alertmanager's endsAt of an alert still firing


def parse_notify_url(text: str) -> str:
    """An http(s) URL with a host; ValueError otherwise."""
    parts = urllib.parse.urlsplit(text)
    try:
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 0) >= 0
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"--notify-url takes an http(s) URL, got {text[:200]!r}")
    return text


@dataclass(frozen=True)
class Event:
    """A finding that started or ended, with the document's finding as it was last reported."""

    kind: str  # "start" | "end"
    job: str
    finding: Mapping[str, Any]
    nodes: tuple[str, ...]  # of its ranks
    started: float  # unix s: end of the first window that reported it
    at: float  # unix s: when this event happened (its start, or the first window without it)

    def payload(self, component: str) -> dict[str, Any]:
        f = self.finding
        status = "firing" if self.kind == "start" else "resolved"
        ranks = ",".join(map(str, f["ranks"]))
        labels = {"alertname": "RankscopeFinding", "job": self.job, "kind": f["kind"], "ranks": ranks,
                  "node": ",".join(self.nodes), "component": component,
                  "severity": "critical" if f["kind"].endswith("_hang") else "warning"}
        verb = "started" if self.kind == "start" else "ended"
        summary = f"{f['kind']} of rank{'s' if len(f['ranks']) > 1 else ''} {ranks} in job {self.job} {verb}"
        text = f"rankscope: {summary}: {f.get('summary', '')} (costs {f.get('cost', 0.0) * 100:.0f}% of step time)"
        group = f"{self.job}/{f['kind']}/{ranks}"
        alert = {"status": status, "labels": labels,
                 "annotations": {"summary": summary, "description": f.get("summary", "")},
                 "startsAt": _iso(self.started), "endsAt": _iso(self.at) if self.kind == "end" else ZERO_TIME,
                 "generatorURL": "", "fingerprint": hashlib.sha1(group.encode()).hexdigest()[:16]}
        return {"version": "4", "status": status, "receiver": "rankscope", "groupKey": group, "truncatedAlerts": 0,
                "groupLabels": {"job": self.job, "kind": f["kind"]}, "commonLabels": labels,
                "commonAnnotations": alert["annotations"], "externalURL": "", "alerts": [alert],
                "text": text, "event": self.kind, "job": self.job, "finding": dict(f)}


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Notifier:
    """Turns each window's documents into start and end events and hands them to every URL's sender."""

    def __init__(self, urls: Sequence[str], component: str, timeout_s: float = TIMEOUT_S,
                 backoff_s: float = BACKOFF_S, per_minute: int = PER_MINUTE):
        self.senders = [_Sender(url, component, timeout_s, backoff_s, per_minute) for url in urls]
        self._open: dict[tuple[str, FindingKey], Event] = {}  # findings reported in the last window

    def update(self, diagnoses: Mapping[str, Mapping[str, Any]], now: float | None = None) -> list[Event]:
        """Queues the events of this window against the last one (never blocks) and returns them."""
        now = time.time() if now is None else now
        seen: dict[tuple[str, FindingKey], Event] = {}
        events: list[Event] = []
        for job, doc in diagnoses.items():
            nodes = {r["rank"]: r.get("host") or "" for r in doc["ranks"]}
            end = doc["window"]["end"] or now
            for f in doc["findings"]:
                key = (job, finding_key(f))
                before = self._open.get(key)
                ranks_nodes = tuple(sorted({nodes.get(r, "") for r in f["ranks"]} - {""}))
                seen[key] = Event("start", job, f, ranks_nodes, before.started if before else end, end)
                if before is None:
                    events.append(seen[key])
        for key, gone in self._open.items():
            if key not in seen:
                job_end = (diagnoses.get(key[0]) or {}).get("window", {}).get("end") or now
                events.append(Event("end", gone.job, gone.finding, gone.nodes, gone.started, job_end))
        self._open = seen
        for sender in self.senders:
            for event in events:
                sender.put(event)
        return events

    def close(self) -> None:
        for sender in self.senders:
            sender.close()


class _Sender:
    """One URL's thread: posts its events in order, with retries and a rate limit."""

    def __init__(self, url: str, component: str, timeout_s: float, backoff_s: float, per_minute: int):
        self.url, self.component = url, component
        self.timeout_s, self.backoff_s, self.per_minute = timeout_s, backoff_s, per_minute
        self._queue: queue.Queue[Event | None] = queue.Queue(QUEUE_EVENTS)
        self._sent: list[float] = []  # monotonic times of the last minute's posts
        self._dropping = False
        self._thread = threading.Thread(target=self._loop, name="notify", daemon=True)
        self._thread.start()

    def put(self, event: Event) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self._drop(f"{QUEUE_EVENTS} events wait already")

    def close(self) -> None:
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout=self.timeout_s)

    def _drop(self, why: str) -> None:
        if not self._dropping:
            log.warning("notifications to %s dropped: %s", self.url, why)
        self._dropping = True

    def _loop(self) -> None:
        while (event := self._queue.get()) is not None:
            now = time.monotonic()
            self._sent = [t for t in self._sent if now - t < 60]
            if len(self._sent) >= self.per_minute:
                self._drop(f"more than {self.per_minute} events a minute")
                continue
            self._sent.append(now)
            if self._post(json.dumps(event.payload(self.component)).encode()):
                self._dropping = False

    def _post(self, body: bytes) -> bool:
        """Posts `body`, retrying no answer and 5xx with backoff; True once accepted."""
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        why = ""
        for attempt in range(ATTEMPTS):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))  # this URL's thread only
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    response.read(1024)
                return True
            except urllib.error.HTTPError as e:
                why = f"HTTP {e.code}"
                if e.code < 500 and e.code != 429:
                    break
            except (urllib.error.URLError, OSError) as e:
                why = str(getattr(e, "reason", e))
        log.warning("notification to %s failed after %d attempts: %s", self.url, attempt + 1, why)
        return False
