"""Simulated GPU training job: stand-in libcuda/libnccl and the rank processes that drive them."""
