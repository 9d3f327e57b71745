"""The `rankscope` command line: diagnose, agent, cluster, sim, demo; profile, trace and dump; history. The
commands, the HTTP API and the diagnosis document are described in docs/api.md; the document's JSON Schema
ships as rankscope/schema/diagnosis.schema.json."""
from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import ssl
import sys
import urllib.parse
from collections.abc import Callable
from contextlib import ExitStack
from typing import TYPE_CHECKING

import rankscope
from rankscope.agent.detail import DEEP, DEEP_SECONDS, LEVELS, LIGHT, Detail, SlowdownTrigger
from rankscope.agent.host.targets import TargetError
from rankscope.agent.loader.program import ProbeError
from rankscope.agent.observe import observe
from rankscope.agent.report import render
from rankscope.agent.service.auth import (CAPTURE_TOKEN_ENV, TOKEN_ENV, Access, ListenError, TokenError, check_bind,
                                          load_token)
from rankscope.agent.session import Session
from rankscope.agent.sources.python_exact import TracedFunction
from rankscope.analyzer.baseline import SLOWDOWN_THRESHOLD
from rankscope.analyzer.diagnosis import diagnose
from rankscope.analyzer.rules.hangs import DEFAULT_HANG_TIMEOUT_S


if TYPE_CHECKING:
    from rankscope.agent.service.history_store import HistoryStore
    from rankscope.agent.service.notify import Notifier

DEFAULT_AGENT_LISTEN = "127.0.0.1:9464"


class UsageError(Exception):
    """Bad input: reported as one line on stderr with exit status 2."""


def parse_pids(text: str) -> list[int]:
    try:
        pids = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise UsageError(f"--pid takes comma-separated process ids, got {text!r}") from None
    if not pids:
        raise UsageError("--pid needs at least one process id")
    return pids


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--listen takes HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def parse_agent_url(text: str) -> str:
    parts = urllib.parse.urlsplit(text)
    try:
        valid = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 0) >= 0
    except ValueError:  # `.port` of a port that is not a number in range
        valid = False
    if not valid:
        raise UsageError(f"--agent takes the agent's URL, http://HOST:PORT, got {text!r}")
    return text


def parse_traced(texts: list[str] | None) -> tuple[TracedFunction, ...]:
    try:
        return tuple(TracedFunction.parse(t) for t in texts or ())
    except ValueError as e:
        raise UsageError(f"--trace-function: {e}") from None


def make_session(args: argparse.Namespace, detail: Detail) -> Session:
    traced = parse_traced(args.trace_function)
    inject = getattr(args, "inject_shim", False)
    allow = tuple(getattr(args, "inject_allow", None) or ())
    if allow and not inject:
        raise UsageError("--inject-allow says where --inject-shim may load the shim: give --inject-shim too")
    if inject:
        if os.geteuid() != 0:
            raise UsageError("--inject-shim needs root: it loads the CUPTI shim into the processes with ptrace")
        logging.getLogger("rankscope.agent.inject").setLevel(logging.INFO)  # say what was done to each process
    try:
        return Session(traced=traced, detail=detail, inject_shim=inject, inject_allow=allow)
    except ValueError as e:  # too many functions to trace
        raise UsageError(f"--trace-function: {e}") from None


def cmd_diagnose(args: argparse.Namespace) -> int:
    if args.duration <= 0 or args.hang_timeout <= 0:
        raise UsageError("--duration and --hang-timeout must be positive")
    pids = parse_pids(args.pid)
    if args.agent is not None:
        return diagnose_through_agent(args, pids)
    try:  # opened before attaching: a path that cannot be written fails before the job is touched
        save = open(args.save_patterns, "wb") if args.save_patterns else None
    except OSError as e:
        raise UsageError(f"--save-patterns: cannot write {args.save_patterns}: {e.strerror}") from None
    session = make_session(args, DEEP)  # one bounded look, asked for: full detail
    try:
        doc = observe(session, pids, args.duration, args.hang_timeout,
                      watching=lambda line: print(line, file=sys.stderr, flush=True), save=save)
        print(json.dumps(doc) if args.json else render(doc), flush=True)
    finally:
        session.close()
        if save is not None:
            save.close()
            if os.path.getsize(args.save_patterns) == 0:  # nothing observed (attaching failed): no empty file
                os.remove(args.save_patterns)
    return 0


