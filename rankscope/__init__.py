"""rankscope: which rank, function and component slows a training job, found with eBPF while it runs."""
