"""Module-level functions (`tcoll.all_reduce(x)`, ...) acting on the default communicator.

Each one calls the Communicator method of the same name on
`tcoll.default_communicator()`, the communicator of the first `tcoll.init()`
of this process. Their arguments and results are the method's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .algos.registry import names
from .comm.communicator import Communicator
from .ops import Op
from .p2p.work import Work
from .startup.init import default_communicator

__all__ = [
    "algorithms", "send", "recv", "isend", "irecv", "all_reduce", "reduce", "broadcast", "all_gather", "gather",
    "scatter", "reduce_scatter", "all_to_all", "barrier", "all_gatherv", "gatherv", "scatterv", "all_to_allv",
    "reduce_scatterv", "broadcast_object", "all_gather_object", "gather_object", "scatter_object",
    "send_object", "recv_object", "split", "group", "dup",
    "scan", "exscan", "scan_object", "exscan_object", "all_to_all_object", "sendrecv", "sendrecv_replace",
    "sendrecv_object", "probe", "iprobe", "isend_object", "irecv_object",
]


def algorithms(collective: str) -> list[str]:
    """The names that `algorithm=` accepts for `collective` (besides "auto").

    Raises:
        ValueError: an unknown collective.
    """
    return names(collective)


def send(buf: Any, dst: int, tag: int = 0, timeout: float | None = None) -> None:
    """send on the default communicator (see Communicator.send)."""
    return default_communicator().send(buf, dst, tag, timeout)


def recv(buf: Any, src: int, tag: int = 0, timeout: float | None = None) -> Any:
    """recv on the default communicator (see Communicator.recv)."""
    return default_communicator().recv(buf, src, tag, timeout)


def isend(buf: Any, dst: int, tag: int = 0) -> Work:
    """isend on the default communicator (see Communicator.isend)."""
    return default_communicator().isend(buf, dst, tag)


def irecv(buf: Any, src: int, tag: int = 0) -> Work:
    """irecv on the default communicator (see Communicator.irecv)."""
    return default_communicator().irecv(buf, src, tag)


def all_reduce(x: Any, op: str | Op = "sum", *, algorithm: str = "auto", async_op: bool = False) -> Any:
    """all_reduce on the default communicator (see Communicator.all_reduce)."""
    return default_communicator().all_reduce(x, op, algorithm=algorithm, async_op=async_op)


def reduce(x: Any, root: int = 0, op: str | Op = "sum", *, algorithm: str = "auto", async_op: bool = False) -> Any:
    """reduce on the default communicator (see Communicator.reduce)."""
    return default_communicator().reduce(x, root, op, algorithm=algorithm, async_op=async_op)


def broadcast(x: Any, root: int = 0, *, algorithm: str = "auto", async_op: bool = False) -> Any:
    """broadcast on the default communicator (see Communicator.broadcast)."""
    return default_communicator().broadcast(x, root, algorithm=algorithm, async_op=async_op)


def all_gather(x: Any, out: Any = None, *, algorithm: str = "auto", async_op: bool = False) -> Any:
    """all_gather on the default communicator (see Communicator.all_gather)."""
    return default_communicator().all_gather(x, out, algorithm=algorithm, async_op=async_op)


def gather(x: Any, root: int = 0, out: Any = None, *, algorithm: str = "auto", async_op: bool = False) -> Any:
    """gather on the default communicator (see Communicator.gather)."""
    return default_communicator().gather(x, root, out, algorithm=algorithm, async_op=async_op)


def scatter(chunks: Any, root: int = 0, out: Any = None, *, algorithm: str = "auto", async_op: bool = False) -> Any:
    """scatter on the default communicator (see Communicator.scatter)."""
    return default_communicator().scatter(chunks, root, out, algorithm=algorithm, async_op=async_op)


def reduce_scatter(x: Any, op: str | Op = "sum", out: Any = None, *, algorithm: str = "auto",
                   async_op: bool = False) -> Any:
    """reduce_scatter on the default communicator (see Communicator.reduce_scatter)."""
    return default_communicator().reduce_scatter(x, op, out, algorithm=algorithm, async_op=async_op)


def all_to_all(x: Any, out: Any = None, *, algorithm: str = "auto", async_op: bool = False) -> Any:
    """all_to_all on the default communicator (see Communicator.all_to_all)."""
    return default_communicator().all_to_all(x, out, algorithm=algorithm, async_op=async_op)


def barrier(*, algorithm: str = "auto", async_op: bool = False) -> Any:
    """barrier on the default communicator (see Communicator.barrier)."""
    return default_communicator().barrier(algorithm=algorithm, async_op=async_op)


def all_gatherv(x: Any, *, algorithm: str = "auto", async_op: bool = False) -> Any:
    """all_gatherv on the default communicator (see Communicator.all_gatherv)."""
    return default_communicator().all_gatherv(x, algorithm=algorithm, async_op=async_op)


def gatherv(x: Any, root: int = 0, *, algorithm: str = "auto", async_op: bool = False) -> Any:
    """gatherv on the default communicator (see Communicator.gatherv)."""
    return default_communicator().gatherv(x, root, algorithm=algorithm, async_op=async_op)


def scatterv(chunks: Any, root: int = 0, *, algorithm: str = "auto", async_op: bool = False) -> Any:
    """scatterv on the default communicator (see Communicator.scatterv)."""
    return default_communicator().scatterv(chunks, root, algorithm=algorithm, async_op=async_op)


def all_to_allv(chunks: Any, *, algorithm: str = "auto", async_op: bool = False) -> Any:
    """all_to_allv on the default communicator (see Communicator.all_to_allv)."""
    return default_communicator().all_to_allv(chunks, algorithm=algorithm, async_op=async_op)


def reduce_scatterv(x: Any, counts: Sequence[int], op: str | Op = "sum", out: Any = None, *, algorithm: str = "auto",
                    async_op: bool = False) -> Any:
    """reduce_scatterv on the default communicator (see Communicator.reduce_scatterv)."""
    return default_communicator().reduce_scatterv(x, counts, op, out, algorithm=algorithm, async_op=async_op)


def broadcast_object(obj: Any, root: int = 0, *, async_op: bool = False) -> Any:
    """broadcast_object on the default communicator (see Communicator.broadcast_object)."""
    return default_communicator().broadcast_object(obj, root, async_op=async_op)


def all_gather_object(obj: Any, *, async_op: bool = False) -> Any:
    """all_gather_object on the default communicator (see Communicator.all_gather_object)."""
    return default_communicator().all_gather_object(obj, async_op=async_op)


def gather_object(obj: Any, root: int = 0, *, async_op: bool = False) -> Any:
    """gather_object on the default communicator (see Communicator.gather_object)."""
    return default_communicator().gather_object(obj, root, async_op=async_op)


def scatter_object(objs: Sequence[Any] | None, root: int = 0, *, async_op: bool = False) -> Any:
    """scatter_object on the default communicator (see Communicator.scatter_object)."""
    return default_communicator().scatter_object(objs, root, async_op=async_op)


def send_object(obj: Any, dst: int, tag: int = 0) -> None:
    """send_object on the default communicator (see Communicator.send_object)."""
    return default_communicator().send_object(obj, dst, tag)


def recv_object(src: int, tag: int = 0) -> Any:
    """recv_object on the default communicator (see Communicator.recv_object)."""
    return default_communicator().recv_object(src, tag)


def split(color: int | None, key: int | None = None) -> Communicator | None:
    """split on the default communicator (see Communicator.split)."""
    return default_communicator().split(color, key)


def group(ranks: Sequence[int]) -> Communicator | None:
    """group on the default communicator (see Communicator.group)."""
    return default_communicator().group(ranks)


def dup() -> Communicator:
    """dup on the default communicator (see Communicator.dup)."""
    return default_communicator().dup()


# -- what MPI users reach for (tcoll.comm.prefix, pairs, parcels) ----------------------------------


def scan(x: Any, op: str | Op = "sum", *, algorithm: str = "auto", async_op: bool = False) -> Any:
    """scan on the default communicator (see Communicator.scan)."""
    return default_communicator().scan(x, op, algorithm=algorithm, async_op=async_op)


def exscan(x: Any, op: str | Op = "sum", *, algorithm: str = "auto", async_op: bool = False) -> Any:
    """exscan on the default communicator (see Communicator.exscan)."""
    return default_communicator().exscan(x, op, algorithm=algorithm, async_op=async_op)


def scan_object(obj: Any, op: Any = "sum", *, async_op: bool = False) -> Any:
    """scan_object on the default communicator (see Communicator.scan_object)."""
    return default_communicator().scan_object(obj, op, async_op=async_op)


def exscan_object(obj: Any, op: Any = "sum", *, async_op: bool = False) -> Any:
    """exscan_object on the default communicator (see Communicator.exscan_object)."""
    return default_communicator().exscan_object(obj, op, async_op=async_op)


def all_to_all_object(objs: Sequence[Any], *, async_op: bool = False) -> Any:
    """all_to_all_object on the default communicator (see Communicator.all_to_all_object)."""
    return default_communicator().all_to_all_object(objs, async_op=async_op)


def sendrecv(sendbuf: Any, dst: int, recvbuf: Any, src: int, sendtag: int = 0, recvtag: int = 0,
             async_op: bool = False) -> Any:
    """sendrecv on the default communicator (see Communicator.sendrecv)."""
    return default_communicator().sendrecv(sendbuf, dst, recvbuf, src, sendtag, recvtag, async_op)


def sendrecv_replace(buf: Any, dst: int, src: int, sendtag: int = 0, recvtag: int = 0,
                     async_op: bool = False) -> Any:
    """sendrecv_replace on the default communicator (see Communicator.sendrecv_replace)."""
    return default_communicator().sendrecv_replace(buf, dst, src, sendtag, recvtag, async_op)


def sendrecv_object(obj: Any, dst: int, src: int, sendtag: int = 0, recvtag: int = 0,
                    async_op: bool = False) -> Any:
    """sendrecv_object on the default communicator (see Communicator.sendrecv_object)."""
    return default_communicator().sendrecv_object(obj, dst, src, sendtag, recvtag, async_op)


def probe(src: int = -1, tag: int = -1, timeout: float | None = None) -> Any:
    """probe on the default communicator (see Communicator.probe)."""
    return default_communicator().probe(src, tag, timeout)


def iprobe(src: int = -1, tag: int = -1) -> Any:
    """iprobe on the default communicator (see Communicator.iprobe)."""
    return default_communicator().iprobe(src, tag)


def isend_object(obj: Any, dst: int, tag: int = 0) -> Work:
    """isend_object on the default communicator (see Communicator.isend_object)."""
    return default_communicator().isend_object(obj, dst, tag)


def irecv_object(src: int, tag: int = 0) -> Work:
    """irecv_object on the default communicator (see Communicator.irecv_object)."""
    return default_communicator().irecv_object(src, tag)
