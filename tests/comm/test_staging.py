"""CUDA buffers in the Communicator's calls, through host staging (tcoll.comm.staging).

The CUDA tests skip where torch sees no GPU; scripts/gpu_check.sh runs them on
one GPU that 2 and 4 ranks share. Every collective and send/recv, on float32,
bfloat16 and int64 tensors (and CuPy arrays where CuPy is installed), against
NumPy; a call queued behind a kernel still writing its input on a side stream,
with no synchronisation by the user; a mismatch raising MismatchError on every
rank. The tests that run everywhere check what decides staging and the
TCOLL_GPU setting.
"""

from __future__ import annotations

import inspect
import sys

import numpy as np
import pytest

import tcoll
from tcoll.comm import staging
from tcoll.env import Settings

try:
    import torch
except ImportError:  # pragma: no cover - torch is a test dependency
    torch = None

CUDA = torch is not None and torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device")


# -- everywhere: what decides staging ------------------------------------------------------------------


class CudaLike:
    """An object that exports device memory the way CuPy and Numba arrays do (never dereferenced here)."""

    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}


def test_on_device_is_decided_by_the_buffer_alone() -> None:
    assert not staging.on_device(np.zeros(3))
    assert not staging.on_device(None)
    assert staging.on_device(CudaLike())
    assert staging.on_device([np.zeros(1), CudaLike()])  # scatter's chunks: any one of them
    assert not staging.on_device([np.zeros(1), b"x"])
    if torch is not None:
        assert not staging.on_device(torch.zeros(2))
        assert not staging.on_device(torch.zeros(2, device="meta"))  # not CUDA: the CPU path's own error


def _cuda_like_without_cuda(comm: tcoll.Communicator) -> str:
    with pytest.raises(TypeError) as caught:
        comm.all_reduce(CudaLike())
    return str(caught.value)


@pytest.mark.timeout(60)
@pytest.mark.skipif(CUDA, reason="checks the message of a process without CUDA")
def test_a_cuda_array_without_cuda_is_refused_by_name() -> None:
    """A device array is refused by what it is (not the CPU path's "not a buffer"), saying how to stage it."""
    (message,) = tcoll.spawn(_cuda_like_without_cuda, 1, threads=True, timeout=60)
    assert "CUDA" in message and "buffer protocol" not in message


def test_every_staged_call_keeps_its_signature_and_names_real_arguments() -> None:
    class Staged(tcoll.Communicator):
        pass

    staging.install_once(Staged, "staging")
    for name, (reads, writes) in staging.STAGED.items():
        method = getattr(Staged, name)
        params = inspect.signature(method).parameters
        assert set(reads + writes) <= set(params), (name, reads, writes)
        assert method.__wrapped__ is getattr(tcoll.Communicator, name)


@pytest.mark.skipif(CUDA or "cupy" in sys.modules, reason="a process where a GPU may be in use")
def test_calls_are_not_wrapped_where_no_gpu_is_in_use() -> None:
    """Without a GPU, the calls are the CPU path itself: staging costs nothing there."""
    class Plain(tcoll.Communicator):
        pass

    staging.install_once(Plain, "auto")
    assert all(getattr(Plain, name) is getattr(tcoll.Communicator, name) for name in staging.STAGED)


def test_tcoll_gpu_setting() -> None:
    assert Settings.from_env({}).gpu == "auto"
    assert Settings.from_env({"TCOLL_GPU": "staging"}).gpu == "staging"
    assert Settings.from_env({"TCOLL_GPU": "nccl"}).gpu == "nccl"
    with pytest.raises(ValueError, match="TCOLL_GPU"):
        Settings.from_env({"TCOLL_GPU": "gpu"})


# -- on a GPU: every call against NumPy ---------------------------------------------------------------

DTYPES = ["float32", "bfloat16", "int64"]


def _data(rank: int, n: int, dtype: str, salt: int = 0) -> np.ndarray:
    """Rank `rank`'s input as float64 values every dtype holds exactly (small integers)."""
    return ((np.arange(n) * 7 + rank * 13 + salt) % 17 - 8).astype(np.float64)


