"""A checkpoint's dense tensors read a block of rows at a time, never a whole tensor at once.

DCP stores each saved box (chunk) of a tensor as one ``torch.save`` archive inside a ``*.distcp``
file; the metadata gives every chunk's offsets and sizes in the dense tensor and where its archive
lies. An archive is a zip whose one storage record holds the tensor's bytes uncompressed, so rows
``[a, b)`` of a contiguous chunk are one byte range of the file: :class:`CheckpointTensors` reads
just that range (the tensor's dtype, shape and strides come from loading the archive onto the meta
device, which reads no data). A chunk stored any other way (not contiguous, compressed, another
byte order) is loaded whole, as DCP itself would: correct, only without the bound.

Memory: one block of rows of one tensor (plus one chunk when a chunk has to be loaded whole), so
``parallel4d export`` of a model of any size runs in bounded memory.
"""

from __future__ import annotations

import io
import re
import struct
import sys
import zipfile
from pathlib import Path

import torch

from parallel4d.checkpoint import dcp as checkpoint
from parallel4d.checkpoint.failures import CheckpointError

_STORAGE = re.compile(r"[^/]+/data/\d+")
_LOCAL_HEADER = b"PK\x03\x04"


class _Range(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open binary file, as a seekable file of their own."""

    def __init__(self, f, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = pos + (0, self.pos, self.length)[whence]
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(b)[:n])
        self.pos += got
        return got


def _raw_start(f, start: int, length: int, meta: torch.Tensor) -> int | None:
    """Where in ``f`` the bytes of the archive at ``[start, start + length)`` begin, when they are
    ``meta``'s elements in order (one uncompressed storage record, contiguous, little-endian); else None."""
    if sys.byteorder != "little" or not meta.is_contiguous() or meta.storage_offset() != 0:
        return None
    archive = zipfile.ZipFile(_Range(f, start, length))
    records = [i for i in archive.infolist() if _STORAGE.fullmatch(i.filename)]
    orders = [i for i in archive.namelist() if i.endswith("/byteorder")]
    if orders and archive.read(orders[0]) != b"little":
        return None
    if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED \
            or records[0].file_size != meta.numel() * meta.element_size():
        return None
    f.seek(start + records[0].header_offset)
    header = f.read(30)  # the zip format's local file header: 30 bytes, then the name and the extra field
    if header[:4] != _LOCAL_HEADER:
        return None
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return start + records[0].header_offset + 30 + name_len + extra_len


class CheckpointTensors:
    """The tensors of DCP checkpoint ``path`` by key: ``shapes`` (key → ``(dense shape, dtype)``) and
    :meth:`read` (rows of one). Use as a context manager (closes the files)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        metadata = checkpoint.dcp.FileSystemReader(str(self.path)).read_metadata()
        tensor = checkpoint.dcp.TensorStorageMetadata
        self.meta = {k: md for k, md in metadata.state_dict_metadata.items() if isinstance(md, tensor)}
        self.shapes = {k: (md.size, md.properties.dtype) for k, md in self.meta.items()}
        self.where = {(i.fqn, tuple(i.offset)): info for i, info in metadata.storage_data.items()}
        self._files: dict[str, object] = {}
        self._layouts: dict[tuple, tuple] = {}

    def _file(self, name: str):
        if name not in self._files:
            self._files[name] = open(self.path / name, "rb")
        return self._files[name]

    def _layout(self, key: str, offsets: tuple) -> tuple:
        """``(file, byte offset of the chunk's first element or None, shape, dtype, storage info)``."""
        if (key, offsets) not in self._layouts:
            info = self.where[key, offsets]
            f = self._file(info.relative_path)
            meta = torch.load(_Range(f, info.offset, info.length), map_location="meta", weights_only=True)
            start = None if info.transform_descriptors else _raw_start(f, info.offset, info.length, meta)
            # not the meta tensor itself: it keeps the archive's reader, and its buffers, alive
            self._layouts[key, offsets] = (f, start, meta.shape, meta.dtype, info)
        return self._layouts[key, offsets]

    def _chunk_rows(self, key: str, offsets: tuple, a: int, b: int) -> torch.Tensor:
        """Rows ``[a, b)`` of the chunk saved at ``offsets`` (all of it for a 0-dim tensor)."""
        f, start, shape, dtype, info = self._layout(key, offsets)
        if start is None:  # stored some other way: load it whole
            whole = torch.load(_Range(f, info.offset, info.length), map_location="cpu", weights_only=True)
            return whole if whole.dim() == 0 else whole[a:b]
        out = torch.empty((b - a, *shape[1:]) if len(shape) else (), dtype=dtype)
        buf = out.reshape(-1).view(torch.uint8).numpy()
        f.seek(start + a * (out[0].numel() * out.element_size() if len(shape) else 0))
        done = 0
        while done < len(buf):
            got = f.readinto(memoryview(buf)[done:])
            if not got:
                raise OSError(f"{self.path / info.relative_path}: ends inside tensor {key!r}")
            done += got
        return out

    def read(self, key: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` of dense tensor ``key`` (the whole of a 0-dim one), assembled from
        the saved chunks they overlap."""
        md = self.meta[key]
        if len(md.size) == 0:
            return self._chunk_rows(key, (), 0, 1)
        stop = md.size[0] if stop is None else stop
        chunks = [c for c in md.chunks if c.offsets[0] < stop and start < c.offsets[0] + c.sizes[0]]
        spans = [(c, max(start, c.offsets[0]), min(stop, c.offsets[0] + c.sizes[0])) for c in chunks]
        if len(spans) == 1 and tuple(chunks[0].sizes[1:]) == tuple(md.size[1:]) and spans[0][1:] == (start, stop):
            c = chunks[0]  # one chunk holds these rows whole: no copy
            return self._chunk_rows(key, tuple(c.offsets), start - c.offsets[0], stop - c.offsets[0])
        out = torch.empty((stop - start, *md.size[1:]), dtype=md.properties.dtype)
        if sum((b - a) * torch.Size(c.sizes[1:]).numel() for c, a, b in spans) != out.numel():
            raise CheckpointError(f"checkpoint {self.path}: the saved chunks of {key!r} do not cover rows "
                                  f"[{start}, {stop})")
        for c, a, b in spans:
            rows = self._chunk_rows(key, tuple(c.offsets), a - c.offsets[0], b - c.offsets[0])
            out[(slice(a - start, b - start), *(slice(o, o + n) for o, n in zip(c.offsets[1:], c.sizes[1:])))] = rows
        return out

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
