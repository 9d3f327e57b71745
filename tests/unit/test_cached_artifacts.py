"""Downloaded and built files rankscope loads are used only when their bytes are the expected ones: NVIDIA's
wheels match the sha256 pinned for them (a cached one that does not is fetched again, a download that does not
is refused), members extracted from them match the wheel's RECORD, and built shims match the SHA256SUMS written
with them (a cache folder that does not is built again; a shipped shim folder that does not is refused)."""
from __future__ import annotations

import base64
import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from rankscope import native
from rankscope.agent.inject import shim
from rankscope.agent.inject.inject import InjectError
from rankscope.cupti_shim import wheels
from rankscope.cupti_shim.cuda_lines import BY_MAJOR, LINES

REQUIREMENT = "fake-headers==1.0"
WHEEL = "fake_headers-1.0-py3-none-any.whl"
HEADER = "fake/include/fake.h"


def _record_digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _make_wheel(path: Path, header: bytes) -> bytes:
    record = f"{HEADER},{_record_digest(header)},{len(header)}\nfake_headers-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(HEADER, header)
        z.writestr("fake_headers-1.0.dist-info/RECORD", record)
    return path.read_bytes()


@pytest.fixture
def kit(tmp_path, monkeypatch):
    """A genuine wheel pinned in a pins file, an empty cache, and a pip that 'downloads' `kit.served`."""
    genuine = _make_wheel(tmp_path / "genuine.whl", b"#define FAKE 1\n")
    pins = tmp_path / "wheels.sha256"
    pins.write_text(f"# a comment\n{hashlib.sha256(genuine).hexdigest()}  {WHEEL}\n")
    monkeypatch.setattr(wheels, "PINS", pins)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    class Kit:
        served = genuine
        downloads: list[list[str]] = []

    def pip(cmd, **_kwargs):
        Kit.downloads.append(cmd)
        (Path(cmd[cmd.index("-d") + 1]) / WHEEL).write_bytes(Kit.served)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(wheels.subprocess, "run", pip)
    Kit.genuine = genuine
    return Kit


def test_a_missing_wheel_is_downloaded_and_checked(kit):
    path = wheels.wheel(REQUIREMENT)
    assert path.read_bytes() == kit.genuine
    assert len(kit.downloads) == 1
    assert wheels.wheel(REQUIREMENT) == path and len(kit.downloads) == 1  # cached, matching: no download


def test_a_cached_wheel_with_other_bytes_is_fetched_again(kit):
    wheels.wheel_dir().mkdir(parents=True)
    planted = _make_wheel(wheels.wheel_dir() / WHEEL, b"#define FAKE 666\n")
    assert planted != kit.genuine
    path = wheels.wheel(REQUIREMENT)
    assert path.read_bytes() == kit.genuine
    assert len(kit.downloads) == 1


def test_a_download_with_other_bytes_is_refused(kit, tmp_path):
    kit.served = _make_wheel(tmp_path / "other.whl", b"#define FAKE 2\n")
    with pytest.raises(wheels.WheelError, match="does not match its pinned sha256"):
        wheels.wheel(REQUIREMENT)
    assert not (wheels.wheel_dir() / WHEEL).exists()
    assert [p.name for p in wheels.wheel_dir().iterdir()] == []  # nothing of the download left behind


def test_a_requirement_without_a_pin_is_refused(kit):
    with pytest.raises(wheels.WheelError, match="pinned"):
        wheels.wheel("fake-headers==2.0")
    assert kit.downloads == []


def test_a_changed_extracted_member_is_extracted_again(kit):
    folder = wheels.extract(REQUIREMENT, ("fake/include/",))
    header = folder / HEADER
    assert header.read_bytes() == b"#define FAKE 1\n"
    header.write_bytes(b"#define FAKE 3\n")
    assert wheels.extract(REQUIREMENT, ("fake/include/",)) == folder
    assert header.read_bytes() == b"#define FAKE 1\n"


def test_every_wheel_the_cuda_lines_name_is_pinned_once():
    for line in LINES:
        for requirement in (line.cupti, line.runtime, line.host_defines, line.nccl, *line.checked_cupti):
            name, digest = wheels.pinned(requirement)
            assert name.startswith(requirement.split("==")[0].replace("-", "_") + "-") and len(digest) == 64


# -- built libraries ------------------------------------------------------------------------------------------

@pytest.fixture
def builds(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    made: list[Path] = []

    def build(folder: Path) -> None:
        made.append(folder)
        (folder / "libthing.so").write_bytes(b"\x7fELF built")

    return build, made


def test_a_built_library_is_reused_while_it_matches_its_sums(builds):
    build, made = builds
    folder = native.cached_build("thing-1", ("libthing.so",), build)
    assert native.cached_build("thing-1", ("libthing.so",), build) == folder
    assert len(made) == 1
    digest = hashlib.sha256(b"\x7fELF built").hexdigest()
    assert (folder / native.SUMS).read_text() == f"{digest}  libthing.so\n"


@pytest.mark.parametrize("damage", ["changed", "unlisted"])
def test_a_cached_library_that_does_not_match_is_built_again(builds, damage):
    build, made = builds
    folder = native.cached_build("thing-1", ("libthing.so",), build)
    if damage == "changed":
        (folder / "libthing.so").write_bytes(b"\x7fELF planted")
    else:
        (folder / native.SUMS).unlink()
    assert native.cached_build("thing-1", ("libthing.so",), build) == folder
    assert len(made) == 2
    assert (folder / "libthing.so").read_bytes() == b"\x7fELF built"


def _shim_dir(tmp_path: Path, monkeypatch) -> Path:
    folder = tmp_path / "lib"
    folder.mkdir()
    (folder / BY_MAJOR[13].shim_name).write_bytes(b"\x7fELF shim")
    native.write_sums(folder, [BY_MAJOR[13].shim_name])
    monkeypatch.setenv(shim.SHIM_DIR_ENV, str(folder))
    return folder


def test_a_shipped_shim_is_loaded_when_it_matches_its_sums(tmp_path, monkeypatch):
    folder = _shim_dir(tmp_path, monkeypatch)
    assert shim.shim_library(13) == str(folder / BY_MAJOR[13].shim_name)


def test_a_shipped_shim_that_does_not_match_is_refused(tmp_path, monkeypatch):
    folder = _shim_dir(tmp_path, monkeypatch)
    (folder / BY_MAJOR[13].shim_name).write_bytes(b"\x7fELF planted")
    with pytest.raises(InjectError, match="does not match"):
        shim.shim_library(13)
    (folder / native.SUMS).unlink()
    with pytest.raises(InjectError, match="SHA256SUMS"):
        shim.shim_library(13)
