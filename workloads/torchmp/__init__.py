"""torchmp: real PyTorch jobs that share CUDA tensors between processes the way users' software
does, under the workload contract (workloads/mpcontract.py), for the lent GPU (issue 29) and,
with ``--device cpu``, for a rehearsal wherever a CPU build of torch is importable.

Jobs (``--job``): ``stream`` (a producer sends sequence-numbered tensors to consumers through a
``torch.multiprocessing`` queue: CUDA memory shared by IPC handles or, with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, by cuMem FDs, each with an IPC event) and
``decode`` (a small transformer decoding greedily token by token in one process, its logits sent
to a sink process through the same queue) and ``collective`` (one rank of torch.distributed
all-reducing). Modules: ``rank`` (the device of a rank), ``stream``, ``decode``,
``collective``, ``launcher`` (options, the tree, the summary). See docs/torchmp.md.
"""
