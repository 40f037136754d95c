"""All-reduce of sparse COO tensors for the torch backend, as gloo does it: gather, concatenate, coalesce.

Each rank sends one byte block: a header (its tensor's sparse and dense
dimensions, dtype and shape), then its coalesced indices and values. One
`all_gatherv` brings every rank's block to every rank, and each rank builds
the sum from the concatenated entries and coalesces it. Every rank checks
every rank's header, so ranks that disagree on the shape, the dtype or the
split into sparse and dense dimensions all raise the same ValueError.
"""

from __future__ import annotations

import zlib

import torch

from ..comm.communicator import Communicator

__all__ = ["all_reduce_sparse"]

_I64 = torch.int64


def _header(t: torch.Tensor) -> torch.Tensor:
    """[header length, sparse dims, dense dims, dtype code, *shape] as int64."""
    code = zlib.crc32(str(t.dtype).encode())
    fields = [t.sparse_dim(), t.dense_dim(), code, *t.shape]
    return torch.tensor([len(fields) + 1, *fields], dtype=_I64)


def all_reduce_sparse(comm: Communicator, t: torch.Tensor, op: str) -> None:
    """Sum the sparse COO tensor `t` over the ranks, in place (it ends up coalesced).

    Args:
        comm: the group's communicator.
        t: a sparse COO tensor (any sparse and dense dimensions, any dtype torch sums).
        op: the tcoll op name; only "sum" applies (as with gloo).

    Raises:
        ValueError: another op than SUM; ranks whose tensors differ in shape, dtype or dimensions
            (on every rank).
    """
    if op != "sum":
        raise ValueError(f"all_reduce of a sparse tensor supports ReduceOp.SUM only, not {op}")
    local = t.detach().coalesce()
    header = _header(t)
    indices = local.indices().to(_I64).contiguous()
    values = local.values().contiguous()
    block = torch.cat([header.view(torch.uint8), indices.reshape(-1).view(torch.uint8),
                       values.reshape(-1).view(torch.uint8)])
    parts = comm.all_gatherv(block)
    dense = values.shape[1:]
    entry_bytes = t.sparse_dim() * 8 + _numel(dense) * t.element_size()
    all_indices, all_values = [], []
    for r, part in enumerate(parts):
        theirs = part[:8 * int(part[:8].clone().view(_I64)[0])].clone().view(_I64)
        if not torch.equal(theirs, header):
            raise ValueError(f"all_reduce of a sparse tensor: rank {r}'s tensor {_text(theirs)} differs from "
                             f"rank {comm.rank}'s {_text(header)}")
        body = part[header.numel() * 8:]
        nnz = body.numel() // entry_bytes if entry_bytes else 0
        split = nnz * t.sparse_dim() * 8
        # clone: a view of another dtype needs an offset aligned to that dtype's size
        all_indices.append(body[:split].clone().view(_I64).view(t.sparse_dim(), nnz))
        all_values.append(body[split:].clone().view(t.dtype).view(nnz, *dense))
    total = torch.sparse_coo_tensor(torch.cat(all_indices, dim=1), torch.cat(all_values), t.shape).coalesce()
    with torch.no_grad():
        t.copy_(total)


def _numel(shape: torch.Size) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _text(header: torch.Tensor) -> str:
    _, sparse, dense, _, *shape = header.tolist()
    return f"(shape {tuple(shape)}, {sparse} sparse and {dense} dense dimensions, dtype code {header[3].item()})"