def _dev(values: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.tensor(values, dtype=getattr(torch, dtype), device="cuda")


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy().astype(np.float64) if t.dtype != torch.int64 else t.cpu().numpy()


def _same(got: torch.Tensor, want: np.ndarray, what: str) -> None:
    assert got.is_cuda, f"{what}: came back on {got.device}"
    np.testing.assert_array_equal(_host(got), want, err_msg=what)


def every_call(comm: tcoll.Communicator, dtype: str) -> bool:
    """Every collective and point-to-point call on CUDA tensors of `dtype`, checked against NumPy."""
    r, p, n = comm.rank, comm.size, 6
    inputs = [_data(q, n, dtype) for q in range(p)]
    total = np.sum(inputs, axis=0)
    for async_op in (False, True):
        x = _dev(inputs[r], dtype)
        work = comm.all_reduce(x, async_op=async_op)
        if async_op:
            work.wait()
        _same(x, total, f"all_reduce async={async_op}")
    x = _dev(inputs[r], dtype)
    comm.all_reduce(x, op="max")
    _same(x, np.max(inputs, axis=0), "all_reduce max")
    memory = _dev(np.repeat(inputs[r], 2), dtype)
    strided = memory[::2]  # every other element of its memory
    assert not strided.is_contiguous()
    comm.all_reduce(strided)
    _same(strided, total, "all_reduce of a strided tensor")
    _same(memory[1::2], inputs[r], "the elements between a strided tensor's")
    x = _dev(inputs[r], dtype)
    comm.reduce(x, root=p - 1)
    _same(x, total if r == p - 1 else inputs[r], "reduce")
    x = _dev(inputs[r], dtype)
    comm.broadcast(x, root=0)
    _same(x, inputs[0], "broadcast")
    _same(comm.all_gather(_dev(inputs[r], dtype)), np.stack(inputs), "all_gather")
    out = _dev(np.zeros((p, n)), dtype)
    assert comm.all_gather(_dev(inputs[r], dtype), out=out) is out
    _same(out, np.stack(inputs), "all_gather out=")
    gathered = comm.gather(_dev(inputs[r], dtype), root=0)
    if r == 0:
        _same(gathered, np.stack(inputs), "gather")
    chunks = _dev(np.stack([_data(q, n, dtype, salt=3) for q in range(p)]), dtype) if r == 0 else None
    out = None if r == 0 else _dev(np.zeros(n), dtype)  # off root nothing says where a new chunk should live
    _same(comm.scatter(chunks, root=0, out=out), _data(r, n, dtype, salt=3), "scatter")
    bare = comm.scatter(chunks, root=0)
    if r != 0:  # ... so without out= it comes back in host memory (a CPU tensor: root's were tensors), as docs say
        assert isinstance(bare, torch.Tensor) and not bare.is_cuda, (type(bare), getattr(bare, "device", None))
        np.testing.assert_array_equal(_host(bare), _data(r, n, dtype, salt=3))
    rows = [[_data(src, n, dtype, salt=dst) for dst in range(p)] for src in range(p)]
    _same(comm.all_to_all(_dev(np.stack(rows[r]), dtype)), np.stack([rows[s][r] for s in range(p)]), "all_to_all")
    flat = np.concatenate([_data(q, 2 * p, dtype) for q in range(p)]).reshape(p, 2 * p)
    part = comm.reduce_scatter(_dev(flat[r].reshape(p, 2), dtype))
    _same(part.reshape(-1), flat.sum(axis=0).reshape(p, 2)[r], "reduce_scatter")
    x = _dev(inputs[r], dtype)
    comm.scan(x)
    _same(x, np.sum(inputs[: r + 1], axis=0), "scan")
    pieces = comm.all_gatherv(_dev(_data(r, r + 1, dtype), dtype))
    for q, piece in enumerate(pieces):
        _same(piece, _data(q, q + 1, dtype), f"all_gatherv from {q}")
    _point_to_point(comm, dtype)
    comm.barrier()
    return True


def _point_to_point(comm: tcoll.Communicator, dtype: str) -> None:
    """send/recv, isend/irecv and sendrecv around the ring, on CUDA tensors."""
    r, p, n = comm.rank, comm.size, 5
    right, left = (r + 1) % p, (r - 1) % p
    got = _dev(np.zeros(n), dtype)
    if r % 2 == 0:
        comm.send(_dev(_data(r, n, dtype), dtype), right, tag=1)
        comm.recv(got, left, tag=1)
    else:
        comm.recv(got, left, tag=1)
        comm.send(_dev(_data(r, n, dtype), dtype), right, tag=1)
    _same(got, _data(left, n, dtype), "send/recv")
    got = _dev(np.zeros(n), dtype)
    receive = comm.irecv(got, left, tag=2)
    sending = comm.isend(_dev(_data(r, n, dtype, 1), dtype), right, tag=2)
    assert receive.wait() is got
    sending.wait()
    _same(got, _data(left, n, dtype, 1), "isend/irecv")
    got = _dev(np.zeros(n), dtype)
    assert comm.sendrecv(_dev(_data(r, n, dtype, 2), dtype), right, got, left) is got
    _same(got, _data(left, n, dtype, 2), "sendrecv")


@needs_cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_call_on_cuda_tensors(size: int, dtype: str) -> None:
    """2 and 4 ranks sharing the GPU: every collective and send/recv gives NumPy's result, on the device."""
    assert tcoll.spawn(every_call, size, (dtype,), timeout=240) == [True] * size


def behind_a_kernel(comm: tcoll.Communicator) -> bool:
    """The input is written by a kernel still running on a side stream; the caller only orders its streams."""
    n = 1 << 20
    side = torch.cuda.Stream()
    x = torch.zeros(n, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time before the fill runs
        x.fill_(comm.rank + 1)
    torch.cuda.current_stream().wait_stream(side)  # stream order, as any CUDA program writes it
    comm.all_reduce(x)
    y = x * 2  # queued after the call on the same stream: sees the result
    want = comm.size * (comm.size + 1) / 2
    return bool((x == want).all().item()) and bool((y == 2 * want).all().item())


@needs_cuda
@pytest.mark.timeout(180)
@pytest.mark.parametrize("size", [2, 4])
def test_a_call_queued_behind_a_kernel_still_writing_its_input(size: int) -> None:
    assert tcoll.spawn(behind_a_kernel, size, timeout=150) == [True] * size


def mismatch(comm: tcoll.Communicator, what: str) -> str:
    n = 8 if what == "op" or comm.rank == 0 else 9
    op = "sum" if what == "size" or comm.rank == 0 else "max"
    try:
        comm.all_reduce(torch.ones(n, device="cuda"), op=op)
    except tcoll.MismatchError as exc:
        return type(exc).__name__
    return "no error"


@needs_cuda
@pytest.mark.timeout(180)
@pytest.mark.parametrize("what", ["op", "size"])
def test_a_mismatch_on_cuda_tensors_raises_on_every_rank(what: str) -> None:
    assert tcoll.spawn(mismatch, 2, (what,), timeout=150) == ["MismatchError"] * 2


def cupy_calls(comm: tcoll.Communicator) -> bool:
    import cupy

    x = cupy.full(5, comm.rank + 1, dtype=cupy.float32)
    comm.all_reduce(x)
    gathered = comm.all_gather(cupy.arange(3, dtype=cupy.int64) + comm.rank)
    want = np.stack([np.arange(3) + q for q in range(comm.size)])
    return (isinstance(gathered, cupy.ndarray) and bool((cupy.asnumpy(gathered) == want).all())
            and bool((x == comm.size * (comm.size + 1) / 2).all()))


@needs_cuda
@pytest.mark.timeout(180)
def test_cupy_arrays_on_cupys_current_stream() -> None:
    pytest.importorskip("cupy")
    assert tcoll.spawn(cupy_calls, 2, timeout=150) == [True, True]


def pooled(comm: tcoll.Communicator) -> list[int]:
    """Large staged calls go through the communicator's pinned shared memory, taken again call after call."""
    from tcoll.comm import staging_pool

    for i, nbytes in enumerate([256 << 10, 4 << 20, 256 << 10, 4 << 20, 4 << 20]):
        x = torch.full((nbytes // 4,), float(comm.rank + i), device="cuda")
        work = comm.all_reduce(x, async_op=i == 4)
        if i == 4:
            work.wait()
        y = x + 1  # queued after the copy back: it sees the result
        want = sum(q + i for q in range(comm.size))
        assert bool((x == want).all().item()) and bool((y == want + 1).all().item()), (i, nbytes)
    pool = staging_pool.pool_of(comm, torch)
    return sorted(b.capacity for b in pool._buffers if not b.busy)


@needs_cuda
@pytest.mark.timeout(180)
def test_large_staged_calls_reuse_the_pools_pinned_shared_memory() -> None:
    assert tcoll.spawn(pooled, 2, timeout=150) == [[256 << 10, 4 << 20]] * 2
