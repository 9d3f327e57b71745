"""What the agent reads from the host, once per concept: /proc (processes, their maps, cgroups, threads), ELF
symbol tables and the kernel's BTF. No BPF here."""
