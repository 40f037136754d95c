"""Turn user buffers (NumPy arrays, PyTorch CPU tensors, buffer-protocol and
DLPack objects) into flat byte views that transports can copy to and from.

No data is copied here: the returned view shares memory with the caller's
object, which is how a receive lands in place.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np

__all__ = ["as_bytes", "as_array", "empty_like_kind", "is_torch", "exported"]

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
        arr = _to_ndarray(obj, what, writable)
    _check_usable(arr, writable, what, fortran_ok=True)
    if arr.dtype == _U8 and arr.ndim == 1:
        return arr
    # reshape(-1) on a contiguous array is a view; order="A" keeps Fortran
    # arrays as views too (their bytes are contiguous, just in column order).
    return arr.reshape(-1, order="A").view(_U8)


def _to_ndarray(obj: Any, what: str, writable: bool = False) -> np.ndarray:
    """Convert a non-ndarray buffer to an ndarray view of the same memory (writable: a receive target)."""
    if isinstance(obj, np.ndarray):  # ndarray subclasses (np.memmap, ...)
        return np.asarray(obj)
    module = type(obj).__module__
    if module.startswith("torch"):
        return _torch_to_ndarray(obj, what)
    if hasattr(obj, "__dlpack__"):
        try:
            arr = np.from_dlpack(obj)
        except (TypeError, RuntimeError, BufferError) as exc:
            raise TypeError(f"{what}: cannot read {type(obj).__name__} through DLPack: {exc}") from None
        return _writable(arr) if writable and not arr.flags.writeable and _legacy_dlpack(obj) else arr
    try:
        view = memoryview(obj)
    except TypeError:
        if hasattr(obj, "__cuda_array_interface__"):  # a device array in a process where calls do not stage
            raise TypeError(f"{what} is a CUDA array ({type(obj).__name__}); tcoll stages CUDA buffers through "
                            "host memory where torch with CUDA (or CuPy) was imported before tcoll.init, or with "
                            "TCOLL_GPU=staging (docs/gpu.md)") from None
        raise TypeError(
            f"{what} must be a NumPy array, a PyTorch CPU tensor, or support the buffer "
            f"protocol; got {type(obj).__name__}"
        ) from None
    if not view.contiguous:
        raise ValueError(f"{what} must be contiguous")
    return np.frombuffer(view, dtype=_U8) if view.readonly else np.asarray(view).reshape(-1).view(_U8)


def _legacy_dlpack(obj: Any) -> bool:
    """Whether `obj` speaks only the unversioned DLPack protocol, which cannot say whether memory is read-only.

    NumPy marks what such an exporter gives as read-only; tcoll takes the
    exporter at its word that a receive target may be written, as it does for torch.
    """
    try:
        obj.__dlpack__(max_version=(1, 0))  # the capsule, unused, releases the export when collected
    except TypeError:
        return True
    return False


def _writable(arr: np.ndarray) -> np.ndarray:
    """A writable view of the memory of `arr`, which it keeps alive."""
    order = "C" if arr.flags.c_contiguous else "F" if arr.flags.f_contiguous else None
    if order is None or not arr.nbytes:
        return arr  # strided (refused as such later) or empty: nothing to write
    raw = (ctypes.c_char * arr.nbytes).from_address(arr.ctypes.data)
    raw._keep = arr  # type: ignore[attr-defined]  # the exporter's memory lives as long as the view
    return np.frombuffer(raw, dtype=arr.dtype).reshape(arr.shape, order=order)


def _torch_to_ndarray(tensor: Any, what: str) -> np.ndarray:
    """View a PyTorch CPU tensor's memory as an ndarray (its dtype where NumPy has it, else flat bytes)."""
    if not tensor.is_cpu:
        raise TypeError(f"{what} is a tensor on {tensor.device}; tcoll moves CPU tensors only")
    if not tensor.is_contiguous():
        raise ValueError(f"{what} must be contiguous (got strides {tuple(tensor.stride())}); pass x.contiguous()")
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.numel() == 0:
        return np.empty(0, dtype=_U8)
    numpy_dtypes, uint8 = _torch_views()
    if tensor.dtype in numpy_dtypes:
        return tensor.numpy()
    # Viewing as uint8 works for every dtype, bfloat16 included, which
    # Tensor.numpy() refuses; it shares memory with the tensor.
    return (tensor if tensor.dim() else tensor.reshape(1)).view(uint8).numpy()


@functools.cache
def _torch_views() -> tuple[frozenset[Any], Any]:
    """The torch dtypes Tensor.numpy() takes, and torch.uint8 (asked only once a tensor came: torch is loaded)."""
    import torch

    return frozenset({torch.float16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
                      torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128}), torch.uint8


