"""How tmsh's storages and events cross the queue: reduced by ``ForkingPickler`` in the producer
and rebuilt when the consumer unpickles them, as ``torch.multiprocessing.reductions`` does.

Producer, :meth:`Sharer.share` (``THPStorage_shareCuda``, torch/csrc/StorageSharing.cpp): the
segment's share handle and the storage's offset in it, a new reference-counter slot set to 1
(``GetNewRefCountedSentData``), then, while fewer than ``max_events`` sync events are alive, an
event created with ``INTERPROCESS | DISABLE_TIMING | BLOCKING_SYNC``, recorded on the producer's
stream and exported with ``cuIpcGetEventHandle`` (``CudaIPCSentData``, CudaIPCTypes.cpp); past
that limit (PyTorch: ``CUDA_IPC_MAXIMUM_EVENTS_TO_USE`` = 1000) the stream is synchronized
instead and ``event_sync_required`` is False. The message is ``ForkingPickler.dumps`` of the
storage in the producer's thread (SGLang's ``MultiprocessingSerializer``; a torch queue pickles
in its feeder thread), put on a ``multiprocessing`` queue as bytes.

Consumer, :func:`rebuild_storage` (``rebuild_cuda_tensor``, torch/multiprocessing/reductions.py,
and ``THPStorage_newSharedCuda``): a storage already in the cache (same handle and offset)
releases the new reference at once (``_release_ipc_counter``); otherwise, when
``event_sync_required``, ``cuIpcOpenEventHandle`` and ``cuStreamWaitEvent`` on the consumer's
stream (the opened event is never destroyed: PyTorch keeps none of them and frees none), then
the segment opened (once per handle) and the storage cached. Dropping a storage synchronizes the
stream and decrements its counter (the rebuilt storage's deleter).

A pickled event (``torch.cuda.Event`` with ``interprocess=True``; ``reduce_event``,
``rebuild_event`` -> ``Event.from_ipc_handle``) is :class:`SharedEvent`: opened once in the
consumer and kept for the event object's life.
"""

from __future__ import annotations

import ctypes
from multiprocessing.reduction import ForkingPickler

from cuda.bindings import driver as cu

from ..afdwin.cudrv import call
from .refcount import RefCounterFile
from .segments import Opened

EVENT_FLAGS = (
    cu.CUevent_flags.CU_EVENT_INTERPROCESS
    | cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
    | cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC
)


def event_handle_bytes(ev) -> bytes:
    h = call(cu.cuIpcGetEventHandle, ev)
    return ctypes.string_at(h.getPtr(), 64)


def open_event(raw: bytes):
    h = cu.CUipcEventHandle()
    ctypes.memmove(h.getPtr(), raw, 64)
    return call(cu.cuIpcOpenEventHandle, h, detail="IPC event")


class Sent:
    """What the producer keeps of a sent storage (``CudaIPCSentData``)."""

    def __init__(self, seq, slot, refs: RefCounterFile, ref_slot: int, event):
        self.seq, self.slot, self.refs, self.ref_slot, self.event = seq, slot, refs, ref_slot, event

    def counter(self) -> int:
        return self.refs.get(self.ref_slot)


class SharedStorage:
    """A storage as the producer puts it on the queue: ``args`` are the fields ``_share_cuda_``
    returns (seq, device, handle, size, offset, ref_name, ref_slot, event_handle,
    event_sync_required), what :func:`rebuild_storage` takes."""

    def __init__(self, *args):
        self.args = args


def _reduce_storage(s: SharedStorage):
    return (rebuild_storage, s.args)


ForkingPickler.register(SharedStorage, _reduce_storage)


