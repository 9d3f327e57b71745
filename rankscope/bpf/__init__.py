"""BPF C sources; loaded by rankscope.agent.bpf_program."""
