"""What names and seals a compiled BPF program kept on the node (loader/bpf_cache.py): the key changes with the
kernel headers and the compiler libraries actually used, and the secret that seals entries is the configured
file's, else the node's own, readable by this user alone."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from rankscope.agent.loader import bpf_cache

PROGRAM = "int f(void *ctx) { return 0; }"


def _headers(root: Path, autoconf: str) -> Path:
    tree = root / "build"
    (tree / "include/generated").mkdir(parents=True)
    (tree / "include/generated/autoconf.h").write_text(autoconf)
    return tree


@pytest.fixture(autouse=True)
def _fresh_memo():
    bpf_cache.headers_id.cache_clear()
    bpf_cache.compiler_id.cache_clear()
    yield
    bpf_cache.headers_id.cache_clear()
    bpf_cache.compiler_id.cache_clear()


def test_other_kernel_headers_give_another_key(tmp_path, monkeypatch):
    a = _headers(tmp_path / "a", "#define CONFIG_X 1\n")
    monkeypatch.setenv("BCC_KERNEL_SOURCE", str(a))
    first = bpf_cache.key(PROGRAM, [])
    assert bpf_cache.key(PROGRAM, []) == first
    monkeypatch.setenv("BCC_KERNEL_SOURCE", str(_headers(tmp_path / "b", "#define CONFIG_X 1\n")))
    assert bpf_cache.key(PROGRAM, []) != first  # other trees
    monkeypatch.setenv("BCC_KERNEL_SOURCE", str(a))
    (a / "include/generated/autoconf.h").write_text("#define CONFIG_X 2\n")
    bpf_cache.headers_id.cache_clear()  # a new process
    assert bpf_cache.key(PROGRAM, []) != first  # the same tree, configured otherwise


def test_the_default_headers_are_the_running_kernels_build_tree(monkeypatch):
    monkeypatch.delenv("BCC_KERNEL_SOURCE", raising=False)
    build, source = bpf_cache.kernel_headers()
    release = os.uname().release
    assert build == os.path.realpath(f"/lib/modules/{release}/build")
    assert source == os.path.realpath(f"/lib/modules/{release}/source")


def _readelf_build_id(path: str) -> str:
    out = subprocess.run(["readelf", "-n", path], capture_output=True, text=True, check=True).stdout
    return next(line.split(":")[1].strip() for line in out.splitlines() if "Build ID" in line)


def _maps_naming(tmp_path: Path, library: Path) -> Path:
    maps = tmp_path / f"maps-{library.parent.name}"
    maps.write_text(f"7f0000000000-7f0000001000 r-xp 00000000 08:01 1234    {library}\n")
    return maps


def test_another_llvm_build_gives_another_key(tmp_path, monkeypatch):
    libraries = []
    for name, elf in (("a", "/bin/true"), ("b", "/bin/false")):  # two files with different build ids
        (tmp_path / name).mkdir()
        libraries.append(Path(shutil.copy(elf, tmp_path / name / "libLLVM-14.so.1")))
    keys = []
    for library in libraries:
        monkeypatch.setattr(bpf_cache, "MAPS", str(_maps_naming(tmp_path, library)))
        keys.append(bpf_cache.key(PROGRAM, []))
        assert _readelf_build_id(str(library)) in bpf_cache.compiler_id(bpf_cache.MAPS)
    assert keys[0] != keys[1]


def test_this_process_names_the_libbcc_and_llvm_it_maps():
    ids = bpf_cache.compiler_id("/proc/self/maps")
    assert "libbcc" in ids
    libbcc = next(line.split()[-1] for line in open("/proc/self/maps") if "/libbcc.so" in line)
    assert _readelf_build_id(libbcc) in ids


def test_without_a_configured_key_the_node_makes_its_own_for_this_user_alone(tmp_path, monkeypatch):
    monkeypatch.delenv(bpf_cache.KEY_ENV, raising=False)
    first = bpf_cache.secret(tmp_path)
    assert first is not None and len(first) >= bpf_cache.MIN_SECRET
    mode = (tmp_path / bpf_cache.NODE_KEY).stat().st_mode
    assert stat.S_IMODE(mode) == 0o600
    assert bpf_cache.secret(tmp_path) == first  # made once, kept


def test_a_node_key_others_may_read_seals_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(bpf_cache.KEY_ENV, raising=False)
    assert bpf_cache.secret(tmp_path) is not None
    os.chmod(tmp_path / bpf_cache.NODE_KEY, 0o644)
    assert bpf_cache.secret(tmp_path) is None


def test_the_configured_key_file_seals_entries(tmp_path, monkeypatch):
    configured = tmp_path / "bpf-cache-key"
    configured.write_text("s" * 40 + "\n")
    monkeypatch.setenv(bpf_cache.KEY_ENV, str(configured))
    assert bpf_cache.secret(tmp_path / "cache") == b"s" * 40
    configured.unlink()  # named, absent (a Secret without the key): the node's own
    assert bpf_cache.secret(tmp_path) == (tmp_path / bpf_cache.NODE_KEY).read_bytes()


def test_a_seal_holds_only_for_its_key_secret_and_bytes():
    sealed = bpf_cache.seal(b"k" * 32, "name", b'{"format": 2}')
    assert bpf_cache.unseal(b"k" * 32, "name", sealed) == '{"format": 2}'
    for mac_key, name, data in ((b"j" * 32, "name", sealed), (b"k" * 32, "other", sealed),
                                (b"k" * 32, "name", sealed.replace(b"2", b"3")),
                                (b"k" * 32, "name", b'{"format": 2}')):
        with pytest.raises(bpf_cache.CacheError):
            bpf_cache.unseal(mac_key, name, data)
