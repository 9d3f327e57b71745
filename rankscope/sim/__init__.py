"""Simulated GPU job: stand-in libcuda/libnccl and the rank processes that drive them.

- libcuda.c, libnccl.c, rsim.h: the stand-in libraries (real CUDA/NCCL names and signatures, GPU-like timing)
- build.py: `build_libraries()` compiles them into a cache folder
- bindings.py: their ctypes bindings (used by the ranks; loading them maps the libraries)
- faults.py: `parse_fault` / `Fault` (`KIND:RANK[:ARG][@SECONDS]`)
- rank.py: one rank, `python -m rankscope.sim.rank` (a real Python training loop)
- job.py: `start_job()` / `SimJob`, and the `rankscope sim` command line
"""
