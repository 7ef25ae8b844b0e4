"""afdwin: the reference symmetric-window workload (docs/afdwin.md).

A stand-in for an attention/FFN-disaggregated deployment's NVSHMEM symmetric window built on
plain CUDA driver VMM. Modules: ``layout`` (window layout, header codec, geometry check),
``config`` (profiles), ``payload`` (messages, trailer, checksum), ``evidence`` (per-pair
delivery evidence, rates), ``wire`` (launcher<->rank framing with SCM_RIGHTS), ``cudrv``
(checked driver wrappers), ``rank`` (rank process entry) with ``rank_base``, ``window``,
``control``, ``attention`` and ``ffn`` (its state, window, launcher control and the two roles),
``launcher`` (process-tree root), ``demo`` (the agent demo harness).
"""
