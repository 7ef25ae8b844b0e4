"""The gRPC side of the agent (docs/service.md). Imports run one way:
``service`` (the daemon: ``AgentService``, ``Server``, the event streams) -> ``group`` (leading
a group request) -> ``member`` (a member's group jobs and their leases) and ``client``
(addresses, TLS, ``call``, ``renew``, ``health``); ``security`` (what a listener and a request
may do) -> ``client``; ``metrics`` (Prometheus) imports none of them."""
