"""rankscope node agent: discovery, probes, collection and serving."""
