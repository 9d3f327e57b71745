"""The program's BPF text defines exactly the entry points its declared probes attach, each once: the Python
declaration is the one list of a kind's symbols, and the macro lines (one per handler shape, shared by
the symbols of that shape) are generated from it."""
import re

import pytest

from rankscope import bpf as bpf_sources
from rankscope.agent.loader.program import function_ids
from rankscope.agent.sources.probes import KINDS
from rankscope.agent.sources.probes.base import bpf_text
from rankscope.agent.sources.probes.gloo import GLOO, MangledProbe

_DEFINE = re.compile(r"^#define (\w+)\(([^)]*)\)((?:[^\n]*\\\n)*[^\n]*)", re.M)
_HAND_WRITTEN = re.compile(r"^int (enter|return)_(\w+)\(struct pt_regs \*ctx\)", re.M)


def _macros() -> dict[str, tuple[int, bool]]:
    """common.h's handler macros: name -> (arguments after the shape's name, whether it defines return_)."""
    out = {}
    for name, params, body in _DEFINE.findall(bpf_sources.source("common.h")):
        if "enter_##" in body:
            out[name] = (len(params.split(",")) - 1, "return_##" in body)
    return out


def _arguments(inside: str) -> list[str]:
    """A macro call's arguments, split at the commas outside parentheses."""
    args, depth, cur = [], 0, ""
    for ch in inside:
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
            continue
        depth += {"(": 1, ")": -1}.get(ch, 0)
        cur += ch
    return args + [cur.strip()]


def _entry_points(text: str) -> tuple[list[str], list[str]]:
    """The names given enter_ and return_ handlers in a kind's text, macro lines expanded as common.h does."""
    macros = _macros()
    enters, returns = [], []
    for line in text.splitlines():
        m = re.fullmatch(r"(\w+)\((.*)\)", line.strip())
        if m and m.group(1) in macros:
            arity, has_return = macros[m.group(1)]
            name, *args = _arguments(m.group(2))
            assert len(args) == arity, line
            enters.append(name)
            if has_return:
                returns.append(name)
    for which, name in _HAND_WRITTEN.findall(text):
        (enters if which == "enter" else returns).append(name)
    return enters, returns


@pytest.mark.parametrize("kinds", [(k,) for k in KINDS] + [KINDS], ids=[k.name for k in KINDS] + ["all"])
def test_the_text_defines_each_program_its_probes_attach_once(kinds):
    enters, returns = _entry_points(bpf_text(kinds))
    probes = [p for kind in kinds for p in kind.probes]
    assert sorted(enters) == sorted({p.enter_program.removeprefix("enter_") for p in probes})  # each once
    assert sorted(returns) == sorted({p.return_program.removeprefix("return_") for p in probes if p.returns})


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_a_kinds_own_file_defines_only_its_hand_written_handlers(kind):
    own, _ = _entry_points(bpf_sources.source(kind.source))
    assert own == [p.name for p in kind.probes if p.handler.macro is None]


def test_symbols_of_one_shape_share_a_program_and_other_shapes_do_not():
    lines = [line for line in bpf_text((GLOO,)).splitlines() if line.startswith(("COLLECTIVE(", "COUNTED(", "TIMED("))]
    assert [_arguments(line.split("(", 1)[1][:-1])[1:] for line in lines] == [
        ["gloo_payload(PT_REGS_PARM1(ctx), 80)", "true"], ["gloo_payload(PT_REGS_PARM1(ctx), 32)", "true"],
        ["0", "true"], ["0"], ["0"]]  # the 3 collectives' payloads differ; send/recv share allgather's; the rest
    by_name = {p.name: p for p in GLOO.probes}
    assert by_name["gloo_allgather"].enter_program == by_name["gloo_send"].enter_program
    assert by_name["gloo_allreduce"].enter_program != by_name["gloo_broadcast"].enter_program
    assert len({p.enter_program for p in GLOO.probes if p.handler.macro == "COUNTED"}) == 1
    assert all(isinstance(p, MangledProbe) and p.symbol.startswith("_Z") for p in GLOO.probes)


def test_function_ids_follow_the_declarations():
    ids = function_ids(KINDS)
    assert list(ids) == [p.name for kind in KINDS for p in kind.probes]
    assert ids["cuLaunchKernel"] == 1 and ids["cudaStreamSynchronize"] == 18 and ids["ncclAllReduce"] == 28
    assert ids["gc_collect_main"] == len(ids) == 51
