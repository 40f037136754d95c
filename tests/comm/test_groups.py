"""Sub-communicators: split (MPI_Comm_split semantics), group and dup, and their message spaces."""

from __future__ import annotations

import numpy as np
import pytest

import tcoll


def run_split_semantics(comm: tcoll.Communicator) -> dict:
    p, rank = comm.size, comm.rank
    color = None if rank == p - 1 and p > 2 else rank % 3
    key = (rank * 5) % 4  # ties between ranks: broken by parent rank
    sub = comm.split(color, key)
    if color is None:
        return {"none": sub is None}
    expected = sorted((r * 5 % 4, r) for r in range(p) if (r % 3 == color) and not (r == p - 1 and p > 2))
    members = [r for _, r in expected]
    x = np.array([rank], dtype=np.int64)
    got = sub.all_gather(x)[:, 0].tolist()
    nested = sub.split(0 if sub.rank % 2 == 0 else 1)
    nested_members = [m for i, m in enumerate(members) if i % 2 == sub.rank % 2]
    return {
        "size": sub.size == len(members),
        "rank": sub.rank == members.index(rank),
        "order": got == members,
        "world": sub.world_ranks == members,
        "nested": nested.all_gather(x)[:, 0].tolist() == nested_members,
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8])
def test_split_follows_mpi_comm_split(size: int) -> None:
    for report in tcoll.spawn(run_split_semantics, size, threads=True, timeout=100):
        assert all(report.values()), report


def run_group_and_dup(comm: tcoll.Communicator) -> None:
    p, rank = comm.size, comm.rank
    chosen = list(range(p - 1, -1, -2))  # every other rank, in reverse
    sub = comm.group(chosen)
    if rank in chosen:
        assert sub is not None and sub.rank == chosen.index(rank) and sub.size == len(chosen)
        assert sub.world_ranks == chosen
        # point-to-point inside the group speaks the group's ranks
        right = (sub.rank + 1) % sub.size
        left = (sub.rank - 1) % sub.size
        box = np.zeros(1, dtype=np.int64)
        sub.send(np.array([rank], dtype=np.int64), right, tag=5) if sub.size > 1 else None
        if sub.size > 1:
            sub.recv(box, left, tag=5)
            assert box[0] == chosen[left]
    else:
        assert sub is None
    twin = comm.dup()
    assert (twin.rank, twin.size) == (rank, p)
    # The same tag on the parent and on the dup: each message lands on its own communicator.
    if p > 1:
        peer = (rank + 1) % p
        a = comm.isend(np.array([1]), peer, tag=9)
        b = twin.isend(np.array([2]), peer, tag=9)
        from_twin = twin.recv(np.zeros(1, dtype=np.int64), (rank - 1) % p, tag=9)
        from_comm = comm.recv(np.zeros(1, dtype=np.int64), (rank - 1) % p, tag=9)
        a.wait()
        b.wait()
        assert from_twin[0] == 2 and from_comm[0] == 1
    twin.close()
    assert twin.closed and not comm.closed
    with pytest.raises(tcoll.TcollError, match="closed"):
        twin.barrier()
    comm.barrier()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 2, 4, 7])
def test_group_and_dup(size: int) -> None:
    tcoll.spawn(run_group_and_dup, size, threads=True, timeout=50)


def run_many_splits(comm: tcoll.Communicator) -> None:
    """Contexts stay distinct through many splits made from different parents."""
    subs = [comm]
    for i in range(6):
        parent = subs[i % len(subs)]
        sub = parent.split(parent.rank % 2)
        subs.append(sub)
    for sub in subs:
        x = np.ones(3, dtype=np.int64)
        works = [s.all_reduce(np.ones(3, dtype=np.int64), async_op=True) for s in subs]
        sub.all_reduce(x)
        assert (x == sub.size).all()
        for s, w in zip(subs, works):
            assert (w.wait(timeout=30) == s.size).all()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [3, 6])
