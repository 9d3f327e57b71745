"""payload (4): msgpack bytes per rank per window of real patterns of the simulated job."""
from __future__ import annotations

import time

from .harness import BenchError, Context, Row, median, row, start_held_job


def run(ctx: Context) -> tuple[list[Row], dict]:
    from rankscope.agent.session import Session
    from rankscope.schema.wire import encode_patterns

    ranks = 4
    windows = 2 if ctx.quick else 3
    window = 1.0 if ctx.quick else 5.0
    sizes, whole, collectives, biggest = [], [], [], None
    job, hold = start_held_job(ranks, ctx.tmp)
    session = Session()
    try:
        for pid in job.pids:
            session.add(pid)
        hold.touch()
        time.sleep(window)
        session.window()  # set-up calls and the first steps
        for _ in range(windows):
            time.sleep(window)
            pats = session.window()
            sizes += [len(encode_patterns([p])) for p in pats]
            biggest = max([*pats, biggest] if biggest else pats, key=lambda p: len(encode_patterns([p])))
            whole.append(len(encode_patterns(pats)) / len(pats))
            collectives += [len(p.collectives) for p in pats]
    finally:
        session.close()
        job.stop()
    if not min(collectives):
        raise BenchError("a window's pattern has no collectives: not a real training window")
    details = {"ranks": ranks, "window_s": window, "windows": windows, "bytes_per_pattern": sizes,
               "largest_pattern_bytes_by_field": wire_breakdown(biggest),
               "bytes_per_rank_in_a_window_payload": whole, "collectives_per_pattern": collectives}
    return [row("payload", "pattern bytes per rank per window (max)", max(sizes), "B", 2048),
            row("payload", "pattern bytes per rank per window (median)", median(sizes), "B")], details


def wire_breakdown(pattern) -> dict[str, int]:
    """msgpack bytes of each top-level field of a pattern's wire form (where a payload's bytes go)."""
    import msgpack

    from rankscope.schema import wire as codec

    try:
        wire = codec._pattern_to_wire(pattern)
    except AttributeError:  # the wire form's internals changed: the total is still measured
        return {}
    return {k: len(msgpack.packb(v, use_single_float=True)) for k, v in wire.items()}
