"""afdwin: the reference symmetric-window workload (DESIGN.md §6, docs/afdwin.md).

A stand-in for an attention/FFN-disaggregated deployment's NVSHMEM symmetric window built on
plain CUDA driver VMM. Modules: ``layout`` (window layout, header codec, geometry check),
``config`` (profiles), ``payload`` (messages, trailer, checksum), ``evidence`` (per-pair
delivery evidence, rates), ``wire`` (launcher<->rank framing with SCM_RIGHTS), ``cudrv``
(checked driver wrappers), ``rank`` (rank process), ``launcher`` (process-tree root).
"""
