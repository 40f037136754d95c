"""Tests of the rendezvous stores: one contract, every implementation, then each one's specifics."""

from __future__ import annotations

import builtins
import datetime
import json
import multiprocessing
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from helpers.procs import free_port

from tcoll.errors import RendezvousError, TimeoutError
from tcoll.store import FileStore, MemoryStore, PrefixStore, Store, TCPStore, TCPStoreServer, TorchStore
from tcoll.store import tcp as tcp_module
from tcoll.store.wire import MAGIC, NONCE, Op, encode, send_frame

# Every test here may start threads (servers, ranks) or processes: none may hang the suite.
pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leftovers")]

# -- helpers ---------------------------------------------------------------------------




def _wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


class FakeTorchStore:
    """Mimics the methods and quirks of torch.distributed.Store (used when torch is absent)."""

    def __init__(self) -> None:
        self._inner = MemoryStore(timeout=30)

    def set(self, key: str, value: bytes | str) -> None:
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        return self._inner.get(key)

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        if not self._inner.check([key]) and expected != b"":
            return expected  # torch's answer for a missing key
        return self._inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        try:
            self._inner.wait(keys, timeout.total_seconds())
        except TimeoutError:
            raise RuntimeError("Wait timeout") from None

    def delete_key(self, key: str) -> bool:
        return self._inner.delete(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()


Factory = Callable[[], Store]
KINDS = ["memory", "file", "tcp", "prefix", "torch-adapter"]


@pytest.fixture(params=KINDS)
def handles(request: pytest.FixtureRequest, tmp_path) -> Iterator[Factory]:
    """A factory of handles on one store of each kind; every handle is closed afterwards."""
    made: list[Store] = []
    server = None
    kind = request.param
    if kind == "memory":
        shared = MemoryStore(timeout=10)
        make: Factory = lambda: shared  # noqa: E731
    elif kind == "file":
        make = lambda: FileStore(tmp_path / "store", timeout=10)  # noqa: E731
    elif kind == "tcp":
        server = TCPStoreServer("127.0.0.1", 0)
        make = lambda: TCPStore("127.0.0.1", server.port, timeout=10)  # noqa: E731
    elif kind == "prefix":
        base = MemoryStore(timeout=10)
        made.append(base)
        make = lambda: base.prefix("job").prefix("x")  # noqa: E731
    else:
        fake = FakeTorchStore()
        make = lambda: TorchStore(fake, timeout=10, address="torch://fake")  # noqa: E731

    def factory() -> Store:
        store = make()
        made.append(store)
        return store

    yield factory
    for store in made:
        store.close()
    if server is not None:
        server.close()


@pytest.fixture
def store(handles: Factory) -> Store:
    return handles()


# -- the contract, for every implementation ----------------------------------------------


def test_set_get_roundtrip(store: Store) -> None:
    store.set("a", b"\x00\xffbinary")
    store.set("empty", b"")
    store.set("text", "héllo")  # str values are accepted and stored as UTF-8
    assert store.get("a") == b"\x00\xffbinary"
    assert store.get("empty") == b""
    assert store.get("text") == "héllo".encode()
    store.set("a", b"again")
    assert store.get("a") == b"again"


def test_visible_through_another_handle(handles: Factory) -> None:
    one, two = handles(), handles()
    one.set("k", b"v")
    assert two.get("k", timeout=5) == b"v"
    assert two.add("n", 2) == 2 and one.add("n", 3) == 5


def test_get_blocks_until_another_thread_sets(handles: Factory) -> None:
    reader, writer = handles(), handles()
    got: list[bytes] = []
    thread = threading.Thread(target=lambda: got.append(reader.get("late", timeout=30)))
    thread.start()
    thread.join(0.05)
    assert thread.is_alive() and not got  # still waiting: the key does not exist yet
    writer.set("late", b"here")
    thread.join(30)
    assert got == [b"here"]


def test_add_is_atomic_under_threads(handles: Factory) -> None:
    clients = [handles(), handles()]
    seen: list[list[int]] = [[] for _ in range(8)]

    def work(i: int) -> None:
        client = clients[i % 2]  # threads share clients: each must be thread-safe
        seen[i] = [client.add("counter", 1) for _ in range(1000)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert clients[0].get("counter") == b"8000"
    assert sorted(v for s in seen for v in s) == list(range(1, 8001))  # every new value returned exactly once


def test_add_semantics(store: Store) -> None:
    assert store.add("c", 0) == 0
    assert store.add("c", 7) == 7
    assert store.add("c", -10) == -3
    assert store.get("c") == b"-3"
    store.set("word", b"abc")
    with pytest.raises(ValueError, match="word"):
        store.add("word", 1)


def test_compare_set_semantics(store: Store) -> None:
    assert store.compare_set("k", b"", b"first") == b"first"  # missing + expected b"" -> set
    assert store.compare_set("k", b"wrong", b"x") == b"first"  # mismatch -> current value
    assert store.compare_set("k", b"first", b"second") == b"second"
    assert store.get("k") == b"second"
    assert store.compare_set("absent", b"something", b"x") == b""  # missing, expected not b"" -> stays missing
    assert not store.check(["absent"])
    store.set("e", b"")
    assert store.compare_set("e", b"", b"filled") == b"filled"


def test_wait_timeout_names_missing_keys(store: Store) -> None:
    store.set("k1", b"1")
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        store.wait(["k1", "k2", "k3"], timeout=0.2)
    assert time.monotonic() - start < 5
    assert info.value.missing_keys == ["k2", "k3"]
    message = str(info.value)
    assert "k2'" in message and "k3'" in message and "k1'" not in message
    assert store.address in message


def test_get_timeout_names_key_and_address(store: Store) -> None:
    with pytest.raises(TimeoutError) as info:
        store.get("nobody", timeout=0.1)
    assert info.value.missing_keys == ["nobody"]
    assert "nobody" in str(info.value) and store.address in str(info.value)
    assert isinstance(info.value, builtins.TimeoutError)  # code catching the builtin still works


def test_check_and_wait(store: Store) -> None:
    assert store.check([])
    assert not store.check(["a"])
    store.set("a", b"1")
    store.set("b", b"2")
    assert store.check(["a", "b"])
    store.wait(["a", "b"], timeout=1)
    assert store.multi_get(["b", "a"], timeout=1) == [b"2", b"1"]


def test_delete_and_num_keys(store: Store) -> None:
    base = store.num_keys()  # a prefix view counts the whole store, torch counts its own keys
    store.set("x", b"1")
    store.set("y", b"2")
    assert store.num_keys() == base + 2
    assert store.delete("x") is True
    assert store.delete("x") is False
    assert not store.check(["x"]) and store.check(["y"])
    assert store.num_keys() == base + 1


def test_prefix_isolation(store: Store) -> None:
    a, b = store.prefix("a"), store.prefix("b")
    a.set("k", b"in a")
    b.set("k", b"in b")
    assert a.get("k") == b"in a" and b.get("k") == b"in b"
    assert store.get("a/k") == b"in a"
    assert not store.check(["k"])
    nested = a.prefix("inner")
    nested.set("z", b"deep")
    assert store.get("a/inner/z") == b"deep" and a.get("inner/z") == b"deep"
    assert nested.add("n", 4) == 4 and store.get("a/inner/n") == b"4"
    with pytest.raises(TimeoutError) as info:
        nested.wait(["z", "missing"], timeout=0.1)
    assert info.value.missing_keys == ["missing"]  # in the view's own terms
    assert "a/inner/missing" in str(info.value)  # the message shows the full key
    nested.close()  # a view does not close its store
    assert store.get("a/k") == b"in a"


def test_closed_store_refuses(handles: Factory) -> None:
    store = handles()
    if isinstance(store, PrefixStore):
        pytest.skip("views do not own their store")
    with store:
        store.set("k", b"v")
    with pytest.raises(RendezvousError):
        store.set("k", b"v")
    store.close()  # idempotent


def test_timeouts_validated(store: Store) -> None:
    with pytest.raises(ValueError):
        store.get("k", timeout=-1)
    with pytest.raises(ValueError):
        MemoryStore(timeout=0)


# -- several processes -------------------------------------------------------------------


def _add_worker(kind: str, where: str, index: int, count: int) -> None:
    """Child process: add `count` times and publish the values it got back."""
    if kind == "tcp":
        host, port = where.rsplit(":", 1)
        store: Store = TCPStore(host, int(port), timeout=30)
    else:
        store = FileStore(where, timeout=30)
    with store:
        got = [store.add("counter", 1) for _ in range(count)]
        store.set(f"seen/{index}", json.dumps(got).encode())


@pytest.mark.parametrize("kind", ["tcp", "file"])
def test_processes_race_add(kind: str, tmp_path) -> None:
    nprocs, count = 4, 300
    server = TCPStoreServer("127.0.0.1", 0) if kind == "tcp" else None
    where = f"127.0.0.1:{server.port}" if server else str(tmp_path / "store")
    store: Store = TCPStore("127.0.0.1", server.port, timeout=60) if server else FileStore(where, timeout=60)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_add_worker, args=(kind, where, i, count)) for i in range(nprocs)]
    try:
        for p in procs:
            p.start()
        seen = [json.loads(v) for v in store.multi_get([f"seen/{i}" for i in range(nprocs)], timeout=90)]
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        assert store.get("counter") == str(nprocs * count).encode()
        assert sorted(v for s in seen for v in s) == list(range(1, nprocs * count + 1))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        store.close()
        if server:
            server.close()


