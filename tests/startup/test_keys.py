"""The job key on by default: where it comes from, the user's secret, the signed store, strangers refused."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from helpers.procs import free_port

from tcoll.errors import RendezvousError
from tcoll.startup import keys
from tcoll.store.memory import MemoryStore
from tcoll.store.signed import SignedStore
from tcoll.store.tcp import TCPStore

SRC = Path(__file__).resolve().parents[2] / "src"


def test_secret_is_made_private_and_reused(tmp_path: Path) -> None:
    path = str(tmp_path / "cfg" / "tcoll" / "secret")
    first = keys.user_secret(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(first) >= 32 and keys.user_secret(path) == first


def test_ranks_racing_to_make_the_secret_read_the_same_one(tmp_path: Path) -> None:
    path, results = str(tmp_path / "secret"), []
    threads = [threading.Thread(target=lambda: results.append(keys.user_secret(path))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 8 and len(set(results)) == 1
    assert os.listdir(tmp_path) == ["secret"]  # no temporary file left behind


def test_a_secret_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("x" * 64)
    path.chmod(0o644)
    with pytest.raises(RendezvousError, match="chmod 600"):
        keys.user_secret(str(path))


def test_derived_key_depends_on_secret_and_job() -> None:
    key = keys.derived_key(b"s" * 32, "run1", "h:1")
    assert key == keys.derived_key(b"s" * 32, "run1", "h:1")
    assert key != keys.derived_key(b"s" * 32, "run2", "h:1")
    assert key != keys.derived_key(b"t" * 32, "run1", "h:1")


def test_job_key_prefers_the_variable_then_derives(tmp_path: Path) -> None:
    env = {"TCOLL_SECRET_FILE": str(tmp_path / "secret")}
    derived = keys.job_key("run", "h:1", env)
    assert derived == keys.derived_key(keys.user_secret(env["TCOLL_SECRET_FILE"]), "run", "h:1")
    assert keys.job_key("run", "h:1", {**env, "TCOLL_AUTH_KEY": "mine"}) == "mine"


def test_an_empty_key_turns_authentication_off_with_a_warning() -> None:
    with pytest.warns(RuntimeWarning, match="authentication is off"):
        assert keys.job_key("run", "h:1", {"TCOLL_AUTH_KEY": ""}) == ""


def test_signed_store_round_trips_and_names_a_forged_value() -> None:
    inner = MemoryStore()
    store = SignedStore(inner, "k")
    store.set("card/0", b"addr")
    assert store.get("card/0") == b"addr" and store.multi_get(["card/0"]) == [b"addr"]
    assert inner.get("card/0") != b"addr"  # what a stranger reading the store sees is signed
    inner.set("card/1", b"forged by a stranger" + b"\0" * 32)
    with pytest.raises(RendezvousError, match="card/1.*signature"):
        store.get("card/1")
    with pytest.raises(RendezvousError, match="signature"):
        SignedStore(inner, "other key").get("card/0")
    assert store.compare_set("flag", b"", b"one") == b"one"
    assert store.compare_set("flag", b"one", b"two") == b"two"


def _run(body: str, env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (cwd / "job.py").write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, *args, "job.py"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=90, check=False)


def _clean_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TCOLL_", "MASTER_", "RANK", "WORLD_SIZE"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p)
    env["TCOLL_SECRET_FILE"] = str(tmp_path / "secret")
    return env


# Rank 0, inside the job, plays a stranger: a client that knows no key must be refused by the job's store.
_STRANGER = """
    import os, tcoll
    from tcoll.errors import RendezvousError
    from tcoll.store.tcp import TCPStore
    comm = tcoll.init()
    if comm.rank == 0:
        host, port = os.environ["TCOLL_MASTER"].rsplit(":", 1)
        try:
            TCPStore(host, int(port), timeout=5).get("card/0", 1)
            print("STRANGER GOT IN")
        except RendezvousError as exc:
            print("refused:", exc)
    comm.barrier()
    comm.close()
"""


@pytest.mark.timeout(120)
def test_tcoll_run_keys_every_job(tmp_path: Path) -> None:
    done = _run(_STRANGER, _clean_env(tmp_path), tmp_path, "-m", "tcoll", "run", "-n", "2")
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "authentication" in done.stdout and "GOT IN" not in done.stdout


@pytest.mark.timeout(120)
def test_a_job_without_a_launcher_key_derives_one(tmp_path: Path) -> None:
    """Ranks started by hand (as torchrun or srun would start them) share a key from the user's secret."""
    (tmp_path / "job.py").write_text(textwrap.dedent(_STRANGER.replace(
        'os.environ["TCOLL_MASTER"]', 'f"127.0.0.1:{os.environ[\'MASTER_PORT\']}"')))
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**_clean_env(tmp_path), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "job.py"], cwd=tmp_path, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outputs = [proc.communicate(timeout=90) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    assert "refused:" in outputs[0][0] and "GOT IN" not in outputs[0][0]
    assert stat.S_IMODE(os.stat(tmp_path / "secret").st_mode) == 0o600


def test_store_refuses_a_client_with_the_wrong_key() -> None:
    server = TCPStore.create("127.0.0.1", 0, is_server=True, timeout=5, auth_key="right")
    try:
        assert server.server is not None
        port = server.server.port
        with pytest.raises(RendezvousError, match="TCOLL_AUTH_KEY"):
            TCPStore("127.0.0.1", port, timeout=3, auth_key="wrong").get("x", 1)
    finally:
        server.close()
