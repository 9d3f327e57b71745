"""What rankscope needs on a GPU machine that cannot fetch packages, carried in at most 64 MiB: packed here
from this machine's Debian bcc, unpacked there into a prefix of its own.

    python scripts/gpu_kit/bundle.py [DIR]          packs DIR (default .gpukit/, gitignored) and checks it
    python scripts/gpu_kit/bundle.py --shims [DIR]  rebuilds only DIR/shims (after a change to the shim)

DIR holds
- bcc.tar.xz: lib/ (libbcc and the shared libraries it needs, found with ldd, but glibc and GCC's runtime:
  the GPU machine's are newer, and older copies on its library path would shadow them), python/bcc (Debian's
  python3-bpfcc, pure Python) and headers/ (the kernel headers bcc's compiles open, found by tracing a compile
  of every header rankscope's BPF programs include; bcc reads them from BCC_KERNEL_SOURCE, so the machine needs
  no headers of its kernel);
- the pyelftools wheel (pure Python: imported from the .whl itself; every other dependency of rankscope is in
  the GPU machine's image);
- shims/: the CUPTI shims of both CUDA lines, built here (gcc against the wheels' headers);
- manifest.json: each file's size and Debian package, what is left out and why.
Only the agent's processes get the prefix on their library path: the training jobs keep the machine's own.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = ROOT / ".gpukit"
ARCHIVE = "bcc.tar.xz"
PYELFTOOLS = "pyelftools==0.33"
LIBBCC = "libbcc.so.0"
BCC_PYTHON = Path("/usr/lib/python3/dist-packages/bcc")
# The machine's own: glibc and GCC's C++ runtime (newer there than Debian 12's, and backward compatible).
SYSTEM_LIBRARIES = re.compile(r"^(linux-vdso|ld-linux[-\w]*|libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s)\.so")
# Every kernel header rankscope's BPF programs include (bpf/*.c); bcc adds its own prelude to each compile.
PROBE_INCLUDES = ("uapi/linux/ptrace.h", "uapi/linux/bpf_perf_event.h")
CHECK_PROGRAM = "".join(f"#include <{h}>\n" for h in PROBE_INCLUDES) + "int probe(struct pt_regs *ctx) { return 0; }\n"
HEADER_TREES = ("/usr/src", "/lib/modules")
# Loaded, never used: libLLVM's Z3 solver (the static analyzer's, which bcc's compiles never run) and ICU's data
# (libxml2's encodings, through libicuuc). Carried as stand-ins that define only what the other libraries take
# from them (a function that aborts, a blob of zeros that ICU refuses as data): 16 KB each for 54 MB (13 MB
# packed), so that the tracked tree, which grows by each session's corpus, still fits beside the bundle.
STAND_INS = ("libz3.so.4", "libicudata.so.72")
# x86 branch filter before LZMA2, one block with a dictionary above libLLVM's 110 MB: 46.8 MB where plain -9e
# made 49.6, and the tracked tree (18 MB, 2026-12-04) and the bundle travel together under the device's 64 MiB.
# Costs 2.5 min of one core to pack, ~200 MiB of memory to unpack.
XZ = ["xz", "--x86", "--lzma2=preset=9e,dict=192MiB", "-T1"]


class BundleError(RuntimeError):
    """The bundle cannot be packed or used here (the message says what is missing)."""


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)


def library_closure(library: str = LIBBCC) -> tuple[dict[str, Path], list[str]]:
    """soname -> file of every library `library` loads, but the machine's own; and the names left out."""
    found = re.search(rf"^\s*{re.escape(library)} \(.*\) => (\S+)$", _run(["/sbin/ldconfig", "-p"]).stdout, re.M)
    if not found:
        raise BundleError(f"{library} is not installed here: run scripts/install (Debian's libbpfcc)")
    path = Path(found.group(1))
    out = {library: path.resolve()}
    skipped = []
    for line in _run(["ldd", str(path)]).stdout.splitlines():
        m = re.match(r"\s*(\S+)(?: => (\S+))?", line)
        if not m:
            continue
        name, found = m.groups()
        name = Path(name).name
        if SYSTEM_LIBRARIES.match(name):
            skipped.append(Path(name).name)
        elif found and found != "not":
            out[name] = Path(found).resolve()
        else:
            raise BundleError(f"{library} needs {name}, which this machine lacks")
    return out, skipped


