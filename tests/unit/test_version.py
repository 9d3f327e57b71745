"""`rankscope --version`: the installed package's version, the one pyproject.toml declares."""
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import rankscope

DECLARED = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["version"]


def test_version_prints_the_declared_version():
    out = subprocess.run([sys.executable, "-m", "rankscope.agent.cli", "--version"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"rankscope {DECLARED}\n"


def test_a_source_tree_without_metadata_reports_the_constant(monkeypatch):
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    rankscope.version.cache_clear()
    try:
        assert rankscope.version() == rankscope.__version__ == DECLARED
    finally:
        rankscope.version.cache_clear()