def test_many_nested_splits_keep_their_messages_apart(size: int) -> None:
    tcoll.spawn(run_many_splits, size, threads=True, timeout=50)


def test_split_rejects_bad_colors() -> None:
    comm = tcoll.init()
    try:
        for color in (-1, 1.5, "a", True):
            with pytest.raises(ValueError):
                comm.split(color)
        with pytest.raises(ValueError):
            comm.group([0, 0])
        with pytest.raises(ValueError):
            comm.group([1])
    finally:
        comm.close()


# -- a bad argument on one rank: the call fails on every rank, and the next one is right -------------


def _said(call: object) -> str:
    try:
        call()  # type: ignore[operator]
        return "ok"
    except (tcoll.TcollError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


def _sum_after(comm: tcoll.Communicator) -> list[float]:
    x = np.full(2, comm.rank + 1.0)
    comm.all_reduce(x)
    return x.tolist()


def run_local_errors(comm: tcoll.Communicator, store_path: str) -> dict[str, list]:
    """split, group and create_group with a bad argument on rank 0 only; after each, a call all agree on."""
    from tcoll.store.file import FileStore

    comm.timeout = 30.0
    report = {}
    report["split"] = [_said(lambda: comm.split(-1 if comm.rank == 0 else 0)), _sum_after(comm)]
    report["group"] = [_said(lambda: comm.group([0, 0] if comm.rank == 0 else list(range(comm.size)))),
                       _sum_after(comm)]
    store = FileStore(store_path)
    members = [comm.size] if comm.rank == 0 else list(range(comm.size))  # rank 0 names a rank that is not
    report["create_group"] = [_said(lambda: comm.create_group(members, store, timeout=30.0)), _sum_after(comm)]
    store.close()
    sub = comm.split(0)  # and the ranks still agree on everything
    report["after"] = [sub.size, _sum_after(sub)]
    return report


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_bad_argument_on_one_rank_fails_the_call_on_every_rank(transport: str, tmp_path: object) -> None:
    size = 3
    want = [size * (size + 1) / 2] * 2
    reports = tcoll.spawn(run_local_errors, size, (str(tmp_path / "store"),), timeout=100,  # type: ignore[operator]
                          transport=transport)
    for rank, report in enumerate(reports):
        for name in ("split", "group", "create_group"):
            said, after = report[name]
            if rank == 0:
                assert said.startswith("ValueError"), (rank, name, said)
            else:
                assert said.startswith("PeerFailedError") and "rank 0" in said, (rank, name, said)
            assert after == want, (rank, name, report)
        assert report["after"] == [size, want], (rank, report)


def _after_close(comm: tcoll.Communicator) -> list[tuple[int, int, int]]:
    """Rank 0 closes a dup with a receive still posted on it; rank 1 then sends on the dup and makes calls
    on it that rank 0 never joins. What rank 0 keeps of the dup's contexts afterwards (nothing)."""
    dup = comm.dup()
    posted = dup.irecv(np.zeros(1), 1, tag=9) if comm.rank == 0 else None
    if comm.rank == 0:
        dup.close()
        with pytest.raises(tcoll.TcollError, match="closed"):
            posted.wait(5)
    comm.barrier()
    if comm.rank == 1:
        for tag in range(40):
            dup.send(np.full(8, tag), 0, tag=tag)
        dup.isend(np.zeros(1 << 20), 0, tag=99).wait(10)  # large: drained by rank 0, not left in the channel
        dup.close()
    comm.barrier()
    engine = comm.core.engine
    engine.poll()
    contexts = {dup.core.p2p_ctx, dup.core.dispatch.ctx}
    return [key for key in engine.matcher.unexpected if key[1] in contexts]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_what_comes_for_a_closed_communicator_is_not_kept(transport: str) -> None:
    assert tcoll.spawn(_after_close, 2, timeout=50, transport=transport) == [[], []]
