"""Python mirror of ``interposer/include/cuinterpose/protocol.h``: the shim control wire format.

protocol.h is the single definition; this package mirrors it field for field (and the
``CUI_OPS`` table row for row: :data:`OPS`, from which :data:`MUTATING_OPS`,
:data:`CARRIER_OPS` and :data:`MULTICAST_RESTORE_OPS` are derived) and
``tests/coordinator/test_protocol.py`` pins every offset, size and constant against the C
header (compiled), and round-trips bytes in both directions. Change both together.

The definitions live in seven modules (``carriers``: the chunk file table of SAVE/LOAD_ALLOCATIONS;
``codes``: #defines, enums, the ops table;
``structs``: the struct layouts and the dataclasses that pack them (``ticket``: the export
ticket's); ``checksum``;
``sockets``: socket names and the default control dir; ``ipc``: the virtual IPC handle
and the FETCH_FD secret fields); every name is importable from here.

All structs are packed with explicit little-endian ``struct`` formats (``<``); the C structs
are naturally aligned with no implicit padding, so the formats need no pad bytes.

Units: sizes, offsets and byte counts are bytes; durations are nanoseconds (``*_ns``).
Errors: ``unpack`` raises :class:`ProtocolError` on a wrong length, bad magic/version or an
``access_count`` above :data:`CUI_MAX_ACCESS`; ``pack`` raises :class:`ProtocolError` on a
field that does not fit (``struct.error`` is converted).
"""

from __future__ import annotations

from . import carriers, checksum, codes, ipc, sockets, structs, ticket
from .carriers import *  # noqa: F403
from .checksum import *  # noqa: F403
from .codes import *  # noqa: F403
from .ipc import *  # noqa: F403
from .sockets import *  # noqa: F403
from .structs import *  # noqa: F403
from .structs import _LAYOUTS  # noqa: F401 (test_protocol.py compares it with the C layout)
from .ticket import *  # noqa: F403

#: every name of the mirror: each module's ``__all__``
__all__ = [
    *carriers.__all__,
    *checksum.__all__,
    *codes.__all__,
    *ipc.__all__,
    *sockets.__all__,
    *structs.__all__,
    *ticket.__all__,
]
