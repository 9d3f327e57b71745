"""What rankscope installs is fixed: every runtime dependency at one release in constraints.txt, which the
install script (and so the image) uses, and aiohttp, which serves the HTTP API, past the releases with known
request-smuggling bugs both in the lock and in the lower bound pyproject.toml gives other installers."""
from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
# aiohttp's last request-smuggling fix (the WebSocket-upgrade one) and the C parser's out-of-bounds read after it.
AIOHTTP_FIXED = Version("3.14.3")


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


def _runtime_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"]]


def test_every_runtime_dependency_is_pinned_within_its_bounds():
    pins = _pins()
    for req in _runtime_requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not pinned in constraints.txt"
        assert pins[name] in req.specifier, f"{req.name}=={pins[name]} is outside pyproject's {req.specifier}"


def test_aiohttp_is_pinned_past_the_smuggling_fixes():
    assert _pins()["aiohttp"] >= AIOHTTP_FIXED
    (aiohttp,) = [r for r in _runtime_requirements() if canonicalize_name(r.name) == "aiohttp"]
    assert not aiohttp.specifier.contains(Version("3.14.2"))  # no installer may pick a vulnerable release
    assert aiohttp.specifier.contains(AIOHTTP_FIXED)


def test_aiohttps_own_dependencies_are_pinned_too():
    pins = _pins()
    deps = importlib.metadata.requires("aiohttp") or []
    for dep in (Requirement(d) for d in deps):
        if dep.marker is None or dep.marker.evaluate({"extra": ""}):
            assert canonicalize_name(dep.name) in pins, f"aiohttp's {dep.name} is not pinned"


def test_the_install_script_installs_with_the_constraints():
    install = (ROOT / "scripts/install").read_text()
    assert re.search(r"pip\" install .*-c constraints\.txt .*-e '\.\[test\]'", install)
    assert "constraints.txt -nt" in install  # a changed pin reinstalls


def test_the_installed_aiohttp_is_the_pinned_one():
    assert Version(importlib.metadata.version("aiohttp")) == _pins()["aiohttp"]
