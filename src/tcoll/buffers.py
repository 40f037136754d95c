"""Turn user buffers (NumPy arrays, PyTorch CPU tensors, buffer-protocol and
DLPack objects) into flat byte views that transports can copy to and from.

No data is copied here: the returned view shares memory with the caller's
object, which is how a receive lands in place.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["as_bytes"]

_U8 = np.dtype(np.uint8)


def as_bytes(obj: Any, *, writable: bool, what: str = "buffer") -> np.ndarray:
    """Return a flat uint8 view of a contiguous CPU buffer, sharing its memory.

    Args:
        obj: a NumPy array, a PyTorch CPU tensor, an object with ``__dlpack__``,
            or any object with the buffer protocol (bytes, bytearray, memoryview, ...).
        writable: require the memory to be writable (a receive target).
        what: how to name the argument in error messages.

    Returns:
        A 1-D uint8 ndarray over the same memory (length = size in bytes).

    Raises:
        TypeError: the object is not a buffer tcoll understands, or is not on the CPU.
        ValueError: the buffer is not contiguous, or is read-only when writable is required.
    """
    if type(obj) is np.ndarray:
        arr = obj
    else:
        arr = _to_ndarray(obj, what)
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        raise ValueError(
            f"{what} must be contiguous (got strides {arr.strides} for shape {arr.shape}); "
            "pass np.ascontiguousarray(x) or x.contiguous()"
        )
    if writable and not arr.flags.writeable:
        raise ValueError(f"{what} is read-only and cannot receive data")
    if arr.dtype.hasobject:
        raise TypeError(f"{what} has dtype object; use the *_object functions for Python objects")
    if arr.dtype == _U8 and arr.ndim == 1:
        return arr
    # reshape(-1) on a contiguous array is a view; order="A" keeps Fortran
    # arrays as views too (their bytes are contiguous, just in column order).
    return arr.reshape(-1, order="A").view(_U8)


def _to_ndarray(obj: Any, what: str) -> np.ndarray:
    """Convert a non-ndarray buffer to an ndarray view of the same memory."""
    if isinstance(obj, np.ndarray):  # ndarray subclasses (np.memmap, ...)
        return np.asarray(obj)
    module = type(obj).__module__
    if module.startswith("torch"):
        return _torch_to_ndarray(obj, what)
    if hasattr(obj, "__dlpack__"):
        try:
            return np.from_dlpack(obj)
        except (TypeError, RuntimeError, BufferError) as exc:
            raise TypeError(f"{what}: cannot read {type(obj).__name__} through DLPack: {exc}") from None
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"{what} must be a NumPy array, a PyTorch CPU tensor, or support the buffer "
            f"protocol; got {type(obj).__name__}"
        ) from None
    if not view.contiguous:
        raise ValueError(f"{what} must be contiguous")
    return np.frombuffer(view, dtype=_U8) if view.readonly else np.asarray(view).reshape(-1).view(_U8)


def _torch_to_ndarray(tensor: Any, what: str) -> np.ndarray:
    """View a PyTorch CPU tensor's memory as an ndarray (bytes; dtype kept when NumPy has it)."""
    if getattr(tensor, "device", None) is not None and tensor.device.type != "cpu":
        raise TypeError(f"{what} is a tensor on {tensor.device}; tcoll moves CPU tensors only")
    if not tensor.is_contiguous():
        raise ValueError(f"{what} must be contiguous (got strides {tuple(tensor.stride())}); pass x.contiguous()")
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.numel() == 0:
        return np.empty(0, dtype=_U8)
    import torch

    flat = tensor.reshape(-1)
    if flat.dtype == torch.bool:
        return flat.numpy()
    # Viewing as uint8 works for every dtype, bfloat16 included, which
    # Tensor.numpy() refuses; it shares memory with the tensor.
    return flat.view(torch.uint8).numpy()

