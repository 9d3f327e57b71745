#!/usr/bin/env python3
"""Generates rankscope/agent/interpreters/cpython/versions/v3_NN.py, one CPython version's Layout each, from that
version's own headers (as py-spy generates its per-version bindings): gen_cpython_layouts.c, compiled against
every installed header set with Py_BUILD_CORE (the internal structures), prints each field's offsetof()/sizeof().

    .venv/bin/python scripts/gen_cpython_layouts.py [INCLUDE_DIR ...]

Without arguments it reads every header set under pyenv's versions and /usr/include, /usr/local/include.
Header sets of one minor version must agree (a process's layout is chosen by its minor version); versions the
C template has no branch for are skipped with a note. Adding a version: install its headers (`pyenv install`),
add its branches to gen_cpython_layouts.c where a field moved, run this; versions/ finds the new module itself.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the rankscope of this checkout, whichever one the virtualenv installed

from rankscope.agent.interpreters.cpython.layout import Layout  # noqa: E402
from rankscope.native import CC, BuildError, run_compiler  # noqa: E402

TEMPLATE = Path(__file__).resolve().with_suffix(".c")
OUT = ROOT / "rankscope" / "agent" / "interpreters" / "cpython" / "versions"
COMMAND = ".venv/bin/python scripts/gen_cpython_layouts.py"
NOT_COVERED = "no layout template for this CPython version"  # the template's #error
_DIR_NAME = re.compile(r"python3\.(\d+)$")  # not python3.13t (free-threaded, refused) nor 3.6's python3.6m


@dataclass(frozen=True)
class Generated:
    """One header set's layout."""

    include: Path
    py_version: str  # PY_VERSION of the headers, "3.11.7"
    layout: Layout

    def version_key(self) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"\d+", self.py_version)[:3])


def header_dirs() -> list[Path]:
    """Every installed CPython 3 header set that has the internal headers."""
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    found = [*pyenv.glob("versions/*/include/python3.*"), *Path("/usr/include").glob("python3.*"),
             *Path("/usr/local/include").glob("python3.*")]
    return sorted(d for d in found if _DIR_NAME.search(d.name) and (d / "internal" / "pycore_runtime.h").is_file())


def generate(include: Path, workdir: Path) -> Generated | None:
    """The layout of the headers in `include`; None for a version the template does not cover."""
    exe = workdir / f"offsets-{include.name}"
    try:
        # -Wfatal-errors: the template's #error for an uncovered version is then the only message
        run_compiler([CC, "-Wfatal-errors", f"-I{include}", "-o", str(exe), str(TEMPLATE)],
                     f"{TEMPLATE.name} against {include}")
    except BuildError as e:
        if NOT_COVERED in str(e):
            return None
        raise
    lines = subprocess.run([str(exe)], capture_output=True, text=True, check=True, timeout=30).stdout.splitlines()
    printed = dict(line.split(" ", 1) for line in lines)
    py_version = printed.pop("py_version")
    minor = int(py_version.split(".")[1])
    if minor != int(_DIR_NAME.search(include.name).group(1)):
        raise SystemExit(f"{include} holds the headers of CPython {py_version}")
    values: dict[str, object] = {"version": (3, minor), "source": "table"}
    for f in fields(Layout):
        if f.name in values:
            continue
        if f.name not in printed and "None" not in str(f.type):
            raise SystemExit(f"{TEMPLATE.name} prints no {f.name} for CPython {py_version}")
        values[f.name] = int(printed[f.name]) if f.name in printed else None
    return Generated(include, py_version, Layout(**values))


def by_version(includes: list[Path]) -> dict[tuple[int, int], list[Generated]]:
    """Each covered minor version's header sets, newest first; they must agree."""
    out: dict[tuple[int, int], list[Generated]] = {}
    with tempfile.TemporaryDirectory(prefix="gen-cpython-layouts-") as tmp:
        for include in includes:
            gen = generate(include, Path(tmp))
            if gen is None:
                print(f"skipped {include}: {TEMPLATE.name} has no branch for its version", file=sys.stderr)
            else:
                out.setdefault(gen.layout.version, []).append(gen)
    for version, gens in out.items():
        gens.sort(key=Generated.version_key, reverse=True)
        differ = [g for g in gens if g.layout != gens[0].layout]
        if differ:
            raise SystemExit(f"CPython {version[0]}.{version[1]}: {differ[0].include} and {gens[0].include} "
                             f"disagree; a layout per minor version cannot describe both")
    return out


def module_name(version: tuple[int, int]) -> str:
    return f"v{version[0]}_{version[1]}"


def _literal(value: object) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def render(gens: list[Generated]) -> str:
    """The module text for one minor version (gens: its header sets, the newest first)."""
    first, layout = gens[0], gens[0].layout
    same = "".join(f"\n# The same offsets: CPython {g.py_version} ({g.include})." for g in gens[1:])
    body = "".join(f"    {f.name}={_literal(getattr(layout, f.name))},\n" for f in fields(Layout))
    return (f"# Generated by scripts/gen_cpython_layouts.py from CPython {first.py_version}'s headers\n"
            f"# ({first.include}); do not edit.\n# Regenerate: {COMMAND}{same}\n"
            f'"""CPython {layout.version[0]}.{layout.version[1]}\'s Layout (x86-64, GIL build)."""\n'
            "from rankscope.agent.interpreters.cpython.layout import Layout\n\n"
            f"LAYOUT = Layout(\n{body})\n")


def main(argv: list[str]) -> None:
    includes = [Path(a) for a in argv] or header_dirs()
    for version, gens in sorted(by_version(includes).items()):
        path = OUT / f"{module_name(version)}.py"
        path.write_text(render(gens))
        print(f"wrote {path.relative_to(ROOT)} from CPython {', '.join(g.py_version for g in gens)}")


if __name__ == "__main__":
    main(sys.argv[1:])
