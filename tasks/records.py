"""Flower's records read, written and copied without per-array parsing.

Flower keeps each array of an ``ArrayRecord`` as ``.npy`` bytes: ``Array.numpy`` parses
the header (a Python dict literal, through ``ast``) on every read, and ``np.save``
formats one on every write; with a small model each costs more than the array's data
(about 0.3 ms a message each for the small CNN's eight arrays). The header is a function
of the dtype and shape alone, so these helpers format it once per (dtype, shape) and
read the data at the offset the dtype and shape give. The bytes are exactly Flower's for a
C-ordered array (tests compare them), and anything but a little-endian, C-ordered plain dtype goes
through Flower's own reader and writer.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from functools import lru_cache

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

NUMPY = "numpy.ndarray"  # Flower's SType.NUMPY
_FAST_KINDS = "fiub"  # float, signed and unsigned int, bool: no object or structured dtypes


@lru_cache(maxsize=4096)
def _header(dtype: str, shape: tuple[int, ...]) -> bytes:
    """``np.save``'s header for a C-ordered array of ``dtype`` and ``shape``."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": np.dtype(dtype).str,
                                               "fortran_order": False, "shape": shape})
    return buf.getvalue()


def _fast(dtype: np.dtype) -> bool:
    """A plain little-endian (or byte-sized) dtype, whose header this module formats."""
    return dtype.kind in _FAST_KINDS and dtype.str[0] in "<|"


def ndarray(array: Array) -> np.ndarray:
    """``array.numpy()``: a writable copy of the array the bytes hold."""
    if array.stype == NUMPY:
        dtype = np.dtype(array.dtype)
        shape = tuple(array.shape)
        if _fast(dtype):
            head = _header(array.dtype, shape)
            data = array.data
            if data.startswith(head) and len(data) == len(head) + dtype.itemsize * int(
                    np.prod(shape, dtype=np.int64)):
                return np.frombuffer(data, dtype, offset=len(head)).reshape(shape).copy()
    return array.numpy()


def to_array(value: np.ndarray | torch.Tensor) -> Array:
    """``Array(value)``: the ``.npy`` bytes ``np.save`` writes, header formatted once per
    dtype and shape."""
    a = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
    if not _fast(a.dtype):
        return Array(a)
    dtype = str(a.dtype)  # tobytes is C-ordered whatever the layout, as the header says
    return Array(dtype=dtype, shape=tuple(a.shape), stype=NUMPY,
                 data=_header(dtype, tuple(a.shape)) + a.tobytes())


def state_dict(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """``record.to_torch_state_dict()``."""
    return {k: torch.from_numpy(ndarray(v)) for k, v in record.items()}


def array_record(state: Mapping[str, torch.Tensor | np.ndarray]) -> ArrayRecord:
    """``ArrayRecord(state)`` for a torch state dict or a dict of arrays."""
    record = ArrayRecord()  # filled in place: ArrayRecord(dict) builds every Array twice
    for k, v in state.items():
        record[k] = to_array(v)
    return record


def _copy_value(value):
    return list(value) if isinstance(value, list) else value


def copy_records(content: RecordDict) -> RecordDict:
    """A copy of ``content`` that shares nothing mutable with it: new records and arrays
    (an array's bytes and the records' scalars are immutable and shared; lists are
    copied). What a runtime's serialize-and-parse delivers, without the protobuf."""
    out = RecordDict()
    for key, record in content.items():
        if isinstance(record, ArrayRecord):
            arrays = out[key] = ArrayRecord()
            for k, a in record.items():
                arrays[k] = Array(dtype=a.dtype, shape=tuple(a.shape), stype=a.stype,
                                  data=bytes(a.data))
        elif isinstance(record, MetricRecord):
            out[key] = MetricRecord({k: _copy_value(v) for k, v in record.items()})
        elif isinstance(record, ConfigRecord):
            out[key] = ConfigRecord({k: _copy_value(v) for k, v in record.items()})
        else:
            raise TypeError(f"record {key!r}: {type(record).__name__} is not a Flower record")
    return out
