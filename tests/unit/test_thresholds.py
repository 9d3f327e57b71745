"""The analyzer's thresholds live in one table (rankscope/analyzer/thresholds.py): every numeric module-level
constant of the analyzer is declared there, the modules use the table's values under the table's names, and
docs/analysis.md shows the table as it is."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import numbers
import sys
from pathlib import Path
from types import ModuleType

from rankscope.analyzer import thresholds
from rankscope.analyzer.thresholds import FAMILIES, THRESHOLDS

ROOT = Path(__file__).resolve().parents[2]
ANALYZER = ROOT / "rankscope" / "analyzer"
# Facts, not choices: a deviation of a normal distribution -> its sigma; a sentinel group id.
PHYSICAL = {"MAD_TO_SIGMA", "MEAN_AD_TO_SIGMA", "SUCCESSIVE_TO_SIGMA", "WITHIN"}


def _modules() -> list[tuple[str, ast.Module]]:
    """(module name, its syntax tree) of every analyzer module but the table's."""
    out = []
    for path in sorted(ANALYZER.rglob("*.py")):
        if path.name == "thresholds.py":
            continue
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out.append((name, ast.parse(path.read_text())))
    return out


def _assigned(tree: ast.Module) -> list[str]:
    """The names a module binds at its top level by assignment."""
    names = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        names += [t.id for t in targets if isinstance(t, ast.Name)]
    return names


def _imported(tree: ast.Module) -> list[tuple[str | None, str]]:
    """(module, name) of every `from module import name` in the module, wherever it stands."""
    return [(node.module, a.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for a in node.names]


def test_no_analyzer_module_defines_a_numeric_constant_of_its_own() -> None:
    stray = []
    for name, tree in _modules():
        module = importlib.import_module(name)
        for attr in _assigned(tree):
            value = getattr(module, attr, None)
            if isinstance(value, numbers.Real) and not isinstance(value, bool) and attr not in PHYSICAL:
                stray.append(f"{name}.{attr} = {value!r}")
    assert not stray, f"declare these in rankscope/analyzer/thresholds.py: {stray}"


def test_modules_read_each_threshold_from_the_table() -> None:
    used = set()
    for name, tree in _modules():
        module = importlib.import_module(name)
        for source, attr in _imported(tree):
            if attr in THRESHOLDS:
                assert source == "rankscope.analyzer.thresholds", f"{name} imports {attr} from {source}"
                assert getattr(module, attr) == THRESHOLDS[attr].value, f"{name}.{attr}"
                used.add(attr)
    assert set(THRESHOLDS) - used == set(), "thresholds no analyzer module uses"


def test_each_declaration_binds_its_own_name() -> None:
    for name, t in THRESHOLDS.items():
        assert t.name == name and getattr(thresholds, name) == t.value
        assert isinstance(t.value, numbers.Real) and not isinstance(t.value, bool), name
        assert t.family in FAMILIES and t.unit and t.meaning, name
    numeric = {k for k, v in vars(thresholds).items() if k.isupper() and isinstance(v, numbers.Real)}
    assert numeric == set(THRESHOLDS)


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_thresholds_doc", ROOT / "scripts" / "gen_thresholds_doc.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_documented_table_is_the_table() -> None:
    gen = _generator()
    doc = gen.DOC.read_text()
    assert gen.with_table(doc) == doc, "docs/analysis.md is out of date: run scripts/gen_thresholds_doc.py"
    for t in THRESHOLDS.values():
        assert f"`{t.name}`" in gen.table(), t.name
