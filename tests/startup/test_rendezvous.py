"""Tests of the launchers' environment contracts and of the rank meeting."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from helpers.procs import free_port, on_threads

from tcoll.errors import RendezvousError, TimeoutError
from tcoll.startup import rendezvous
from tcoll.startup.rendezvous import (
    LaunchInfo,
    detect,
    exchange_cards,
    open_store,
    store_barrier,
    store_leave,
)
from tcoll.store import (
    FileStore,
    MemoryStore,
    PrefixStore,
    Store,
    TCPStore,
    TCPStoreServer,
)

# Every test here may start threads (servers, ranks) or processes: none may hang the suite.
pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leftovers")]

TCOLL = {
    "TCOLL_RANK": "3", "TCOLL_SIZE": "8", "TCOLL_LOCAL_RANK": "1", "TCOLL_LOCAL_SIZE": "2",
    "TCOLL_NODE_RANK": "1", "TCOLL_MASTER": "10.0.0.1:4000", "TCOLL_RUN_ID": "run42", "TCOLL_STORE_HOSTED": "1",
}  # fmt: skip
TORCHRUN = {
    "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
    "MASTER_ADDR": "node0", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "abc",
    "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_USE_AGENT_STORE": "True",
}  # fmt: skip
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
}  # fmt: skip
PMI = {"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"}
SLURM = {
    "SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
    "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_ID": "777", "SLURM_STEP_ID": "0",
}  # fmt: skip




# -- detect: each launcher ---------------------------------------------------------------


def test_no_launcher_is_a_world_of_one() -> None:
    info = detect({})
    assert (info.rank, info.size, info.local_rank, info.local_size, info.node_rank) == (0, 1, 0, 1, 0)
    assert info.source == "single" and info.master_addr == "" and info.master == ""
    assert not info.store_hosted and info.run_id


def test_tcoll_env() -> None:
    info = detect(TCOLL)
    assert (info.rank, info.size, info.local_rank, info.local_size, info.node_rank) == (3, 8, 1, 2, 1)
    assert (info.master_addr, info.master_port, info.master) == ("10.0.0.1", 4000, "10.0.0.1:4000")
    assert info.run_id == "run42" and info.store_hosted and info.source == "tcoll"
    assert not info.torch_agent_store


def test_tcoll_env_ipv6_master_and_not_hosted() -> None:
    info = detect({**TCOLL, "TCOLL_MASTER": "[::1]:5000", "TCOLL_STORE_HOSTED": "0"})
    assert (info.master_addr, info.master_port, info.master) == ("::1", 5000, "[::1]:5000")
    assert not info.store_hosted


def test_torchrun_env_with_agent_store() -> None:
    info = detect(TORCHRUN)
    assert (info.rank, info.size, info.local_rank, info.local_size, info.node_rank) == (5, 8, 1, 4, 1)
    assert (info.master_addr, info.master_port) == ("node0", 29400)
    assert info.source == "torchrun" and info.torch_agent_store and info.store_hosted
    assert info.attempt == 2 and info.run_id == "abc"


def test_torchrun_env_without_agent_store() -> None:
    env = {k: v for k, v in TORCHRUN.items() if not k.startswith("TORCHELASTIC")}
    info = detect(env)
    assert not info.torch_agent_store and not info.store_hosted and info.attempt == 0
    assert info.run_id == "torchrun-node0-29400"  # derived alike on every rank


def test_openmpi_env_on_one_node_defaults_to_loopback() -> None:
    info = detect(OPENMPI)
    assert (info.rank, info.size, info.local_rank, info.local_size) == (2, 4, 2, 4)
    assert (info.master_addr, info.master_port, info.source) == ("127.0.0.1", 29500, "openmpi")
    assert not info.store_hosted


def test_pmi_env() -> None:
    info = detect(PMI)
    assert (info.rank, info.size, info.local_rank, info.local_size, info.source) == (1, 3, 1, 3, "pmi")
    assert info.master == "127.0.0.1:29500"


def test_slurm_env() -> None:
    info = detect({**SLURM, "TCOLL_MASTER": "node7:29600"})
    assert (info.rank, info.size, info.local_rank, info.local_size, info.node_rank) == (6, 8, 2, 4, 1)
    assert info.source == "slurm" and info.run_id == "slurm-777.0"
    assert (info.master_addr, info.master_port) == ("node7", 29600)


def test_slurm_uneven_tasks_per_node() -> None:
    env = {**SLURM, "SLURM_PROCID": "8", "SLURM_NTASKS": "9", "SLURM_LOCALID": "0", "SLURM_NODEID": "2"}
    info = detect({**env, "SLURM_TASKS_PER_NODE": "4(x2),1", "MASTER_ADDR": "n0"})
    assert info.local_size == 1 and info.master == "n0:29500"


def test_slurm_batch_script_without_srun_is_one_process() -> None:
    env = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    assert detect(env).source == "single"


def test_multi_node_without_master_asks_for_tcoll_master() -> None:
    with pytest.raises(RendezvousError, match="TCOLL_MASTER=host:port"):
        detect(SLURM)
    with pytest.raises(RendezvousError, match="TCOLL_MASTER"):
        detect({**OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"})


def test_master_addr_for_mpi_jobs() -> None:
    info = detect({**OPENMPI, "MASTER_ADDR": "head", "MASTER_PORT": "1234"})
    assert info.master == "head:1234" and not info.torch_agent_store


# -- detect: precedence ------------------------------------------------------------------


def test_precedence_between_launchers() -> None:
    env = {**SLURM, **PMI, **OPENMPI, **TORCHRUN, **TCOLL}
    order = [("tcoll", TCOLL), ("torchrun", TORCHRUN), ("openmpi", OPENMPI), ("pmi", PMI), ("slurm", SLURM)]
    for source, variables in order:
        assert detect({**env, "MASTER_ADDR": "m"}).source == source
        env = {k: v for k, v in env.items() if k not in variables}
    assert detect(env).source == "single"


def test_tcoll_master_wins_over_master_addr() -> None:
    info = detect({**TORCHRUN, "TCOLL_MASTER": "h:1"})
    assert info.master == "h:1" and not info.torch_agent_store and not info.store_hosted


def test_explicit_arguments_win() -> None:
    info = detect(TCOLL, rank=1, size=2)
    assert (info.rank, info.size, info.source) == (1, 2, "explicit")
    assert (info.local_rank, info.local_size) == (1, 2)  # the launcher's layout described another world
    assert info.master == "10.0.0.1:4000"  # the address still comes from the environment
    info = detect(TCOLL, rank=0)
    assert (info.rank, info.size, info.source) == (0, 8, "tcoll")


def test_explicit_without_environment() -> None:
    info = detect({}, rank=2, size=4)
    assert (info.rank, info.size, info.source, info.master) == (2, 4, "explicit", "127.0.0.1:29500")
    single = detect({}, rank=0, size=1)
    assert single.master == "" and single.source == "explicit"


def test_init_methods() -> None:
    info = detect({}, init_method="tcp://10.1.2.3:2345?rank=1&world_size=3")
    assert (info.rank, info.size, info.master, info.source) == (1, 3, "10.1.2.3:2345", "explicit")
    assert not info.store_hosted
    info = detect({}, init_method="file:///tmp/job.store", rank=0, size=2)
    assert info.master_addr == "" and info.run_id.startswith("file-")
    info = detect(TCOLL, init_method="env://")
    assert info.source == "tcoll"
    hosted = detect(TCOLL, init_method="tcp://10.0.0.1:4000")  # the launcher's own store
    assert hosted.store_hosted and hosted.source == "tcoll"
    other = detect(TCOLL, init_method="tcp://10.0.0.2:4000")
    assert not other.store_hosted


# -- detect: bad input -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "kwargs", "names"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, {}, "RANK='x'"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, {}, "RANK=2"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, {}, "RANK='-1'"),
        ({"TCOLL_RANK": "0", "TCOLL_SIZE": "0"}, {}, "TCOLL_SIZE=0"),
        ({"TCOLL_RANK": "0"}, {}, "TCOLL_SIZE"),
        ({**PMI, "MPI_LOCALRANKID": "5"}, {}, "MPI_LOCALRANKID=5"),
        ({**SLURM, "SLURM_TASKS_PER_NODE": "four"}, {}, "SLURM_TASKS_PER_NODE"),
        ({**TORCHRUN, "MASTER_PORT": "http"}, {}, "MASTER_PORT"),
        ({"TCOLL_RANK": "0", "TCOLL_SIZE": "2", "TCOLL_MASTER": "host:notaport"}, {}, "TCOLL_MASTER"),
        ({}, {"rank": 4, "size": 4}, "rank=4"),
        ({}, {"rank": -1, "size": 4}, "rank=-1"),
        ({}, {"rank": "0", "size": 4}, "rank must be an integer"),
        ({}, {"rank": 1}, "rank and size must be given together"),
        ({}, {"init_method": "tcp://h:1"}, "needs rank and size"),
        ({}, {"init_method": "tcp://hostonly", "rank": 0, "size": 2}, "host:port"),
        ({}, {"init_method": "tcp://h:1?rank=a&world_size=2"}, "rank='a'"),
        ({}, {"init_method": "udp://h:1", "rank": 0, "size": 1}, "env://"),
    ],
)
def test_bad_input_names_the_variable(env: dict[str, str], kwargs: dict[str, Any], names: str) -> None:
    with pytest.raises(ValueError, match=names.replace("(", r"\(").replace("?", r"\?")):
        detect(env, **kwargs)


def test_auth_key_is_read_but_not_shown() -> None:
    info = detect({**TCOLL, "TCOLL_AUTH_KEY": "hush"})
    assert info.auth_key == "hush" and "hush" not in repr(info)


# -- open_store --------------------------------------------------------------------------


def _info(**changes: Any) -> LaunchInfo:
    base = LaunchInfo(0, 1, 0, 1, 0, "", 0, "test", False, "explicit")
    for key, value in changes.items():
        setattr(base, key, value)
    return base


def test_open_store_kinds(tmp_path) -> None:
    with open_store(_info(), None, 5) as store:
        assert isinstance(store, MemoryStore)
    with open_store(_info(size=2), f"file://{tmp_path}/s", 5) as store:
        assert isinstance(store, FileStore) and store.address == f"file://{tmp_path}/s"
    with pytest.raises(RendezvousError):
        open_store(_info(size=2), None, 5)


def test_open_store_rank0_hosts_unless_hosted() -> None:
    port = free_port()
    with open_store(_info(size=2, master_addr="127.0.0.1", master_port=port), None, 10) as host:
        assert isinstance(host, TCPStore) and host.server is not None
        with open_store(_info(rank=1, size=2, master_addr="127.0.0.1", master_port=port), None, 10) as guest:
            assert guest.server is None
            guest.set("x", b"1")
            assert host.get("x") == b"1"
    with TCPStoreServer("127.0.0.1", 0) as launcher_store:
        info = _info(size=2, master_addr="127.0.0.1", master_port=launcher_store.port, store_hosted=True)
        with open_store(info, None, 10) as rank0:
            assert rank0.server is None  # the launcher already serves it


def test_open_store_torch_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    from tcoll.store import torch_store

    base = MemoryStore()
    calls: list[tuple[str, int]] = []

    def fake_connect(cls: type, host: str, port: int, timeout: float) -> Store:
        calls.append((host, port))
        return base

    monkeypatch.setattr(torch_store.TorchStore, "connect_tcp", classmethod(fake_connect))
    info = detect(TORCHRUN)
    store = open_store(info, None, 5)
    assert calls == [("node0", 29400)] and isinstance(store, PrefixStore)
    store.set("k", b"v")
    assert base.get("tcoll/attempt2/k") == b"v"  # each restart meets under fresh keys
    store.close()
    with pytest.raises(RendezvousError):
        base.get("tcoll/attempt2/k")  # the view owned the store and closed it


# -- exchange_cards and store_barrier ---------------------------------------------------------


def test_exchange_cards_memory() -> None:
    store = MemoryStore(timeout=10)
    results = on_threads(4, lambda r: exchange_cards(store, r, 4, {"rank": r, "host": f"h{r}"}, 10))
    expected = [{"rank": r, "host": f"h{r}"} for r in range(4)]
    assert results == [expected] * 4


def test_exchange_cards_over_tcp_with_rank0_hosting() -> None:
    port = free_port()

    def rank_main(rank: int) -> list[dict]:
        info = detect({}, rank=rank, size=4, init_method=f"tcp://127.0.0.1:{port}")
        with open_store(info, f"tcp://127.0.0.1:{port}", 20) as store:
            cards = exchange_cards(store.prefix("world1"), rank, 4, {"rank": rank}, 20)
            store_barrier(store, rank, 4, "done", 20)
            store_leave(store, rank, 4, 20)  # rank 0's server outlives the others' last requests
            return cards

    assert on_threads(4, rank_main) == [[{"rank": r} for r in range(4)]] * 4


@pytest.mark.parametrize("kind", ["memory", "tcp"])
def test_exchange_cards_names_missing_ranks(kind: str) -> None:
    store: Store = MemoryStore() if kind == "memory" else TCPStore.create("127.0.0.1", 0, is_server=True, timeout=10)
    view = store.prefix("tcoll/world1")  # as tcoll.world uses it
    try:
        errors = on_threads(2, lambda r: _expect_rendezvous_error(view, r))
        for error in errors:
            assert error.missing == [2, 3] and error.address == store.address
            assert f"rendezvous at {store.address} timed out after 0.5s: ranks [2, 3] of 4 did not arrive" in str(error)
    finally:
        store.close()


def _expect_rendezvous_error(store: Store, rank: int) -> RendezvousError:
    with pytest.raises(RendezvousError) as info:
        exchange_cards(store, rank, 4, {"rank": rank}, 0.5)
    return info.value


def test_store_barrier_is_reusable() -> None:
    store = MemoryStore(timeout=10)
    order: list[tuple[int, int]] = []
    lock = threading.Lock()

    def rank_main(rank: int) -> None:
        for round_ in range(3):
            with lock:
                order.append((round_, rank))
            store_barrier(store, rank, 4, "b", 10)

    on_threads(4, rank_main)
    rounds = [r for r, _ in order]
    assert rounds == sorted(rounds)  # nobody entered round k+1 before all finished round k


def test_store_barrier_names_missing_ranks() -> None:
    store = MemoryStore()
    store_barrier_args = (store, 1, 3, "lonely", 0.2)
    with pytest.raises(TimeoutError) as info:
        store_barrier(*store_barrier_args)
    assert info.value.peers == [0, 2]
    assert "ranks [0, 2] of 3 did not arrive" in str(info.value) and "memory://" in str(info.value)


def test_store_leave_host_names_ranks_still_there() -> None:
    store = MemoryStore()
    store_leave(store, 1, 3, 1)
    with pytest.raises(TimeoutError) as info:
        store_leave(store, 0, 3, 0.2)
    assert info.value.peers == [2] and "ranks [2] of 3 still use it" in str(info.value)
    store_leave(store, 2, 3, 1)
    store_leave(store, 0, 3, 1)


def test_module_exports() -> None:
    from tcoll import store as store_pkg

    assert not hasattr(store_pkg, "open_store")  # the store package is below startup: it names no rendezvous
    assert set(rendezvous.__all__) >= {"LaunchInfo", "detect", "open_store", "exchange_cards", "store_barrier"}

