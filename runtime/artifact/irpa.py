"""IREE's parameter archive (.irpa) written tensor by tensor: the layout IREE's own builder
(`ParameterIndex.create_archive_file`) writes, byte for byte, with each tensor's bytes
written as it comes and dropped before the next is made, so that writing an archive holds
one tensor, not the whole model (the builder takes every buffer at once).

The format is IREE's `iree/schemas/parameter_archive.h`, version 0: a header; a table of
data entries, each naming its bytes in the metadata segment and its range in the storage
segment; the names and metadata blobs; the storage, each tensor at a 64-byte boundary;
the file padded to 4096 bytes. `tests/test_export.py` checks it against IREE's builder.
"""

from __future__ import annotations

import struct
from typing import BinaryIO, Iterable

import numpy as np

MAGIC = 0x41505249  # "IRPA"
HEADER = struct.Struct("<IHHQQQQQQQQQQ")  # prefix (magic, version, size, next, flags), entry count, 3 ranges
DATA_ENTRY = struct.Struct("<QIQQQQQQQQ")  # size, type, flags, name, metadata, alignment, storage range
DATA_TYPE = 2
ENTRY_ALIGNMENT = 16
DATA_ALIGNMENT = 64
FILE_ALIGNMENT = 4096


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def write_irpa(f: BinaryIO, entries: list[tuple[str, int, str]], arrays: Iterable[np.ndarray]) -> None:
    """Write an archive to `f` (a new file opened for writing): `entries` are (name, byte
    length, metadata) in order, known before any array is made; `arrays` yields each
    entry's array in the same order (its bytes as they lie, C order), each written then let go.
    ValueError if an array's byte count is not its entry's."""
    names = [(name.encode("utf-8"), meta.encode("utf-8")) for name, _, meta in entries]
    table_at = _align(HEADER.size, ENTRY_ALIGNMENT)
    table_length = max(0, len(entries) * _align(DATA_ENTRY.size, ENTRY_ALIGNMENT) - (
        _align(DATA_ENTRY.size, ENTRY_ALIGNMENT) - DATA_ENTRY.size))
    metadata_at = table_at + table_length
    metadata = b"".join(name + meta for name, meta in names)
    storage_at = _align(metadata_at + len(metadata), DATA_ALIGNMENT if entries else 1)
    starts, end = [], 0
    for _, length, _ in entries:
        starts.append(_align(end, DATA_ALIGNMENT))
        end = starts[-1] + length
    table, cursor = bytearray(), 0
    for (name, meta), (_, length, _), start in zip(names, entries, starts):
        table += bytes(_align(len(table), ENTRY_ALIGNMENT) - len(table))
        meta_at = cursor + len(name) if meta else 0  # no metadata: the range (0, 0)
        table += DATA_ENTRY.pack(DATA_ENTRY.size, DATA_TYPE, 0, cursor, len(name), meta_at, len(meta),
                                 DATA_ALIGNMENT, start, length)
        cursor += len(name) + len(meta)
    header = HEADER.pack(MAGIC, 0, 0, HEADER.size, 0, 0, len(entries), table_at, table_length, metadata_at,
                         len(metadata), storage_at, end)
    f.write(header + bytes(table_at - HEADER.size) + table + metadata)
    written = metadata_at + len(metadata)
    count = 0
    for (name, length, _), start, array in zip(entries, starts, arrays):
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if data.nbytes != length:
            raise ValueError(f"{name}: {data.nbytes} bytes, expected {length}")
        f.write(bytes(storage_at + start - written))
        f.write(data)
        written = storage_at + start + length
        count += 1
        del data, array
    if count != len(entries):
        raise ValueError(f"{count} arrays for {len(entries)} archive entries")
    f.write(bytes(_align(written, FILE_ALIGNMENT) - written))