# -- TCP specifics -----------------------------------------------------------------------


def test_client_connects_before_server_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    refused = threading.Event()
    real_connect = socket.create_connection

    def connect_and_report(*args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return real_connect(*args, **kwargs)
        except OSError:
            refused.set()
            raise

    monkeypatch.setattr(tcp_module.socket, "create_connection", connect_and_report)
    clients: list[TCPStore] = []
    thread = threading.Thread(target=lambda: clients.append(TCPStore("127.0.0.1", port, timeout=30)))
    thread.start()
    assert refused.wait(30)  # the client tried, found nobody, and keeps trying
    server = TCPStoreServer("127.0.0.1", port)
    try:
        thread.join(30)
        assert clients, "the client did not connect once the server came up"
        clients[0].set("k", b"v")
        assert clients[0].get("k") == b"v"
    finally:
        for client in clients:
            client.close()
        server.close()


def test_unreachable_store_names_address() -> None:
    port = free_port()
    start = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        TCPStore("127.0.0.1", port, timeout=0.3)
    assert time.monotonic() - start < 5
    assert f"tcp://127.0.0.1:{port}" in str(info.value)
    assert info.value.address == f"tcp://127.0.0.1:{port}"


def test_server_close_releases_port_and_drops_clients() -> None:
    server = TCPStoreServer("127.0.0.1", 0)
    port = server.port
    client = TCPStore("127.0.0.1", port, timeout=10)
    client.set("k", b"v")
    server.close()
    server.close()  # idempotent
    with pytest.raises(RendezvousError):
        client.get("k", timeout=1)
    client.close()
    again = TCPStoreServer("127.0.0.1", port)  # the port is free again at once
    again.close()


def test_port_in_use_is_a_clear_error() -> None:
    with TCPStoreServer("127.0.0.1", 0) as server:
        with pytest.raises(RendezvousError, match="already in use") as info:
            TCPStore.create("127.0.0.1", server.port, is_server=True, timeout=5)
        assert str(server.port) in info.value.address


def test_create_hosts_or_joins() -> None:
    host = TCPStore.create("127.0.0.1", 0, is_server=True, timeout=10)
    assert host.server is not None
    port = host.server.port
    guest = TCPStore.create("127.0.0.1", port, is_server=False, timeout=10)
    try:
        guest.set("hello", b"1")
        assert host.get("hello") == b"1"
        assert guest.address == f"tcp://127.0.0.1:{port}"
    finally:
        guest.close()
        host.close()  # stops the server it hosts
    with pytest.raises(RendezvousError):
        TCPStore("127.0.0.1", port, timeout=0.2)


def test_blocked_get_does_not_stall_other_threads_on_same_client() -> None:
    with TCPStore.create("127.0.0.1", 0, is_server=True, timeout=10) as client:
        got: list[bytes] = []
        thread = threading.Thread(target=lambda: got.append(client.get("key", timeout=30)))
        thread.start()
        thread.join(0.05)
        client.set("key", b"from another thread")  # must not queue behind the blocked get
        thread.join(30)
        assert got == [b"from another thread"]


def test_close_interrupts_a_blocked_request() -> None:
    server = TCPStoreServer("127.0.0.1", 0)
    client = TCPStore("127.0.0.1", server.port, timeout=30)
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            client.get("never", timeout=30)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            errors.append(exc)

    thread = threading.Thread(target=blocked)
    thread.start()
    _wait_until(lambda: len(server._table.waiters) == 1)
    client.close()
    thread.join(10)
    server.close()
    assert not thread.is_alive() and isinstance(errors[0], RendezvousError)


def test_server_survives_bad_and_vanishing_clients() -> None:
    with TCPStoreServer("127.0.0.1", 0) as server:
        # A client that sends half a frame and leaves.
        with socket.create_connection(("127.0.0.1", server.port)) as raw:
            raw.sendall(struct.pack("<I", 100) + b"abc")
        # A client that is not speaking our protocol at all.
        with socket.create_connection(("127.0.0.1", server.port)) as raw:
            raw.sendall(b"GET / HTTP/1.1\r\n\r\n")
        # A real client whose blocking request outlives it.
        with socket.create_connection(("127.0.0.1", server.port)) as raw:
            send_frame(raw, encode(Op.HELLO, MAGIC, bytes(NONCE)))
            raw.recv(64)
            send_frame(raw, encode(Op.AUTH, b""))
            raw.recv(64)
            send_frame(raw, encode(Op.WAIT, struct.pack("<d", 60.0), b"never"))
            _wait_until(lambda: b"never" in server._table.waiters)
        _wait_until(lambda: not server._table.waiters)  # the server noticed and dropped the request
        with TCPStore("127.0.0.1", server.port, timeout=10) as client:
            client.set("still", b"fine")
            assert client.get("still") == b"fine"
        _wait_until(lambda: server.stats()["connections"] == 0)


def test_auth_key() -> None:
    with TCPStoreServer("127.0.0.1", 0, auth_key="s3cret") as server:
        with TCPStore("127.0.0.1", server.port, timeout=5, auth_key=b"s3cret") as good:
            good.set("k", b"v")
        with pytest.raises(RendezvousError, match="refused"):
            TCPStore("127.0.0.1", server.port, timeout=5, auth_key="wrong")
        with pytest.raises(RendezvousError, match="refused"):
            TCPStore("127.0.0.1", server.port, timeout=5)


def test_not_a_tcoll_store() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def impostor() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(struct.pack("<I", 5) + b"hello")  # a frame, but no valid reply inside

    thread = threading.Thread(target=impostor)
    thread.start()
    try:
        with pytest.raises(RendezvousError, match="not a tcoll store"):
            TCPStore("127.0.0.1", port, timeout=5)
    finally:
        thread.join(10)
        listener.close()


def test_server_binds_exactly_the_host_given() -> None:
    with TCPStoreServer("127.0.0.1", 0) as server:
        assert server._listener.getsockname()[0] == "127.0.0.1"
        assert server.address == f"tcp://127.0.0.1:{server.port}"


# -- file specifics ----------------------------------------------------------------------


def test_file_store_is_deleted_by_its_last_client(tmp_path) -> None:
    path = tmp_path / "store"
    one = FileStore(path, timeout=5)
    two = FileStore(path, timeout=5)
    one.set("k", b"v")
    one.close()
    assert path.exists() and two.get("k") == b"v"
    two.close()
    assert not path.exists()
    with FileStore(path, timeout=5) as fresh:  # the next job starts clean
        assert fresh.num_keys() == 0 and not fresh.check(["k"])


def test_file_store_cuts_a_torn_record(tmp_path) -> None:
    path = tmp_path / "store"
    with FileStore(path, timeout=5) as store:
        store.set("good", b"1")
        with open(path, "ab") as f:  # a writer died half-way through a record
            f.write(struct.pack("<BIII", 1, 4, 100, 0) + b"torn")
        store.set("after", b"2")
        with FileStore(path, timeout=5) as other:
            assert other.multi_get(["good", "after"]) == [b"1", b"2"]
            assert not other.check(["torn"])


def test_file_store_detects_corruption(tmp_path) -> None:
    path = tmp_path / "store"
    with FileStore(path, timeout=5) as store:
        store.set("key", b"value")
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        with pytest.raises(RendezvousError, match="corrupt"):
            FileStore(path, timeout=5)


# -- torch ---------------------------------------------------------------------------------


def test_torch_store_with_real_torch() -> None:
    torch_dist = pytest.importorskip("torch.distributed")
    raw = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = TorchStore(raw, timeout=5)
    store.set("k", b"v")
    assert store.get("k") == b"v"
    assert store.add("n", 3) == 3
    assert store.compare_set("absent", b"x", b"y") == b""
    with pytest.raises(TimeoutError) as info:
        store.wait(["k", "missing"], timeout=0.2)
    assert info.value.missing_keys == ["missing"]
    assert store.delete("k")
    store.close()


def test_torch_store_wait_ends_when_keys_land_as_torch_times_out() -> None:
    """A key set between torch's wait timeout and the adapter's look is a finished wait, not an error."""

    class LateKeyStore(FakeTorchStore):
        def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
            for key in keys:
                self._inner.set(key, b"late")  # lands just as torch gives up
            raise RuntimeError("wait timeout after 500ms")

    store = TorchStore(LateKeyStore(), timeout=5)
    store.wait(["segment/0"], timeout=0.5)
    assert store.get("segment/0", timeout=0.5) == b"late"


def test_torch_store_is_lazy() -> None:
    import subprocess
    import sys

    code = "import sys, tcoll.store; assert 'torch' not in sys.modules; tcoll.store.TorchStore"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)

