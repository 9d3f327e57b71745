"""Sources of data about a watched rank, each turning what the kernel (or NVML) counted into its part of the
rank's pattern: uprobes on the job's libraries (probes/, read by collector.py), the scheduler, the Python
sampler and timer, the CUPTI shim and NCCL profiler plugin (gpu.py) and NVML (nvml.py)."""
