"""The GPU kit's translation of SDT argument locations into uprobe_events fetch arguments (every operand form
the shim's notes use: registers, memory at an offset or none, constants, signed sizes)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from gpu_kit.tracefs import fetch_arg, string_arg  # noqa: E402


@pytest.mark.parametrize("operand, fetch", [
    ("8@%rdx", "%dx:u64"),
    ("8@%r11", "%r11:u64"),
    ("8@16(%rax)", "+16(%ax):u64"),
    ("8@(%rcx)", "+0(%cx):u64"),
    ("-4@-24(%rbp)", "-24(%bp):s32"),
    ("2@%rsi", "%si:u16"),
    ("8@$0", "\\0:u64"),
    ("8@$2", "\\2:u64"),
])
def test_sdt_operands_become_fetch_arguments(operand, fetch):
    assert fetch_arg(operand) == fetch


def test_a_pointer_operand_is_read_as_the_string_it_points_to():
    assert string_arg("8@104(%rax)") == "+0(+104(%ax)):string"
    assert string_arg("8@%rdi") == "+0(%di):string"
    assert string_arg("8@$0") is None  # a constant (NULL): no string to read
