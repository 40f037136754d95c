"""The data-movement collectives of a Communicator: all_gather, gather, scatter, all_to_all.

They follow the pattern of `tcoll.collectives`: check the arguments, copy
this rank's own block where it belongs, choose an algorithm and run it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import meta
from .algos.registry import lookup
from .buffers import as_array
from .collectives import CollectiveMethods
from .errors import MismatchError
from .schedule import Algorithm

__all__ = ["MovementMethods"]


class MovementMethods(CollectiveMethods):
    """Mixed into Communicator: the collectives that move data without reducing it."""

    def all_gather(self, x: Any, out: Any = None, *, algorithm: str = "auto", async_op: bool = False) -> Any:
        """Gather every rank's `x` on every rank.

        Args:
            x: a contiguous NumPy array or PyTorch CPU tensor (same shape and dtype on every rank).
            out: where to write the result, shape (size, *x.shape); allocated if None.
            algorithm: "auto", or one of tcoll.algorithms("all_gather").
            async_op: return a Work instead of waiting.

        Returns:
            The array of shape (size, *x.shape) whose row r is rank r's x.

        Raises:
            ValueError: out has the wrong shape or dtype; x not contiguous.
            TypeError: x or out is not a buffer.
        """
        arr = as_array(x, writable=False, what="all_gather input")
        user_out, out_flat = self._output(x, arr, out, (self.size, *arr.shape), "all_gather")
        count = arr.size
        info = self._choose("all_gather", algorithm, arr.nbytes, blocking=not async_op)
        if info.direct:  # it copies this rank's block too, piece by piece, from cache
            self._run_direct(info, out_flat, [count] * self.size, source=arr)
            return user_out
        out_flat[self.rank * count:(self.rank + 1) * count] = arr.reshape(-1)
        team = self._team()

        def body() -> Algorithm:
            yield from info.run(team, out_flat, [count] * team.size)
            return user_out

        return self._run(team, "all_gather", info, body(), arr.nbytes, async_op)

    def gather(self, x: Any, root: int = 0, out: Any = None, *, algorithm: str = "auto",
               async_op: bool = False) -> Any:
        """Gather every rank's `x` on `root`.

        Args:
            x: a contiguous NumPy array or PyTorch CPU tensor (same shape and dtype on every rank).
            root: the rank that gets the result.
            out: on root, where to write the result, shape (size, *x.shape); ignored elsewhere.
            algorithm: "auto", or one of tcoll.algorithms("gather").
            async_op: return a Work instead of waiting.

        Returns:
            On root the array of shape (size, *x.shape); None on the other ranks.

        Raises:
            ValueError: root out of range; out has the wrong shape or dtype.
            TypeError: x or out is not a buffer.
        """
        self._check_root(root)
        arr = as_array(x, writable=False, what="gather input")
        send = arr.reshape(-1)
        count = arr.size
        user_out, out_flat = None, None
        if self.rank == root:
            user_out, out_flat = self._output(x, arr, out, (self.size, *arr.shape), "gather")
            out_flat[root * count:(root + 1) * count] = send
        info = self._choose("gather", algorithm, arr.nbytes, blocking=not async_op)
        if info.direct:
            self._run_direct(info, send, out_flat, [count] * self.size, root)
            return user_out
        team = self._team()

        def body() -> Algorithm:
            yield from info.run(team, send, out_flat, [count] * team.size, root)
            return user_out

        return self._run(team, "gather", info, body(), arr.nbytes, async_op)

    def scatter(self, chunks: Any, root: int = 0, out: Any = None, *, algorithm: str = "auto",
                async_op: bool = False) -> Any:
        """Send chunk r of `root` to rank r.

        The ranks other than root learn the chunk's shape and dtype from root
        (a small broadcast comes first), so they need not pass `out`.

        Args:
            chunks: on root, an array of shape (size, ...) or a list of `size`
                arrays of one shape and dtype; ignored on the other ranks.
            root: the rank that holds the chunks.
            out: where to write this rank's chunk; allocated if None.
            algorithm: "auto", or one of tcoll.algorithms("scatter").
            async_op: return a Work instead of waiting.

        Returns:
            This rank's chunk.

        Raises:
            ValueError: root out of range; wrong number of chunks; chunks differ in shape
                or dtype; out does not match the chunk.
            MismatchError: (raised by wait) out does not match the chunk root sends.
        """
        self._check_root(root)
        send, like = (self._stack_chunks(chunks) if self.rank == root else (None, None))
        if algorithm != "auto":  # an unknown name fails here, before anything is sent
            self._choose("scatter", algorithm, 0, blocking=not async_op)
        described = np.zeros(meta.META_BYTES, dtype=np.uint8)
        if send is not None:
            described[:] = meta.encode(like)
        if not async_op and self._direct_capable():
            return self._scatter_blocking(send, described, root, out, algorithm)
        team = self._team()

        def body() -> Algorithm:
            yield from lookup("broadcast", "binomial").run(team, described, root)
            kind, dtype, shape = meta.decode(described)
            user_out, out_flat = self._scatter_output(out, kind, dtype, shape)
            count = out_flat.size
            # Chosen only now, from root's description, so that every rank makes the same choice.
            info = self._choose("scatter", algorithm, out_flat.nbytes)
            if send is not None:
                out_flat[:] = send[root * count:(root + 1) * count]
            yield from info.run(team.phase(1), send, out_flat, [count] * team.size, root)
            return user_out

        nbytes = 0 if send is None else send.nbytes // self.size
        return self._run(team, "scatter", algorithm, body(), nbytes, async_op)

    def _scatter_blocking(self, send: np.ndarray | None, described: np.ndarray, root: int, out: Any,
                          algorithm: str) -> Any:
        """scatter on one host, blocking: root's description goes through the arena, then the chunks."""
        self._run_direct(lookup("broadcast", "shm"), described, root)
        kind, dtype, shape = meta.decode(described)
        user_out, out_flat = self._scatter_output(out, kind, dtype, shape)
        count = out_flat.size
        info = self._choose("scatter", algorithm, out_flat.nbytes, blocking=True)
        if send is not None:
            out_flat[:] = send[root * count:(root + 1) * count]
        if info.direct:
            self._run_direct(info, send, out_flat, [count] * self.size, root)
            return user_out
        team = self._team()
        body = info.run(team, send, out_flat, [count] * self.size, root)
        self._run(team, "scatter", info, body, out_flat.nbytes, False)
        return user_out

    def _scatter_output(self, out: Any, kind: str, dtype: np.dtype, shape: tuple[int, ...]) -> tuple[Any, np.ndarray]:
        """The output of scatter for the chunk root described: the user's (checked) or a new one."""
        if out is None:
            user_out, view = meta.allocate(kind, dtype, shape)
            return user_out, view.reshape(-1)
        view = as_array(out, writable=True, what="scatter out")
        if view.shape != shape or view.dtype != dtype:
            raise MismatchError(f"scatter: the root sends chunks of shape {shape} and dtype {dtype}, "
                                f"but out has shape {view.shape} and dtype {view.dtype}")
        return out, view.reshape(-1)

    def all_to_all(self, x: Any, out: Any = None, *, algorithm: str = "auto", async_op: bool = False) -> Any:
        """Send part j of `x` to rank j; receive part i of every rank i.

        Args:
            x: a contiguous array of shape (size, ...).
            out: where to write what arrives, shape x.shape; allocated if None.
            algorithm: "auto", or one of tcoll.algorithms("all_to_all").
            async_op: return a Work instead of waiting.

        Returns:
            The array whose row i came from rank i.

        Raises:
            ValueError: x.shape[0] != size; out has the wrong shape or dtype.
        """
        arr = as_array(x, writable=False, what="all_to_all input")
        if arr.ndim == 0 or arr.shape[0] != self.size:
            raise ValueError(f"all_to_all needs x of shape ({self.size}, ...): one part per rank; got {arr.shape}")
        user_out, out_flat = self._output(x, arr, out, arr.shape, "all_to_all")
        send = arr.reshape(-1)
        count = send.size // self.size
        mine = slice(self.rank * count, (self.rank + 1) * count)
        out_flat[mine] = send[mine]
        info = self._choose("all_to_all", algorithm, send.nbytes, blocking=not async_op)
        if info.direct:
            self._run_direct(info, send, out_flat, [count] * self.size, [count] * self.size)
            return user_out
        team = self._team()
        counts = [count] * self.size

        def body() -> Algorithm:
            yield from info.run(team, send, out_flat, counts, counts)
            return user_out

        return self._run(team, "all_to_all", info, body(), send.nbytes, async_op)

    def _stack_chunks(self, chunks: Any) -> tuple[np.ndarray, Any]:
        """Root's chunks as one flat array (a list is stacked), and one chunk to make outputs like."""
        if isinstance(chunks, (list, tuple)):
            if len(chunks) != self.size:
                raise ValueError(f"scatter needs {self.size} chunks, one per rank; got {len(chunks)}")
            views = [as_array(c, writable=False, what=f"scatter chunk {i}") for i, c in enumerate(chunks)]
            first = views[0]
            for i, view in enumerate(views):
                if view.shape != first.shape or view.dtype != first.dtype:
                    raise ValueError(f"scatter chunks must share shape and dtype: chunk 0 is {first.shape} "
                                     f"{first.dtype}, chunk {i} is {view.shape} {view.dtype}")
            stacked = np.stack(views) if views else np.empty(0)
            return stacked.reshape(-1), chunks[0]
        arr = as_array(chunks, writable=False, what="scatter chunks")
        if arr.ndim == 0 or arr.shape[0] != self.size:
            raise ValueError(f"scatter needs chunks of shape ({self.size}, ...) on the root; got {arr.shape}")
        return arr.reshape(-1), chunks[0]

