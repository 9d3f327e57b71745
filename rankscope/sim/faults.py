"""Faults injected into a simulated job: `KIND:RANK[:ARG][@SECONDS]`; RANK `*` is every rank.

Kept free of package-relative imports: rank.py may run as a plain script under another interpreter.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# kind -> (argument name, its type, whether it is required); None: the kind takes no argument
KINDS: dict[str, tuple[str, type, bool] | None] = {
    "slow-gpu": ("factor", float, True),     # kernel durations multiplied by FACTOR
    "slow-link": ("factor", float, True),    # link bandwidth divided by FACTOR
    "input-stall": ("seconds", float, True), # load_batch sleeps SECONDS more every step
    "slow-cpu": ("factor", float, True),     # load_batch's CPU work multiplied by FACTOR
    "gc": None,                              # cyclic garbage and a full gc.collect() every step
    "hang": ("step", int, True),             # after STEP full steps, never reaches the collective again
}

GRAMMAR = "KIND:RANK[:ARG][@SECONDS] (RANK * for every rank) with KIND one of " + ", ".join(KINDS)
EVERY_RANK = -1  # Fault.rank of RANK `*`: a change of the whole job (a slower driver, dataset, network)


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    arg: float | int | None = None  # factor, seconds or step, per kind
    onset_s: float = 0.0  # delay after the first step before the fault starts

    def applies_to(self, rank: int) -> bool:
        return self.rank in (rank, EVERY_RANK)

    def spec(self) -> str:
        """The SPEC string that parses back to this fault."""
        s = f"{self.kind}:{'*' if self.rank == EVERY_RANK else self.rank}"
        if self.arg is not None:
            s += f":{self.arg}"
        if self.onset_s:
            s += f"@{self.onset_s}"
        return s


def _number(text: str, kind: type, what: str, spec: str) -> float | int:
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"fault {spec!r}: {what} must be {'an integer' if kind is int else 'a number'}, "
                         f"not {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise ValueError(f"fault {spec!r}: {what} must be finite")
    return value


def parse_fault(spec: str) -> Fault:
    """Parses `KIND:RANK[:ARG][@SECONDS]` (e.g. `slow-gpu:2:2.5`, `gc:1@5`, `hang:0:100`); ValueError if bad."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty fault spec; expected {GRAMMAR}")
    text = spec.strip()
    onset = 0.0
    if "@" in text:
        text, _, when = text.partition("@")
        onset = _number(when, float, "the onset (after @)", spec)
        if onset < 0:
            raise ValueError(f"fault {spec!r}: the onset (after @) must be >= 0 seconds")
    parts = text.split(":")
    kind = parts[0].strip().lower()
    if kind not in KINDS:
        raise ValueError(f"fault {spec!r}: unknown kind {parts[0]!r}; expected {GRAMMAR}")
    if len(parts) < 2 or not parts[1].strip():
        raise ValueError(f"fault {spec!r}: missing RANK; expected {GRAMMAR}")
    every = parts[1].strip() == "*"
    rank = EVERY_RANK if every else _number(parts[1].strip(), int, "RANK", spec)
    if rank < 0 and not every:
        raise ValueError(f"fault {spec!r}: RANK must be >= 0")
    param = KINDS[kind]
    args = parts[2:]
    if param is None:
        if args:
            raise ValueError(f"fault {spec!r}: {kind} takes no argument (expected {kind}:RANK[@SECONDS])")
        return Fault(kind, rank, None, onset)
    name, typ, required = param
    if len(args) > 1:
        raise ValueError(f"fault {spec!r}: too many fields; expected {kind}:RANK:{name.upper()}[@SECONDS]")
    if not args or not args[0].strip():
        if required:
            raise ValueError(f"fault {spec!r}: missing {name.upper()}; expected {kind}:RANK:{name.upper()}[@SECONDS]")
        return Fault(kind, rank, None, onset)
    value = _number(args[0].strip(), typ, name.upper(), spec)
    if name == "factor" and value <= 0:
        raise ValueError(f"fault {spec!r}: FACTOR must be > 0")
    if name in ("seconds", "step") and value < 0:
        raise ValueError(f"fault {spec!r}: {name.upper()} must be >= 0")
    return Fault(kind, rank, value, onset)
