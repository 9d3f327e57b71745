"""Sources of data about a watched rank, each turning what the kernel (or NVML) counted into its part of the
rank's pattern, each a Source (source.py): the one BPF program (program.py: uprobes on the job's libraries,
declared in probes/, the scheduler, TCP), the Python sampler and timer, the CUPTI shim and NCCL profiler
plugin (gpu.py) with NVML (nvml.py), and /proc's host facts (host.py)."""
