"""Compiling with bcc gives the compiler's memory back: its clean library pages leave the resident set."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from rankscope.agent.loader.bcc import COMPILER_LIBRARIES, clean_mappings, compile_bpf

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = """
BPF_ARRAY(counts, u64, 1);
int on_call(void *ctx) { int k = 0; u64 *v = counts.lookup(&k); if (v) __sync_fetch_and_add(v, 1); return 0; }
"""


def _compiler_resident_kb() -> int:
    total, counting = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if re.match(r"[0-9a-f]+-[0-9a-f]+$", fields[0]):  # a mapping's header line
                counting = bool(COMPILER_LIBRARIES.search(fields[-1]))
            elif counting and fields[0] == "Rss:":
                total += int(fields[1])
    return total


def test_compiling_leaves_the_compilers_pages_out_of_the_resident_set():
    from bcc import BPF
    BPF(text=PROGRAM).cleanup()  # bcc's own compile: the compiler's code stays resident
    kept = _compiler_resident_kb()
    assert kept > 20_000
    bpf = compile_bpf(PROGRAM, [])
    try:
        # What is left is the relocated data the dynamic linker wrote (~10 of ~80 MB).
        assert _compiler_resident_kb() < kept / 3
        # The program still loads and a second compile faults the compiler back in as needed.
        assert bpf.load_func("on_call", BPF.KPROBE).fd >= 0
        compile_bpf(PROGRAM, []).cleanup()
    finally:
        bpf.cleanup()


def test_only_clean_read_only_mappings_are_dropped(tmp_path: Path):
    smaps = tmp_path / "smaps"
    smaps.write_text(
        "7f0000000000-7f0000100000 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libLLVM-14.so.1\n"
        "Rss: 900 kB\nAnonymous: 0 kB\n"
        "7f0000100000-7f0000200000 r--p 00100000 08:01 1 /usr/lib/x86_64-linux-gnu/libLLVM-14.so.1\n"
        "Rss: 300 kB\nAnonymous: 120 kB\n"  # relocated (RELRO): its pages are the linker's, not the file's
        "7f0000200000-7f0000300000 rw-p 00200000 08:01 1 /usr/lib/x86_64-linux-gnu/libLLVM-14.so.1\n"
        "Rss: 10 kB\nAnonymous: 0 kB\n"
        "7f0000300000-7f0000400000 r-xp 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "Rss: 500 kB\nAnonymous: 0 kB\n"
        "7f0000400000-7f0000500000 r-xp 00000000 08:01 3 /usr/lib/x86_64-linux-gnu/libclang-cpp.so.14\n"
        "Rss: 400 kB\nAnonymous: 0 kB\n")
    assert clean_mappings(COMPILER_LIBRARIES, str(smaps)) == [
        (0x7F0000000000, 0x7F0000100000), (0x7F0000400000, 0x7F0000500000)]


def test_the_agents_program_loads_on_a_machine_without_tracefs_mounted():
    """A bare machine (the H200 image of 2026-12-04) boots without tracefs: the agent mounts it rather than fail
    to compile every tracepoint. Here in a mount namespace of its own, tracefs unmounted first."""
    script = (
        "from pathlib import Path\n"
        "from rankscope.agent.host import tracefs\n"
        "assert not any((r / 'events').is_dir() for r in tracefs.ROOTS), 'tracefs still mounted'\n"
        "from rankscope.agent.loader.program import ProbeProgram\n"
        "program = ProbeProgram()\n"
        "program.bpf\n"
        "print(sorted(k.name for k in program.kinds), (tracefs.ROOTS[0] / 'events' / 'sched').is_dir())\n")
    unmount = " ; ".join(f"umount {r} 2>/dev/null" for r in ("/sys/kernel/debug/tracing", "/sys/kernel/tracing"))
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                             f'{unmount}; exec "$0" -c "$1"', sys.executable, script],
                            capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    kinds, mounted = result.stdout.strip().rsplit(" ", 1)
    assert mounted == "True" and "'sched'" in kinds and "'net'" in kinds, result.stdout
