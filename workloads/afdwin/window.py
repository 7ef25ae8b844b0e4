"""The rank's symmetric window: driver context, geometry check, VMM window and peer mappings,
the fence, the --multicast team, the sharing probe, device reads and the ``window`` event.

A mixin of :class:`~cuinterpose.workloads.afdwin.rank_base.Rank`: the setup steps of
docs/afdwin.md "Setup", one method per step, plus what the checks after a resume read back.
"""

from __future__ import annotations

import os
import struct
import time

from .control import Abort


class GeometryError(ValueError):
    """The launcher found a geometry field that differs across ranks (message names it)."""


class Window:
    """Window state and the driver calls that build and read it (``self.cu``: the driver
    bindings, ``self.cd``: :mod:`.cudrv`; both set by ``Rank.setup``)."""

    def init_context(self) -> None:
        """cuInit, device ``rank mod device count``, its primary context made current."""
        cu, call = self.cu, self.cd.call
        call(cu.cuInit, 0)
        ndev = call(cu.cuDeviceGetCount)
        self.device_ordinal = self.rank % ndev
        self.device = call(cu.cuDeviceGet, self.device_ordinal)
        self.ctx = call(cu.cuDevicePrimaryCtxRetain, self.device)
        call(cu.cuCtxSetCurrent, self.ctx)

    def validate_geometry(self) -> None:
        """Send the geometry tuple (layout.GEOMETRY_FIELDS); raises ``GeometryError`` when the
        launcher reports a mismatch."""
        self.send({"type": "geometry", "values": list(self.win.geometry())})
        msg, _ = self.chan.recv()
        if msg["type"] == "fail":
            if "field" in msg:  # named by the launcher: field, values, message
                raise GeometryError(msg["message"])
            raise Abort(msg["message"])
        if msg["type"] != "geometry_ok":
            raise RuntimeError(f"expected geometry_ok, got {msg['type']!r}")

    def create_window(self) -> None:
        """One reservation of N x stride; own allocation (stride bytes) mapped at its base."""
        cu, call = self.cu, self.cd.call
        self.prop = self.cd.alloc_prop(self.device_ordinal)
        gran_opt = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        self.granularity = int(call(cu.cuMemGetAllocationGranularity, self.prop, gran_opt))
        total = self.win.total_bytes
        self.stride = -(-total // self.granularity) * self.granularity
        self.base = int(
            call(cu.cuMemAddressReserve, self.cfg.world * self.stride, self.granularity, 0, 0)
        )
        self.alloc_handle = call(cu.cuMemCreate, self.stride, self.prop, 0)
        call(cu.cuMemMap, self.base, self.stride, 0, self.alloc_handle, 0)
        self.access = [self.cd.rw_access(self.device_ordinal)]
        call(cu.cuMemSetAccess, self.base, self.stride, self.access, 1)
        self.probe_off = self.stride - 8 if self.stride - total >= 8 else None
        self.probe_epoch = 0

    def map_peers(self) -> None:
        """Export own handle (FD closed once sent), import every peer's FD (closed once
        mapped), map peer p at base + stride * ((p - rank) mod N), release the import."""
        cu, call = self.cu, self.cd.call
        N = self.cfg.world
        htype = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        fd = int(call(cu.cuMemExportToShareableHandle, self.alloc_handle, htype, 0))
        try:
            self.send({"type": "export", "rank": self.rank}, [fd])
        finally:
            os.close(fd)  # a held exported FD makes native checkpoint fail
        msg, fds = self.expect("peers")
        self.peer_va = [0] * N
        self.peer_va[self.rank] = self.base
        try:
            for peer, pfd in zip(msg["ranks"], fds):
                va = self.base + self.stride * ((peer - self.rank) % N)  # ring order
                imp = call(
                    cu.cuMemImportFromShareableHandle, pfd, htype, detail=f"fd from rank {peer}"
                )
                call(cu.cuMemMap, va, self.stride, 0, imp, 0, detail=f"peer rank {peer}")
                call(cu.cuMemRelease, imp)
                call(cu.cuMemSetAccess, va, self.stride, self.access, 1)
                self.peer_va[peer] = va
        finally:
            for pfd in fds:
                os.close(pfd)

    def fence(self) -> None:
        """Zero the window -> synchronize -> launcher barrier -> synchronize, then check
        through every peer mapping that it aliases the peer's memory (probe word).

        Diagnostics: ``delay_zero_ms`` delays this rank's zeroing; ``no_fence`` drops the
        barrier and the second synchronize (zero + sync only, the pre-review constructor), so a
        peer that returns first can land its first dispatch before a delayed zero erases it.
        """
        cu, call = self.cu, self.cd.call
        if self.cfg.delay_zero_ms:
            time.sleep(self.cfg.delay_zero_ms / 1000.0)
        if self.cfg.no_fence:
            # what the zero is about to erase (a peer wrote before this rank zeroed)
            flags = self.read_flags(self.rank)
            for idx, v in enumerate(flags):
                if v:
                    region, ring = divmod(idx, self.D)
                    self.fence_erased.append({"region": region, "ring": ring, "value": v})
        zeros = self.cd.HostBuffer(self.stride, pinned=False)
        call(cu.cuMemcpyHtoDAsync, self.base, zeros.addr, self.stride, self.aux)
        call(cu.cuStreamSynchronize, self.aux)
        del zeros
        self.write_probe()
        if self.cfg.no_fence:
            if self.fence_erased:
                self.errors.append(
                    f"unfenced zero erased flags written by peers: {self.fence_erased}"
                )
            return
        self.barrier("fence")
        call(cu.cuCtxSynchronize)
        bad = [err for err in self.read_probes().values() if err]
        if bad:
            raise RuntimeError("peer mappings do not alias the peers' windows: " + "; ".join(bad))

    # ---- --multicast (docs/afdwin.md "--multicast") ----------------------------------------
    MC_WORDS = 64  # uint32 words written through the multicast VA per check

    def setup_multicast(self) -> None:
        """Rank 0 creates and exports a multicast object (one multicast granule, numDevices =
        ranks); the launcher relays the FD; every rank imports it, adds its device, waits at a
        launcher barrier (bind blocks until the team is complete), binds a separate member
        allocation of its own at offset 0, maps that member at ``mc_member_va`` (for reading)
        and the object at a separate ``mc_va`` (for writing), with read-write access; a second
        barrier, since a write through the multicast VA reaches only the members bound then."""
        cu, call = self.cu, self.cd.call
        attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED
        if not call(cu.cuDeviceGetAttribute, attr, self.device):
            raise RuntimeError(
                f"--multicast: device {self.device_ordinal} reports "
                "CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0"
            )
        htype = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        prop = cu.CUmulticastObjectProp()
        prop.numDevices = self.cfg.world
        prop.handleTypes = int(htype)
        prop.flags = 0
        prop.size = self.granularity
        gran = int(
            call(
                cu.cuMulticastGetGranularity,
                prop,
                cu.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_RECOMMENDED,
            )
        )
        size = -(-max(self.MC_WORDS * 4, gran) // gran) * gran
        size = -(-size // self.granularity) * self.granularity
        prop.size = size
        self.mc_size = size
        if self.rank == 0:
            self.mc_handle = call(cu.cuMulticastCreate, prop)
            fd = int(call(cu.cuMemExportToShareableHandle, self.mc_handle, htype, 0))
            try:
                self.send({"type": "mc_export", "rank": self.rank}, [fd])
            finally:
                os.close(fd)
        else:
            _, fds = self.expect("mc_import")
            try:
                self.mc_handle = call(
                    cu.cuMemImportFromShareableHandle,
                    fds[0],
                    htype,
                    detail="multicast object from rank 0",
                )
            finally:
                for fd in fds:
                    os.close(fd)
        call(cu.cuMulticastAddDevice, self.mc_handle, self.device)
        self.barrier("mc-devices")  # every device added before any bind or map
        self.mc_member = call(cu.cuMemCreate, size, self.prop, 0)
        call(cu.cuMulticastBindMem, self.mc_handle, 0, self.mc_member, 0, size, 0)
        self.mc_member_va = int(call(cu.cuMemAddressReserve, size, self.granularity, 0, 0))
        call(cu.cuMemMap, self.mc_member_va, size, 0, self.mc_member, 0)
        call(cu.cuMemSetAccess, self.mc_member_va, size, self.access, 1)
        self.mc_va = int(call(cu.cuMemAddressReserve, size, self.granularity, 0, 0))
        call(cu.cuMemMap, self.mc_va, size, 0, self.mc_handle, 0)
        call(cu.cuMemSetAccess, self.mc_va, size, self.access, 1)
        self.barrier("mc-bound")  # a write reaches only the members bound by then
        self.mc_epoch = 0

    def multicast_value(self) -> int:
        return 0x4D430000 | (self.mc_epoch & 0xFFFF)  # "MC" | epoch

    def multicast_check(self) -> None:
        """Rank 0 writes the epoch's value through the multicast VA (cuMemsetD32, reaching
        every member); after a barrier every rank reads its own member (never through the
        multicast VA) and checks every word; emits a ``multicast`` event."""
        cu, call = self.cu, self.cd.call
        value = self.multicast_value()
        if self.rank == 0:
            call(cu.cuMemsetD32, self.mc_va, value, self.MC_WORDS)
        self.barrier(f"mc-written-{self.mc_epoch}")
        words = struct.unpack(
            f"<{self.MC_WORDS}I", self.read_device(self.mc_member_va, 4 * self.MC_WORDS)
        )
        bad = [i for i, w in enumerate(words) if w != value]
        ok = not bad
        self.record_check(
            ok,
            ""
            if ok
            else (
                f"multicast epoch {self.mc_epoch}: member at {self.mc_member_va:#x} word {bad[0]} "
                f"reads {words[bad[0]]:#010x}, expected {value:#010x}"
            ),
        )
        self.emit(
            {
                "event": "multicast",
                "rank": self.rank,
                "epoch": self.mc_epoch,
                "value": value,
                "ok": ok,
                "mc_va": self.mc_va,
                "member_va": self.mc_member_va,
                "writer": 0,
            }
        )
        self.barrier(f"mc-read-{self.mc_epoch}")  # nobody rewrites before all have read
        self.mc_epoch += 1

    def _host_memory_choice(self) -> bool:
        if self.host_memory == "pageable":
            return False
        if self.host_memory == "pinned":
            return True
        try:  # auto: pinned when the driver has it
            probe = self.cd.HostBuffer(4096, pinned=True)
            self.cd.call(self.cu.cuMemFreeHost, probe.addr)
            return True
        except Exception:
            return False

    def hbuf(self, size: int):
        return self.cd.HostBuffer(size, pinned=self.pinned)

    # ---- sharing probe: a word in the stride padding past total_bytes ------------------------
    def probe_value(self, rank: int) -> int:
        return 0xA5000000 | (rank & 0xFF) << 16 | (self.probe_epoch & 0xFFFF)

    def write_probe(self) -> None:
        """Write this rank's probe word into its own window (stride padding) and synchronize."""
        if self.probe_off is None:
            return
        buf = self.cd.HostBuffer(4, pinned=False)
        buf.write(struct.pack("<I", self.probe_value(self.rank)))
        self.cd.call(self.cu.cuMemcpyHtoDAsync, self.base + self.probe_off, buf.addr, 4, self.aux)
        self.cd.call(self.cu.cuStreamSynchronize, self.aux)

    def read_probes(self) -> dict[int, str | None]:
        """Read every peer's probe word through this rank's mapping of the peer's window:
        ``{peer: None}`` when it holds the value that peer wrote, else an error text (the
        mapping no longer aliases the peer's memory: sharing lost). Empty without padding."""
        if self.probe_off is None:
            return {}
        out = {}
        for peer, va in enumerate(self.peer_va):
            if peer == self.rank:
                continue
            (got,) = struct.unpack("<I", self.read_device(va + self.probe_off, 4))
            want = self.probe_value(peer)
            out[peer] = (
                None
                if got == want
                else (
                    f"rank {peer} probe at VA {va + self.probe_off:#x} reads {got:#010x}, "
                    f"expected {want:#010x} (sharing lost)"
                )
            )
        return out

    def window_event(self, after_restore: bool) -> dict:
        return {
            "event": "window",
            "rank": self.rank,
            "pid": self.pid,
            "role": self.role,
            "device": self.device_ordinal,
            "base_va": self.base,
            "peer_va": list(self.peer_va),
            "stride": self.stride,
            "slot_bytes": self.win.slot_bytes,
            "total_bytes": self.win.total_bytes,
            "regions": self.win.num_regions,
            "rings": self.win.ring_depth,
            "handle_type": "POSIX_FILE_DESCRIPTOR",
            "granularity": self.granularity,
            "stages": self.cfg.num_stages,
            "host_memory": "pinned" if self.pinned else "pageable",
            "after_restore": after_restore,
            **(
                {"mc_va": self.mc_va, "mc_member_va": self.mc_member_va, "mc_size": self.mc_size}
                if self.cfg.multicast
                else {}
            ),
        }

    # ---- addresses ------------------------------------------------------------------------
    def flag_va(self, owner: int, region: int, ring: int) -> int:
        return self.peer_va[owner] + self.win.flag_off(region, ring)

    def slot_va(self, owner: int, region: int, ring: int) -> int:
        return self.peer_va[owner] + self.win.slot_off(region, ring)

    # ---- device reads (aux stream, synchronized) ------------------------------------------
    def read_device(self, va: int, n: int) -> bytes:
        buf = self.cd.HostBuffer(n, pinned=False)
        self.cd.call(self.cu.cuMemcpyDtoHAsync, buf.addr, va, n, self.aux)
        self.cd.call(self.cu.cuStreamSynchronize, self.aux)
        return buf.read()

    def read_flags(self, owner: int) -> list[int]:
        raw = self.read_device(self.peer_va[owner], 4 * self.win.num_flags)
        return list(struct.unpack(f"<{self.win.num_flags}i", raw))
