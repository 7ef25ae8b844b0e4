"""carw: a custom all-reduce over legacy CUDA IPC, the reference workload of issue 10
(docs/carw.md).

The pattern of vLLM's and SGLang's custom all-reduce: every rank ``cuMemAlloc``s (cudaMalloc)
a data buffer and a signal area, shares them with ``cuIpcGetMemHandle`` / ``cuIpcOpenMemHandle``
and keeps its peers' VAs in a device-side table that every step reads. Modules: ``layout``
(buffer layout, values, expected sums), ``evidence`` (per-rank record, the launcher's verdict),
``rank`` (one rank process), ``launcher`` (the process-tree root).
"""
