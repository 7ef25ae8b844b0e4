"""The gRPC side: the daemon's service, group (multi-node) requests, metrics."""
