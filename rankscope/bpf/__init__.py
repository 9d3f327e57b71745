"""BPF C sources; loaded by rankscope.agent.loader.program."""
