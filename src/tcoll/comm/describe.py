"""Describing an array in a few bytes, for calls where some ranks must learn a shape and dtype.

scatter, the uneven (v) collectives and the object collectives tell the
receiving ranks what will arrive. A description is a fixed-size byte
buffer, so it can travel through any collective algorithm; it holds text
"kind;dtype;shape" (kind is "numpy" or "torch"), never a pickle.
"""

from __future__ import annotations

import json
import functools
from typing import Any

import ml_dtypes
import numpy as np

from ..buffers import as_array, empty_like_kind, is_torch

__all__ = ["META_BYTES", "encode", "decode", "allocate", "dtype_name", "dtype_from_name"]

META_BYTES = 256
_EXTRA = {"bfloat16": np.dtype(ml_dtypes.bfloat16)}


def dtype_name(dtype: np.dtype) -> str:
    """A name from which `dtype_from_name` rebuilds `dtype`, byte order and structured dtypes included."""
    if dtype.names is not None:
        return json.dumps(dtype.descr)
    if dtype in _EXTRA.values():
        return dtype.name
    return dtype.str  # "<f4", ">i4", "|b1": keeps the byte order that .name drops


def dtype_from_name(name: str) -> np.dtype:
    """The dtype that `dtype_name` named."""
    if name in _EXTRA:
        return _EXTRA[name]
    if name.startswith("["):
        # JSON, not ast.literal_eval: CPython 3.11's parser fails ("AST constructor recursion depth
        # mismatch") when ranks that are threads of one process parse at the same time.
        return np.dtype(_descr(json.loads(name)))
    return np.dtype(name)


def _descr(fields: list[Any]) -> list[tuple[Any, ...]]:
    """A structured dtype's descr from its JSON form: lists back to the tuples NumPy wants."""
    out = []
    for field in fields:
        name, kind, *shape = field
        name = tuple(name) if isinstance(name, list) else name  # (title, name)
        out.append((name, _descr(kind) if isinstance(kind, list) else kind, *(tuple(s) for s in shape)))
    return out


def encode(obj: Any) -> np.ndarray:
    """Describe the array or tensor `obj` in META_BYTES bytes.

    Raises:
        ValueError: the description does not fit (a structured dtype with very many fields).
    """
    arr = as_array(obj, writable=False, what="array")
    return _encoded("torch" if is_torch(obj) else "numpy", arr.dtype, arr.shape)


@functools.lru_cache(maxsize=256)
def _encoded(kind: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """The description of (kind, dtype, shape), made once (calls repeat; read-only: callers copy it)."""
    raw = f"{kind};{dtype_name(dtype)};{','.join(map(str, shape))}".encode()
    if len(raw) > META_BYTES:
        raise ValueError(f"cannot describe dtype {dtype} in {META_BYTES} bytes")
    out = np.zeros(META_BYTES, dtype=np.uint8)
    out[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    out.flags.writeable = False
    return out


def decode(described: np.ndarray) -> tuple[str, np.dtype, tuple[int, ...]]:
    """Read what `encode` wrote: (kind, dtype, shape)."""
    text = described.tobytes().rstrip(b"\0").decode()
    kind, name, shape_text = text.split(";")
    shape = tuple(int(n) for n in shape_text.split(",")) if shape_text else ()
    return kind, dtype_from_name(name), shape


def allocate(kind: str, dtype: np.dtype, shape: tuple[int, ...]) -> tuple[Any, np.ndarray]:
    """A new array (or torch tensor, for kind "torch") of this dtype and shape, and its ndarray view."""
    if kind == "torch":
        import torch

        torch_dtype = {np.dtype(ml_dtypes.bfloat16): torch.bfloat16}.get(dtype)
        if torch_dtype is None:
            torch_dtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
        return empty_like_kind(torch.empty(0, dtype=torch_dtype), shape, dtype)
    out = np.empty(shape, dtype=dtype)
    return out, out