def imported_symbols(users: list[Path]) -> set[str]:
    """Every symbol the shared libraries `users` take from others (their undefined dynamic symbols)."""
    out: set[str] = set()
    for user in users:
        listing = _run(["nm", "-D", "--undefined-only", str(user)]).stdout
        out |= {line.split()[-1].split("@")[0] for line in listing.splitlines() if line.strip()}
    return out


def stand_in(soname: str, real: Path, imported: set[str], out: Path) -> Path:
    """Builds out/`soname` defining the symbols of `real` (that library's file) among `imported` (what the
    other libraries take: imported_symbols): functions that abort if ever called, data as 64 zero bytes. Every
    import must resolve when the libraries load (ctypes opens libbcc with RTLD_NOW; libicuuc binds now)."""
    code = ["#include <stdlib.h>"]
    for line in _run(["nm", "-D", "--defined-only", str(real)]).stdout.splitlines():
        parts = line.split()
        if len(parts) != 3:
            continue
        kind, name = parts[1], parts[2].split("@")[0]
        if name in imported:
            code.append(f"void {name}(void) {{ abort(); }}" if kind in "TtWi" else f"const char {name}[64] = {{0}};")
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "stand_in.c"
        source.write_text("\n".join(code) + "\n")
        built = _run(["gcc", "-shared", "-fPIC", "-O1", f"-Wl,-soname,{soname}", "-o", str(out / soname),
                      str(source)])
    if built.returncode != 0:
        raise BundleError(f"cannot build a stand-in for {soname}: {built.stderr.strip()[-300:]}")
    return out / soname


def kernel_build_dirs() -> list[Path]:
    release = os.uname().release
    return [Path(f"/lib/modules/{release}/{d}").resolve() for d in ("build", "source")
            if Path(f"/lib/modules/{release}/{d}").exists()]


def traced_headers() -> dict[str, Path]:
    """Relative path -> file of every kernel header one bcc compile of the probes' includes opens (strace)."""
    dirs = kernel_build_dirs()
    if not dirs:
        raise BundleError("no kernel headers here (/lib/modules/$(uname -r)/build): run scripts/install")
    if shutil.which("strace") is None:
        raise BundleError("strace is needed to find the headers bcc reads (apt-get install strace)")
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "opens"
        code = f"from bcc import BPF; BPF(text={CHECK_PROGRAM!r})"
        result = _run(["strace", "-f", "-qq", "-e", "trace=openat", "-o", str(log), sys.executable, "-c", code])
        if result.returncode != 0:
            raise BundleError(f"bcc cannot compile here: {result.stderr.strip()[-300:]}")
        text = log.read_text(errors="replace")
    cwd = dirs[-1]  # bcc runs clang in the source tree: its relative opens are under it
    out: dict[str, Path] = {}
    for m in re.finditer(r'openat\(\w+, "([^"]+\.h)", [^)]*\) = \d+', text):
        path = Path(m.group(1))
        real = (path if path.is_absolute() else cwd / path).resolve()
        for base in dirs:
            if real.is_relative_to(base):
                out[str(real.relative_to(base))] = real
    return out


def copy_headers(headers: dict[str, Path], tree: Path) -> None:
    """One tree of the headers (a kernel's build and source folders merged), for BCC_KERNEL_SOURCE."""
    for rel, path in headers.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, tree / rel)


def package_of(path: Path) -> str:
    found = _run(["dpkg", "-S", str(path)]).stdout.split(":", 1)[0]
    if not found:  # dpkg knows a library by its /usr/lib or /lib path, whichever the package installed
        alt = Path(str(path).replace("/usr/lib/", "/lib/", 1)) if str(path).startswith("/usr/lib/") else \
            Path("/usr" + str(path))
        found = _run(["dpkg", "-S", str(alt)]).stdout.split(":", 1)[0]
    if not found:
        return "?"
    version = _run(["dpkg-query", "-W", "-f", "${Version}", found]).stdout
    return f"{found}={version}"


