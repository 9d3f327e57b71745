"""Getting BPF into the kernel: compiling with bcc, the uprobe program composed from every probe kind, USDT
sites, and reading the kernel's log2 histograms back."""
