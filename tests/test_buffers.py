"""buffers: every kind of user buffer becomes a view of the same memory, or a clear error before anything moves."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from tcoll.buffers import as_array, as_bytes, empty_like_kind, exported, is_torch


def test_numpy_views_share_memory() -> None:
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    raw = as_bytes(arr, writable=True)
    assert raw.dtype == np.uint8 and raw.size == 48 and np.shares_memory(raw, arr)
    typed = as_array(arr, writable=True)
    assert typed is arr


def test_fortran_order_is_bytes_but_not_a_typed_view() -> None:
    arr = np.asfortranarray(np.ones((3, 4)))
    assert as_bytes(arr, writable=True).size == 96
    with pytest.raises(ValueError, match="C-contiguous"):
        as_array(arr, writable=True)


@pytest.mark.parametrize("make", [lambda a: a[::2], lambda a: a[:, 1:]], ids=["rows", "columns"])
def test_non_contiguous_buffers_are_refused(make: object) -> None:
    arr = make(np.zeros((4, 6)))  # type: ignore[operator]
    with pytest.raises(ValueError, match="contiguous"):
        as_bytes(arr, writable=False, what="send buffer")


def test_read_only_memory_cannot_receive() -> None:
    with pytest.raises(ValueError, match="receive buffer is read-only"):
        as_bytes(b"abc", writable=True, what="receive buffer")
    view = as_bytes(b"abc", writable=False)
    assert view.tobytes() == b"abc"


def test_buffer_protocol_objects() -> None:
    data = bytearray(b"hello")
    view = as_bytes(memoryview(data), writable=True)
    view[0] = ord("j")
    assert data == bytearray(b"jello")


def test_object_arrays_and_strangers_are_type_errors() -> None:
    with pytest.raises(TypeError, match="object"):
        as_array(np.array([object()]), writable=False)
    with pytest.raises(TypeError, match="must be a NumPy array"):
        as_bytes(3.5, writable=False, what="x")
    with pytest.raises(TypeError, match="NumPy scalar"):
        as_array(np.float32(1), writable=True)
    assert as_array(np.float32(1), writable=False).shape == ()


def test_dlpack_objects_are_read_through_dlpack() -> None:
    class Exporter:
        def __init__(self, arr: np.ndarray) -> None:
            self.arr = arr

        def __dlpack__(self, **kwargs: object) -> object:
            return self.arr.__dlpack__(**kwargs)

        def __dlpack_device__(self) -> tuple[int, int]:
            return self.arr.__dlpack_device__()

    arr = np.arange(6, dtype=np.int16)
    assert np.shares_memory(as_bytes(Exporter(arr), writable=False), arr)


def test_torch_tensors_keep_their_dtype_and_memory() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    typed = as_array(tensor, writable=True)
    assert typed.dtype == np.dtype(ml_dtypes.bfloat16) and typed.shape == (2, 3)
    typed[0, 0] = 7
    assert float(tensor[0, 0]) == 7.0
    assert is_torch(tensor) and not is_torch(typed)
    with pytest.raises(ValueError, match="contiguous"):
        as_array(tensor.t(), writable=False)
    made, view = empty_like_kind(tensor, (4,), typed.dtype)
    assert isinstance(made, torch.Tensor) and made.dtype == torch.bfloat16 and view.shape == (4,)


class _LegacyExporter:
    """An object that speaks only the unversioned DLPack protocol (no max_version)."""

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr

    def __dlpack__(self, stream: object = None) -> object:
        return self.arr.__dlpack__()

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.arr.__dlpack_device__()


def test_legacy_dlpack_receive_targets_land_in_place() -> None:
    arr = np.zeros((3, 4), dtype=np.float32)
    view = as_bytes(_LegacyExporter(arr), writable=True)
    view[:] = 1
    assert np.shares_memory(view, arr) and (arr.view(np.uint8) == 1).all()
    typed = as_array(_LegacyExporter(arr), writable=True)
    typed[...] = 5
    assert typed.shape == (3, 4) and (arr == 5).all()
    fortran = np.asfortranarray(np.zeros((3, 2)))
    as_bytes(_LegacyExporter(fortran), writable=True)[:8] = 255
    assert np.isnan(fortran[0, 0])  # the first 8 bytes in memory, in place
    versioned = np.arange(4.0)
    versioned.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        as_bytes(versioned, writable=True)  # a read-only NumPy array stays read-only


def legacy_receive(comm: Any) -> bool:
    target = np.zeros(5)
    if comm.rank == 0:
        comm.send(np.arange(5.0), 1)
    else:
        comm.recv(_LegacyExporter(target), 0)
        assert (target == np.arange(5.0)).all()
    return True


@pytest.mark.timeout(30)
def test_legacy_dlpack_receive_through_a_communicator() -> None:
    import tcoll

    assert tcoll.spawn(legacy_receive, 2, threads=True, timeout=30) == [True, True]


def _exports(view: Any) -> bool:
    try:
        memoryview(view)
        return True
    except (TypeError, ValueError):
        return False


def test_exported_views_share_memory_and_export_it() -> None:
    """What the lean send and receive pass to their C calls: the same memory, with the buffer protocol."""
    plain = np.arange(6, dtype=np.float32)
    assert exported(plain) is plain and exported(b"ab") == b"ab"
    for arr in [np.arange(6).astype(ml_dtypes.bfloat16), np.array(1.5, dtype=ml_dtypes.bfloat16)]:
        view = exported(arr)
        assert _exports(view) and np.shares_memory(view, arr) and view.nbytes == arr.nbytes
        assert bytes(view) == arr.tobytes()
    for arr in [np.zeros(2, dtype="datetime64[s]"), np.zeros(2, dtype="timedelta64[ms]")]:
        view = exported(arr)
        assert _exports(view) and np.shares_memory(view, arr) and view.nbytes == arr.nbytes
    objects = np.zeros(2, dtype=[("a", object), ("b", "i4")])
    assert exported(objects) is objects  # the ordinary path refuses it by name
    fortran = np.asfortranarray(np.ones((3, 4), dtype=ml_dtypes.bfloat16))
    assert exported(fortran) is fortran  # left to the ordinary path, which copies its bytes in order


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_exported_tensors_share_memory_and_odd_ones_are_left_as_they_are() -> None:
    torch = pytest.importorskip("torch")
    for tensor in [torch.arange(6, dtype=torch.float32), torch.arange(6).to(torch.bfloat16),
                   torch.ones(3, requires_grad=True), torch.zeros(0), torch.tensor([True, False])]:
        view = exported(tensor)
        assert _exports(view) and view.nbytes == tensor.nbytes
        assert bytes(view) == bytes(tensor.detach().view(torch.uint8).numpy())
        if tensor.numel():
            assert view.ctypes.data == tensor.data_ptr()
    sparse = torch.ones(2, 2).to_sparse_csr()
    for odd in [torch.arange(6.0)[::2], torch.tensor([1 + 2j]).conj(), sparse, torch.ones(2).to_sparse()]:
        assert exported(odd) is odd  # not contiguous, a lazy conjugate, sparse: the ordinary path's checks
