"""tmsh: a replay of torch.multiprocessing's CUDA tensor sharing (docs/tmsh.md), on cuda-python's
driver bindings only, so it runs on fakecuda and, unchanged, on a real GPU.

Modules: ``refcount`` (the producer's shared-memory reference-counter file), ``segments`` (the
producer's caching-allocator-like pool and the consumer's cache of opened segments, for the
``ipc`` and ``expandable`` variants; payload layout), ``reductions`` (the storage and event
objects and how ForkingPickler reduces and rebuilds them), ``producer``, ``consumer``,
``launcher`` (the process-tree root: the queue, the quiesce contract, the summary).
"""