def diagnose_through_agent(args: argparse.Namespace, pids: list[int]) -> int:
    """`diagnose --agent URL`: the node agent's document for the job, nothing attached here."""
    from rankscope.agent.ask_agent import AgentError, ask_agent

    chosen = [flag for flag, on in (("--save-patterns", args.save_patterns), ("--trace-function", args.trace_function),
                                    ("--inject-shim", args.inject_shim),
                                    ("--inject-allow", args.inject_allow),
                                    ("--hang-timeout", args.hang_timeout != DEFAULT_HANG_TIMEOUT_S)) if on]
    if chosen:
        raise UsageError(f"{', '.join(chosen)}: the agent's own settings apply with --agent")
    try:
        doc = ask_agent(parse_agent_url(args.agent), pids, args.duration, load_token(args.token_file),
                        watching=lambda line: print(line, file=sys.stderr, flush=True))
    except AgentError as e:
        raise UsageError(str(e)) from None
    print(json.dumps(doc) if args.json else render(doc), flush=True)
    return 0


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def cmd_profile(args: argparse.Namespace) -> int:
    from rankscope.agent.capture import sampled

    if args.duration <= 0:
        raise UsageError("--duration must be positive")
    if args.format == "json" and args.diff is None:
        raise UsageError("--format json is the listing of a --diff")
    if args.diff is not None and args.format not in ("folded", "json"):
        raise UsageError("a --diff is written as folded (flamegraph.pl's differential input) or json")
    pids = parse_pids(args.pid)
    try:  # opened before attaching: a path that cannot be written fails before the job is touched
        out = open(args.output, "wb") if args.output else sys.stdout.buffer
    except OSError as e:
        raise UsageError(f"-o: cannot write {args.output}: {e.strerror}") from None
    try:
        with ExitStack() as attached:
            try:
                profiles = attached.enter_context(sampled(pids, args.duration, args.rate, watching=_say))
            except ValueError as e:  # a sampling rate out of range
                raise UsageError(f"--rate: {e}") from None
            out.write(_profile_body(args, profiles))  # before the sampler detaches: it waits for the kernel
            out.flush()
    finally:
        if out is not sys.stdout.buffer:
            out.close()
    return 0


def _profile_body(args: argparse.Namespace, profiles: list) -> bytes:
    """What `profile` writes: the profiles in --format, or the --diff of a rank against its peers."""
    from rankscope.agent.views.folded import folded_diff
    from rankscope.agent.views.formats import encode
    from rankscope.agent.views.profile import diff, diff_json, diff_summary

    if args.diff is None:
        return encode(profiles, args.format, args.what)[0]
    target = next((p for p in profiles if p.rank == args.diff), None)
    if target is None or len(profiles) < 2:
        raise UsageError(f"--diff {args.diff}: needs that rank and at least one peer among "
                         f"the ranks {sorted(p.rank for p in profiles)}")
    d = diff(target, [p for p in profiles if p is not target], args.what)
    print(diff_summary(d), file=sys.stderr, flush=True)
    return (json.dumps(diff_json(d)) + "\n" if args.format == "json" else folded_diff(d)).encode()


