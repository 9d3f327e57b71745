"""The CUPTI releases each shim accepts (cuda_lines.py's `cupti_api`): every field the shim reads sits where the
pinned headers put it, in the record type each release writes (the highest-numbered one its cupti_activity.h
defines), and the launch callback ids it matches are the same numbers. Compiled against each release's
headers with gcc; the wheels (~10 MB each) are cached like the pinned ones."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from rankscope.cupti_shim.cuda_lines import LINES, CudaLine

# Fields of each record kind the shim reads (shim.c emit, emit_launch), by record family.
FIELDS = {
    "Kernel": ("kind", "start", "end", "deviceId", "streamId", "correlationId", "name"),
    "Memcpy": ("kind", "start", "end", "deviceId", "streamId", "correlationId", "bytes"),
    "Memset": ("kind", "start", "end", "deviceId", "streamId", "correlationId", "bytes"),
}
API_FIELDS = ("kind", "cbid", "start", "end", "threadId", "correlationId")
LAUNCH_CBIDS = (
    *(f"CUPTI_RUNTIME_TRACE_CBID_{api}" for api in (
        "cudaLaunchKernel_v7000", "cudaLaunchKernel_ptsz_v7000", "cudaLaunchKernelExC_v11060",
        "cudaLaunchKernelExC_ptsz_v11060", "cudaGraphLaunch_v10000", "cudaGraphLaunch_ptsz_v10000")),
    *(f"CUPTI_DRIVER_TRACE_CBID_{api}" for api in (
        "cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz", "cuGraphLaunch",
        "cuGraphLaunch_ptsz")),
)


def _current_records(include: Path) -> dict[str, str]:
    """Record family -> the newest record type the release defines (the one its CUPTI writes)."""
    text = (include / "cupti_activity.h").read_text()
    newest = {}
    for family in FIELDS:
        versions = [int(v) for v in re.findall(rf"^}} CUpti_Activity{family}(\d+);", text, re.M)]
        newest[family] = f"CUpti_Activity{family}{max(versions)}"
    return newest


def _layout(line: CudaLine, include: Path, tmp_path: Path) -> tuple[int, dict[str, object]]:
    """(CUPTI_API_VERSION, what the shim depends on: each read field's offset and size, the launch cbids)."""
    records = {**_current_records(include), "API": "CUpti_ActivityAPI"}
    fields = {**FIELDS, "API": API_FIELDS}
    lines = [f'printf("{family}.{f} %zu %zu\\n", offsetof({t}, {f}), sizeof((({t} *)0)->{f}));'
             for family, t in records.items() for f in fields[family]]
    lines += [f'printf("{cbid} %d\\n", (int){cbid});' for cbid in LAUNCH_CBIDS]
    source = tmp_path / "layout.c"
    headers = ("stddef.h", "stdio.h", "cuda.h", "cupti_version.h", "cupti_activity.h", "cupti_runtime_cbid.h",
               "cupti_driver_cbid.h")
    source.write_text("".join(f"#include <{h}>\n" for h in headers) + "int main(void) {\n"
                      'printf("api %d\\n", (int)CUPTI_API_VERSION);\n' + "\n".join(lines) + "\nreturn 0;\n}\n")
    binary = tmp_path / "layout"
    # The release's CUPTI headers first; cuda.h and host_defines.h from the line's pins.
    subprocess.run(["gcc", "-w", "-o", str(binary), str(source), f"-I{include}",
                    *(f"-I{d}" for d in line.include_dirs()[1:])], check=True)
    out = dict(row.split(" ", 1) for row in subprocess.run([str(binary)], capture_output=True, text=True,
                                                            check=True).stdout.splitlines())
    return int(out.pop("api")), out


@pytest.mark.parametrize("line", LINES, ids=lambda line: f"cuda{line.major}")
def test_accepted_cupti_releases_lay_out_the_read_fields_as_the_pinned_headers(line, tmp_path):
    api, pinned = _layout(line, line.cupti_include(), tmp_path)
    versions = [api]
    for release in line.checked_cupti:
        api, layout = _layout(line, line.cupti_include(release), tmp_path)
        assert layout == pinned, release
        versions.append(api)
    # The shim accepts exactly the range of the releases compared here.
    assert line.cupti_api == (min(versions), max(versions))
