"""What the agent and the cluster analyzer serve: the latest snapshot over HTTP (JSON, msgpack, Prometheus),
behind one bearer-token check."""