def cmd_trace(args: argparse.Namespace) -> int:
    from rankscope.agent.observe import watch
    from rankscope.agent.trace_capture import MAX_SECONDS, capture
    from rankscope.agent.views import trace as chrome

    if not 0 < args.duration <= MAX_SECONDS:
        raise UsageError(f"--duration must be positive and at most {MAX_SECONDS:g} s")
    pids = parse_pids(args.pid)
    try:  # before attaching: a path that cannot be written fails before the job is touched
        os.makedirs(args.output, exist_ok=True)
        if not os.access(args.output, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise UsageError(f"-o: cannot write to {args.output}: {e.strerror}") from None
    session = make_session(args, DEEP)  # one bounded look, asked for: kernel launches and forward timed too
    try:
        job = watch(session, pids)
        session.window()  # the capture starts once every process is watched
        print(f"rankscope: tracing {len(pids)} {'process' if len(pids) == 1 else 'processes'} of job {job} "
              f"for {args.duration:g} s", file=sys.stderr, flush=True)
        cap = capture(session.trace_streams(), pids, args.duration)
        functions = chrome.functions_of(session.program)
        patterns = session.window()  # the capture's own window: each rank's step split beside its trace
        rows = {r["pid"]: r for doc in diagnose(patterns, DEFAULT_HANG_TIMEOUT_S).values() for r in doc["ranks"]}
        for pattern in patterns:
            row = rows.get(pattern.pid)
            doc = chrome.chrome_trace(chrome.RankInfo.of(pattern), cap, functions, row)
            path = os.path.join(args.output, chrome.file_name(pattern.rank))
            with open(path, "wb") as f:
                f.write(chrome.encode(doc))
            split = (f"step {row['step_time_s'] * 1e3:.1f} ms, comm {row['comm_s'] / row['step_time_s']:.0%}; "
                     if row and row.get("step_time_s") else "")
            print(f"rankscope: rank {pattern.rank}: {split}{len(doc['traceEvents'])} events -> {path}",
                  file=sys.stderr)
        if cap.lost:
            print(f"rankscope: {cap.lost} events lost (shown in the traces)", file=sys.stderr)
    finally:
        session.close()
    return 0


def cmd_dump(args: argparse.Namespace) -> int:
    from rankscope.agent.capture import ranks_of
    from rankscope.agent.views.dump import dump, render, to_json

    pids = parse_pids(args.pid)
    ranks = ranks_of(pids)
    groups, errors = dump([(pid, ranks[pid][1]) for pid in pids])
    if not groups:
        raise UsageError("; ".join(errors) or "no Python thread found")
    print(json.dumps(to_json(groups, errors)) if args.json else render(groups, errors), end="" if not args.json
          else "\n", flush=True)
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    import asyncio

    from rankscope.agent.daemon import Agent, serve
    from rankscope.agent.service.http import tls_context

    host, port = parse_listen(args.listen)
    if args.window <= 0 or args.hang_timeout <= 0 or args.slowdown_threshold <= 0:
        raise UsageError("--window, --hang-timeout and --slowdown-threshold must be positive")
    if not args.all and not args.pid:
        raise UsageError("name the processes to watch with --pid, or --all for every training process")
    try:
        trigger = SlowdownTrigger(args.deep_seconds, LEVELS.get(args.detail))
    except ValueError as e:
        raise UsageError(str(e)) from None
    access = Access(load_token(args.token_file), load_token(args.capture_token_file, CAPTURE_TOKEN_ENV))
    check_bind(host, access, args.require_token)  # before attaching anything
    tls = tls_context(args.tls_cert, args.tls_key)
    if access.capture is None and access.read is not None and not args.no_captures:
        logging.getLogger(__name__).warning("the token also grants captures (/v1/stacks, /v1/trace): give them "
                                            "their own with --capture-token-file, or --no-captures")
    notify, history = notifier(args, "agent"), history_store(args, "agent")
    session = make_session(args, trigger.fixed or LIGHT)
    for pid in parse_pids(args.pid) if args.pid else []:
        session.add(pid)
    agent = Agent(session, discover_all=args.all, hang_timeout_s=args.hang_timeout, trigger=trigger,
                  slowdown_threshold=args.slowdown_threshold, history=history(), notifier=notify)
    asyncio.run(serve(agent, host, port, args.window, access, captures=not args.no_captures, tls=tls))
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    import asyncio

    from rankscope.agent.service.cluster_analyzer import AgentListError, Cluster, parse_agents, serve_cluster
    from rankscope.agent.service.http import tls_context
    from rankscope.agent.service.shard import Shard, ordinal

    host, port = parse_listen(args.listen)
    if args.window <= 0 or args.timeout <= 0 or args.hang_timeout <= 0 or args.concurrency < 1:
        raise UsageError("--window, --timeout, --hang-timeout and --concurrency must be positive")
    if bool(args.agents) == bool(args.agents_file):
        raise UsageError("name the agents with --agents URL[,URL...] or --agents-file FILE (one of them)")
    try:
        if args.agents:
            entries = args.agents.split(",")
        else:
            with open(args.agents_file) as f:
                entries = f.read(1 << 20).splitlines()
        agents = parse_agents(entries)
    except OSError as e:
        raise UsageError(f"cannot read the agents file: {e.strerror}: {args.agents_file}") from None
    except (AgentListError, UnicodeDecodeError) as e:
        raise UsageError(str(e)) from None
    try:  # a StatefulSet's replica: its ordinal is the number its pod name (the hostname) ends with
        index = args.replica if args.replica is not None else 0 if args.replicas == 1 else ordinal(socket.gethostname())
        shard = Shard(index, args.replicas)
    except ValueError as e:
        raise UsageError(f"--replica/--replicas: {e}") from None
    access = Access(load_token(args.token_file))
    check_bind(host, access, args.require_token)
    tls = tls_context(args.tls_cert, args.tls_key)
    cluster = Cluster(agents, access.read, args.timeout, args.concurrency, args.hang_timeout, args.window, shard,
                      history_store(args, "cluster")(), notifier(args, "cluster"), agents_tls(args.agents_ca))
    asyncio.run(serve_cluster(cluster, host, port, args.window, access, tls))
    return 0


def agents_tls(ca_file: str | None) -> ssl.SSLContext | None:
    if ca_file is None:
        return None
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:
        raise UsageError(f"--agents-ca: cannot load {ca_file}: {getattr(e, 'strerror', None) or e}") from None


def history_store(args: argparse.Namespace, name: str) -> Callable[[], HistoryStore | None]:
    """Opens the service's history on disk as --history-dir and its bounds say (None: memory only) when
    called: the flags are checked now, the directory once the processes are attached (so that an attach
    error stays the one line a failed start prints)."""
    from rankscope.agent.service.history_store import open_store

    if args.history_max_age <= 0 or args.history_max_mb <= 0:
        raise UsageError("--history-max-age and --history-max-mb must be positive")
    directory = None if args.history_dir in ("", "off") else args.history_dir
    return lambda: open_store(directory, name, args.history_max_age * 86400, int(args.history_max_mb * 1024 * 1024))


def notifier(args: argparse.Namespace, component: str) -> Notifier | None:
    """--notify-url's notifier (None without one)."""
    from rankscope.agent.service.notify import Notifier, parse_notify_url

    if not args.notify_url:
        return None
    try:
        return Notifier([parse_notify_url(u) for u in args.notify_url], component)
    except ValueError as e:
        raise UsageError(str(e)) from None


def cmd_history(args: argparse.Namespace) -> int:
    """`rankscope history`: a job's windows and findings, from the agent's /v1/history, or with --history-dir
    from the database on this node (the agent need not run)."""
    from rankscope.agent.history_report import read_agent, read_local, render_history

    query = {k: v for k, v in (("job", args.job), ("since", args.since), ("until", args.until)) if v is not None}
    try:
        if args.history_dir is not None:
            answer = read_local(args.history_dir, args.name, query)
        else:
            answer = read_agent(parse_agent_url(args.agent), query, load_token(args.token_file))
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from None
    print(json.dumps(answer) if args.json else render_history(answer), end="\n" if args.json else "", flush=True)
    return 0


def cmd_sim(args: argparse.Namespace) -> int:
    from rankscope.sim import job

    return job.run(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from rankscope.agent.demo import run_demo

    return run_demo(args.fault, args.duration)


def add_token_file(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", metavar="FILE",
                   help=f"the HTTP API's read token (default: ${TOKEN_ENV}); required to listen beyond loopback")


def add_serving(p: argparse.ArgumentParser) -> None:
    """How the HTTP API is served: TLS, and whether loopback needs the token too."""
    p.add_argument("--require-token", action="store_true",
                   help="refuse to start without a token, on loopback too (other users of the host cannot read)")
    p.add_argument("--tls-cert", metavar="FILE", help="serve HTTPS with this PEM certificate chain (with --tls-key)")
    p.add_argument("--tls-key", metavar="FILE", help="the PEM private key of --tls-cert")


def add_hang_timeout(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hang-timeout", type=float, default=DEFAULT_HANG_TIMEOUT_S, metavar="SECONDS",
                   help=f"no collective completing for this long is a hang (default {DEFAULT_HANG_TIMEOUT_S:.0f})")


def add_history(p: argparse.ArgumentParser) -> None:
    from rankscope.agent.service.history_store import DEFAULT_MAX_AGE_S, DEFAULT_MAX_BYTES, ENV, default_dir

    p.add_argument("--history-dir", default=default_dir() or "off", metavar="DIR",
                   help=f"where every window's step time and findings are kept, across restarts (default: ${ENV} "
                        f"or %(default)s; off: in memory only, the last 20 minutes)")
    p.add_argument("--history-max-age", type=float, default=DEFAULT_MAX_AGE_S / 86400, metavar="DAYS",
                   help="windows older than this are deleted (default %(default)g)")
    p.add_argument("--history-max-mb", type=float, default=DEFAULT_MAX_BYTES / 1024 / 1024, metavar="MB",
                   help="the oldest windows are deleted while the history is larger (default %(default)g)")


def add_notify_url(p: argparse.ArgumentParser) -> None:
    p.add_argument("--notify-url", action="append", metavar="URL",
                   help="POST a JSON event (Alertmanager's webhook payload with a chat `text` line) to URL when a "
                        "finding starts and when it ends; repeatable")


def add_trace_function(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace-function", action="append", metavar="MODULE:QUALNAME",
                   help="also time every call of this Python function exactly (repeatable; calls that enter "
                        "the interpreter from C, e.g. callbacks, iterators; every call on 3.10)")


def add_inject_shim(p: argparse.ArgumentParser) -> None:
    p.add_argument("--inject-shim", action="store_true",
                   help="GPU kernel times for processes started without CUDA_INJECTION64_PATH: load the CUPTI shim "
                        "into each one that runs CUDA (root; ptrace holds one of its threads for about a millisecond "
                        "on an idle host). This changes "
                        "the process: the shim stays loaded, and CUPTI records its kernels from then on (NCCL's "
                        "profiler plugin cannot be loaded late)")
    p.add_argument("--inject-allow", action="append", metavar="PATTERN",
                   help="with --inject-shim, load the shim only into processes whose cgroup path, container id or "
                        "Kubernetes pod UID matches this shell pattern (repeatable; e.g. '*pod1f2e*' or "
                        "'/kubepods.slice/*'); by default every process that runs CUDA")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rankscope", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the agent does")
    parser.add_argument("--version", action="version", version=f"rankscope {rankscope.version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("diagnose", help="attach to a job's ranks, observe, print the diagnosis")
    p.add_argument("--pid", required=True, help="comma-separated PIDs of the ranks on this machine")
    p.add_argument("--duration", type=float, default=10.0, help="seconds to observe (default 10)")
    p.add_argument("--json", action="store_true", help="print the diagnosis document as JSON")
    p.add_argument("--save-patterns", metavar="FILE",
                   help="also write the observed patterns to FILE (msgpack, as GET /v1/patterns serves them): "
                        "the raw data behind the verdict, to analyze again or attach to a report")
    p.add_argument("--agent", nargs="?", const=f"http://{DEFAULT_AGENT_LISTEN}", metavar="URL",
                   help="ask the node agent already watching the job (default URL: "
                        f"http://{DEFAULT_AGENT_LISTEN}) instead of attaching: its document of the first window "
                        "closing --duration seconds from now; nothing is compiled or attached here")
    add_token_file(p)
    add_hang_timeout(p)
    add_trace_function(p)
    add_inject_shim(p)
    p.set_defaults(func=cmd_diagnose)

    p = sub.add_parser("profile", help="sample the Python stacks of running processes, write a flame graph's input")
    p.add_argument("--pid", required=True, help="comma-separated PIDs (any CPython 3.10-3.14 processes)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds to sample (default 10)")
    p.add_argument("--format", choices=["folded", "speedscope", "pprof", "json"], default="folded",
                   help="folded stacks (default), speedscope JSON, pprof (gzipped protobuf); json: a --diff's listing")
    p.add_argument("--what", choices=["wall", "cpu"], default="wall",
                   help="wall: time on and off CPU (default: a step is wall time, waits show); cpu: on CPU only")
    p.add_argument("--rate", type=int, default=99, help="samples per second while on CPU (default 99)")
    p.add_argument("--diff", type=int, metavar="RANK",
                   help="compare RANK with the median of the other processes: what grew, per second of the window")
    p.add_argument("-o", "--output", metavar="PATH", help="write to PATH (default: stdout)")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("trace", help="record a timeline of each rank: Chrome trace JSON for Perfetto and HTA")
    p.add_argument("--pid", required=True, help="comma-separated PIDs of the ranks on this machine")
    p.add_argument("--duration", type=float, default=5.0, help="seconds to record (default 5, at most 60)")
    p.add_argument("-o", "--output", default="rankscope-trace", metavar="DIR",
                   help="directory for the traces, rank<R>.trace.json each (default rankscope-trace)")
    add_trace_function(p)
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("dump", help="every thread's Python stack of running processes, now, without stopping them")
    p.add_argument("--pid", required=True, help="comma-separated PIDs (any CPython 3.10-3.14 processes)")
    p.add_argument("--json", action="store_true", help="print the document GET /v1/stacks serves")
    p.set_defaults(func=cmd_dump)

    p = sub.add_parser("agent", help="the node daemon: watch ranks, serve patterns and diagnosis over HTTP")
    p.add_argument("--listen", default=DEFAULT_AGENT_LISTEN, help=f"HOST:PORT to serve on (default {DEFAULT_AGENT_LISTEN})")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--pid", help="comma-separated PIDs to watch")
    who.add_argument("--all", action="store_true", help="discover every training process on the node")
    p.add_argument("--window", type=float, default=5.0, help="seconds per observation window (default 5)")
    p.add_argument("--slowdown-threshold", type=float, default=SLOWDOWN_THRESHOLD, metavar="FRACTION",
                   help="a job this much slower than its baseline steps (and beyond their noise) is a `regression` "
                        "and triggers deep mode "
                        f"(default {SLOWDOWN_THRESHOLD})")
    p.add_argument("--deep-seconds", type=float, default=DEEP_SECONDS, metavar="SECONDS",
                   help=f"how long deep mode lasts once triggered (default {DEEP_SECONDS:.0f})")
    p.add_argument("--detail", choices=["auto", *LEVELS], default="auto",
                   help="what the agent records: light always-on, deep, or auto (light, deep after a slowdown)")
    add_token_file(p)
    p.add_argument("--capture-token-file", metavar="FILE",
                   help=f"the token that /v1/stacks and /v1/trace need (default: ${CAPTURE_TOKEN_ENV}); with it, "
                        "--token-file's token grants reads only (without it, captures too)")
    p.add_argument("--no-captures", action="store_true", help="serve no /v1/stacks and /v1/trace")
    add_serving(p)
    add_hang_timeout(p)
    add_trace_function(p)
    add_inject_shim(p)
    add_history(p)
    add_notify_url(p)
    p.set_defaults(func=cmd_agent)

    p = sub.add_parser("cluster", help="the cluster analyzer: pull every node agent, diagnose each job over all nodes")
    p.add_argument("--agents", metavar="URL[,URL...]",
                   help="agents as http://HOST:PORT; dns+http://NAME:PORT for every address NAME resolves to")
    p.add_argument("--agents-file", metavar="FILE", help="agent URLs, one a line (# comments)")
    p.add_argument("--listen", default="127.0.0.1:9465", help="HOST:PORT to serve on (default 127.0.0.1:9465)")
    p.add_argument("--window", type=float, default=5.0, help="seconds between pulls (default 5)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds an agent has to answer a pull (default 3)")
    p.add_argument("--concurrency", type=int, default=32, help="agents pulled at once (default 32)")
    p.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="analyzers sharing the jobs (a StatefulSet's replicas; default 1): this one diagnoses the "
                        "jobs whose rendezvous hash falls to its ordinal")
    p.add_argument("--replica", type=int, metavar="I",
                   help="this analyzer's ordinal, 0..N-1 (default: the number the hostname ends with, as a "
                        "StatefulSet's pod name)")
    add_token_file(p)
    add_serving(p)
    p.add_argument("--agents-ca", metavar="FILE",
                   help="PEM certificates that https agents' certificates must chain to (default: the system's)")
    add_hang_timeout(p)
    add_history(p)
    add_notify_url(p)
    p.set_defaults(func=cmd_cluster)

    p = sub.add_parser("history", help="a job's step times and findings over hours or days, kept across restarts")
    p.add_argument("--agent", default=f"http://{DEFAULT_AGENT_LISTEN}", metavar="URL",
                   help=f"the agent (or cluster analyzer) to ask (default http://{DEFAULT_AGENT_LISTEN})")
    p.add_argument("--history-dir", metavar="DIR",
                   help="read the history database in DIR on this node instead of asking a running agent")
    p.add_argument("--name", choices=["agent", "cluster"], default="agent",
                   help="with --history-dir: the agent's database or the cluster analyzer's (default agent)")
    p.add_argument("--job", help="one job (default: every job with windows in the span)")
    p.add_argument("--since", help="start: unix seconds or a duration ago, 90s, 30m, 3h, 7d (default 1h)")
    p.add_argument("--until", help="end, likewise (default now)")
    p.add_argument("--json", action="store_true", help="print what GET /v1/history answers")
    add_token_file(p)
    p.set_defaults(func=cmd_history)

    p = sub.add_parser("sim", help="run a simulated GPU training job (stand-in libcuda/libnccl)")
    from rankscope.sim import job

    job.add_arguments(p)
    p.set_defaults(func=cmd_sim)

    p = sub.add_parser("demo", help="simulate a 4-rank job with an injected fault and diagnose it")
    p.add_argument("--fault", default="slow-gpu:2:2.5", help="fault to inject (default slow-gpu:2:2.5)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds to observe (default 5)")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="rankscope: %(levelname)s %(message)s")
    try:
        return args.func(args)
    except (UsageError, TargetError, ProbeError, TokenError, ListenError) as e:
        print(f"rankscope: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