class Sharer:
    """The producer's side of sharing: ``share`` returns (message bytes, Sent)."""

    def __init__(self, device: int, stream, max_events: int):
        self.device, self.stream, self.max_events = device, stream, max_events
        self.refs = RefCounterFile.new_for_self()
        self.files = [self.refs]
        self.live_events = 0
        self.synced = 0  # sends past the event limit (stream synchronized instead)

    def share(
        self, seq: int, slot: int, handle: tuple, offset: int, size: int
    ) -> tuple[bytes, Sent]:
        if self.refs.full():
            self.refs = RefCounterFile.new_for_self()
            self.files.append(self.refs)
        ref_slot = self.refs.take()
        ev, raw = None, bytes(64)
        if self.live_events < self.max_events:
            ev = call(cu.cuEventCreate, EVENT_FLAGS)
            call(cu.cuEventRecord, ev, self.stream)
            raw = event_handle_bytes(ev)
            self.live_events += 1
        else:
            call(cu.cuStreamSynchronize, self.stream)
            self.synced += 1
        s = SharedStorage(
            seq, self.device, handle, size, offset, self.refs.name, ref_slot, raw, ev is not None
        )
        return bytes(ForkingPickler.dumps(s)), Sent(seq, slot, self.refs, ref_slot, ev)

    def retire(self, sent: Sent) -> None:
        """The storage's counter reached 0: its event goes (``~CudaIPCSentData``)."""
        if sent.event is not None:
            call(cu.cuEventDestroy, sent.event)
            self.live_events -= 1


class Received:
    """A rebuilt storage in the consumer."""

    def __init__(self, seq, va, size, handle, offset, ref_name, ref_slot):
        self.seq, self.va, self.size = seq, va, size
        self.handle, self.offset, self.ref_name, self.ref_slot = handle, offset, ref_name, ref_slot


class Receiver:
    """The consumer's state the rebuild functions use (PyTorch's: the current stream, the
    allocator's IPC cache, the shared cache of storages)."""

    def __init__(self, device: int, stream):
        self.device, self.stream = device, stream
        self.opened = Opened(device)
        self.cache: dict[tuple, Received] = {}
        self.files: dict[str, RefCounterFile] = {}
        self.events: list = []  # opened per-storage events: never destroyed, as in PyTorch
        self.cache_hits = 0

    def counter_file(self, name: str) -> RefCounterFile:
        f = self.files.get(name)
        if f is None:
            f = self.files[name] = RefCounterFile(name)
        return f

    def drop(self, st: Received) -> None:
        """The storage's deleter: synchronize the stream, decrement its counter, close its
        segment after the last storage of it."""
        call(cu.cuStreamSynchronize, self.stream)
        self.counter_file(st.ref_name).decrement(st.ref_slot)
        del self.cache[(st.handle, st.offset)]
        self.opened.release(st.handle)


RECEIVER: Receiver | None = None  # set by the consumer before it unpickles anything


def rebuild_storage(
    seq, device, handle, size, offset, ref_name, ref_slot, event_handle, event_sync_required
):
    r = RECEIVER
    cached = r.cache.get((handle, offset))
    if cached is not None:
        r.counter_file(ref_name).decrement(ref_slot)  # _release_ipc_counter
        r.cache_hits += 1
        return cached
    if event_sync_required:
        ev = open_event(event_handle)
        call(cu.cuStreamWaitEvent, r.stream, ev, 0)
        r.events.append(ev)
    va = r.opened.open(handle) + offset
    st = Received(seq, va, size, handle, offset, ref_name, ref_slot)
    r.cache[(handle, offset)] = st
    return st


class SharedEvent:
    """An interprocess event the producer pickles (``torch.cuda.Event(interprocess=True)``)."""

    def __init__(self, device: int):
        self.device = device
        self.event = call(
            cu.cuEventCreate,
            cu.CUevent_flags.CU_EVENT_INTERPROCESS | cu.CUevent_flags.CU_EVENT_DISABLE_TIMING,
        )


def _reduce_event(e: SharedEvent):
    return (rebuild_event, (e.device, event_handle_bytes(e.event)))


ForkingPickler.register(SharedEvent, _reduce_event)


def rebuild_event(device, raw):
    """``Event.from_ipc_handle``: opened once, kept for the object's life."""
    return open_event(raw)
