"""The CUPTI shim: a C library CUDA loads from CUDA_INJECTION64_PATH that hands GPU activity to the agent."""
