"""Coordinator: the Python side of the shim control protocol (protocol, client) and the phase
runner (phases, topology). See docs/coordinator.md and docs/protocol.md."""