def exported(obj: Any) -> Any:
    """`obj` in a form that exports its memory through the buffer protocol, cheaply and with no copy.

    For the lean blocking send and receive, whose C calls take only such
    objects: NumPy arrays of NumPy's own dtypes and bytes-likes as they are; a
    C-contiguous array of another dtype (ml_dtypes' bfloat16) as its bytes; a
    contiguous CPU tensor as a NumPy view of its memory. Anything else comes
    back as it is, for the ordinary path, whose checks say what is wrong with it.
    """
    kind = type(obj)
    if kind is np.ndarray:  # NumPy cannot export another library's dtype (isbuiltin 2) nor datetimes
        dtype = obj.dtype
        if (dtype.isbuiltin == 2 or dtype.kind in "Mm") and not dtype.hasobject and obj.flags.c_contiguous:
            return obj.reshape(-1).view(_U8)
        return obj
    if kind.__module__.startswith("torch") and hasattr(obj, "is_cpu"):
        try:
            return _torch_to_ndarray(obj, "buffer")
        except (TypeError, ValueError, RuntimeError):  # not contiguous, sparse, a conjugate bit: the ordinary path
            return obj
    return obj


def is_torch(obj: Any) -> bool:
    """Whether `obj` is a PyTorch tensor (checked without importing torch)."""
    return type(obj).__module__.startswith("torch") and hasattr(obj, "dtype") and hasattr(obj, "device")


def as_array(obj: Any, *, writable: bool, what: str = "buffer") -> np.ndarray:
    """Return a typed ndarray view of a contiguous CPU buffer, keeping its shape.

    Unlike `as_bytes`, the dtype is kept: torch.bfloat16 becomes
    ml_dtypes.bfloat16, so reductions can run on the view in place.

    Args:
        obj: a NumPy array, a PyTorch CPU tensor, or a DLPack or buffer-protocol object.
        writable: require writable memory (the result lands in it).
        what: how to name the argument in error messages.

    Returns:
        An ndarray sharing memory with `obj`, C-contiguous.

    Raises:
        TypeError: not a buffer tcoll understands, or not on the CPU.
        ValueError: not C-contiguous, or read-only when writable is required.
    """
    if type(obj) is np.ndarray:
        arr = obj
    elif is_torch(obj):
        arr = _torch_typed(obj, what)
    elif isinstance(obj, np.generic):
        if writable:
            raise TypeError(f"{what} is a NumPy scalar, which cannot change in place; pass np.array([...])")
        arr = np.asarray(obj)
    else:
        arr = _to_ndarray(obj, what, writable)
    _check_usable(arr, writable, what, fortran_ok=False)
    return arr


def _check_usable(arr: np.ndarray, writable: bool, what: str, fortran_ok: bool) -> None:
    """Raise unless `arr` is contiguous (C order, or either order if `fortran_ok`), writable if asked, not object."""
    if not (arr.flags.c_contiguous or (fortran_ok and arr.flags.f_contiguous)):
        order = "" if fortran_ok else "C-"
        raise ValueError(
            f"{what} must be {order}contiguous (got strides {arr.strides} for shape {arr.shape}); "
            "pass np.ascontiguousarray(x) or x.contiguous()"
        )
    if writable and not arr.flags.writeable:
        raise ValueError(f"{what} is read-only and cannot receive data")
    if arr.dtype.hasobject:
        raise TypeError(f"{what} has dtype object; use the *_object functions for Python objects")


def _torch_typed(tensor: Any, what: str) -> np.ndarray:
    """View a PyTorch CPU tensor as an ndarray of the matching dtype and shape."""
    raw = _torch_to_ndarray(tensor, what)
    dtype = _numpy_dtype_of(tensor.dtype)
    if tensor.numel() == 0:
        return np.empty(tuple(tensor.shape), dtype=dtype)
    return raw.view(dtype).reshape(tuple(tensor.shape))


@functools.lru_cache(maxsize=None)
def _numpy_dtype_of(torch_dtype: Any) -> np.dtype:
    """The NumPy dtype of a torch dtype (cached: collectives on tensors ask on every call)."""
    import torch

    if torch_dtype == torch.bfloat16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(torch.empty(0, dtype=torch_dtype).numpy().dtype)
    except (TypeError, RuntimeError):
        raise TypeError(f"tensors of dtype {torch_dtype} are not supported") from None


def empty_like_kind(like: Any, shape: tuple[int, ...], dtype: np.dtype) -> tuple[Any, np.ndarray]:
    """Allocate an output of the same kind as `like` (NumPy array or torch tensor).

    Returns:
        (the object to give the user, a typed ndarray view of its memory).
    """
    if is_torch(like):
        import torch

        out = torch.empty(shape, dtype=like.dtype)
        return out, _torch_typed(out, "output")
    out = np.empty(shape, dtype=dtype)
    return out, out