def pack(out: Path = DEFAULT_DIR) -> dict:
    """Packs `out` (replacing it) and checks the archive by compiling with it alone; returns the manifest."""
    libraries, skipped = library_closure()
    headers = traced_headers()
    if not BCC_PYTHON.is_dir():
        raise BundleError(f"{BCC_PYTHON} is missing: install python3-bpfcc")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp) / "stage"
        (stage / "lib").mkdir(parents=True)
        imported = imported_symbols([path for name, path in libraries.items() if name not in STAND_INS])
        for name, path in libraries.items():
            if name in STAND_INS:
                stand_in(name, path, imported, stage / "lib")
            else:
                shutil.copy2(path, stage / "lib" / name)
        shutil.copytree(BCC_PYTHON, stage / "python" / "bcc", ignore=shutil.ignore_patterns("__pycache__"))
        copy_headers(headers, stage / "headers")
        tar = subprocess.Popen(["tar", "-C", str(stage), "-cf", "-", "lib", "python", "headers"],
                               stdout=subprocess.PIPE)
        with open(out / ARCHIVE, "wb") as f:
            xz = subprocess.run(XZ, stdin=tar.stdout, stdout=f)
        if tar.wait() != 0 or xz.returncode != 0:
            raise BundleError("tar | xz failed")
    from rankscope.cupti_shim import wheels

    try:  # checked against its sha256 in rankscope/cupti_shim/wheels.sha256, as NVIDIA's wheels are
        shutil.copy2(wheels.wheel(PYELFTOOLS), out)
    except wheels.WheelError as e:
        raise BundleError(str(e)) from e
    copy_shims(out)
    manifest = {
        "libraries": {name: {"bytes": p.stat().st_size, "package": package_of(p)} for name, p in libraries.items()},
        "left_out": sorted(set(skipped)),
        "stand_ins": [name for name in STAND_INS if name in libraries],
        "headers": len(headers),
        "headers_bytes": sum(p.stat().st_size for p in headers.values()),
        "kernel_headers_of": [str(d) for d in kernel_build_dirs()],
        "bcc_python": package_of(BCC_PYTHON / "__init__.py"),
        "files": {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    with tempfile.TemporaryDirectory() as tmp:
        check(unpack(out, Path(tmp)))
    return manifest


def copy_shims(out: Path) -> list[Path]:
    """The shims of both CUDA lines, built from this checkout's sources, into out/shims (alone: after a change
    to the shim, the rest of the bundle stays as it is)."""
    from rankscope.cupti_shim.build import install_shims

    return install_shims(out / "shims")


def unpack(bundle: Path, prefix: Path) -> Path:
    """Extracts the archive of `bundle` into `prefix` (once: a finished unpack leaves a stamp); returns it."""
    stamp = prefix / ".unpacked"
    if stamp.exists():
        return prefix
    archive = bundle / ARCHIVE
    if not archive.exists():
        raise BundleError(f"{archive} is missing: run python scripts/gpu_kit/bundle.py here and carry .gpukit")
    prefix.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:xz") as t:
        t.extractall(prefix, filter="tar")
    stamp.touch()
    return prefix


def agent_env(prefix: Path | None, bundle: Path = DEFAULT_DIR, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a rankscope process: the repository and pyelftools on its path and, with an
    unpacked `prefix`, bcc from it (libraries, Python package, kernel headers)."""
    env = dict(os.environ if base is None else base)
    paths = [str(ROOT), *map(str, sorted(bundle.glob("pyelftools-*.whl")))]
    if prefix is not None:
        paths.append(str(prefix / "python"))
        env["LD_LIBRARY_PATH"] = ":".join(filter(None, [str(prefix / "lib"), env.get("LD_LIBRARY_PATH")]))
        env["BCC_KERNEL_SOURCE"] = str(prefix / "headers")
        env["PYTHONWARNINGS"] = "ignore::SyntaxWarning"  # Debian 12's bcc has regexes Python 3.12 warns about
    env["PYTHONPATH"] = ":".join(filter(None, [*paths, env.get("PYTHONPATH")]))
    return env


def check(prefix: Path | None, python: str = sys.executable) -> str:
    """Compiles and loads a program with the probes' includes through bcc (from `prefix`, or the machine's);
    returns bcc's version, raises BundleError with bcc's own words."""
    code = f"import bcc; bcc.BPF(text={CHECK_PROGRAM!r}); print(bcc.__version__, bcc.__file__)"
    result = _run([python, "-c", code], env=agent_env(prefix))
    if result.returncode != 0:
        raise BundleError(f"bcc does not work{' from ' + str(prefix) if prefix else ''}: "
                          f"{result.stderr.strip()[-600:]}")
    return result.stdout.strip()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--shims"]
    target = Path(args[0]) if args else DEFAULT_DIR
    if "--shims" in sys.argv:
        print("\n".join(map(str, copy_shims(target))))
    else:
        print(json.dumps(pack(target)["files"], indent=1))
