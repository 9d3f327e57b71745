"""Finding rules, one module per family; each looks at one job's rank table (or its patterns) and returns
zero or more findings, and none when it cannot tell a peer from an outlier. diagnosis.py calls them in order.

- stragglers.py: a rank the others wait for, and why (compute_straggler, input_straggler, python_gc,
  cpu_contention)
- links.py: slow links and slow nodes' NICs (the link matrix, and collective finish times)
- hangs.py: no progress (noncomm_hang, comm_hang)
- gpu.py: what the GPU itself says (gpu_throttle from NVML, launch_bound from CUPTI)
- nodes.py: what only a view over nodes says (node_fault, node_unreachable)
- regression.py: the job against its own baseline (regression)
"""
