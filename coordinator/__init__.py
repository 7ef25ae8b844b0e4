"""Coordinator: the Python side of the shim control protocol (protocol, client), the phase
runner (phases on barrier, rollback, results, topology) and the workload contract's files
(contract). See docs/coordinator.md and docs/protocol.md."""
