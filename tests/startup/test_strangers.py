"""Strangers in the job: another local user who reaches the store the ranks meet through.

Each test plays the stranger against a real rank: a forged record in torchrun's store (which checks no
key) must end the rank's init with a named error before it maps or dials anything the record names, and
the store tcoll hosts under mpiexec must refuse a keyless client from its first connection.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tcoll.p2p.hosts import host_identity
from tcoll.segments import SHM_DIR
from tcoll.store.base import PrefixStore
from tcoll.store.signed import SignedStore

TESTS = Path(__file__).resolve().parents[1]
SRC = TESTS.parent / "src"
RING = 1 << 20
VICTIM = bytes(range(256)) * (2 * RING // 256)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TCOLL_", "MASTER_", "TORCHELASTIC_", "PMI", "OMPI_", "SLURM_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    env["PYTHONPATH"] = str(SRC)
    env.update(extra)
    return env


def _start_time() -> int:
    with open(f"/proc/{os.getpid()}/stat", "rb") as handle:
        return int(handle.read().rpartition(b")")[2].split()[19])


_RANK0 = """
import json, sys
import tcoll
try:
    comm = tcoll.init()
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
    sys.exit(3)
comm.close()
print(json.dumps({"error": None}))
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("forged", ["segment", "card"])
def test_a_forged_record_in_torchruns_store_is_refused(tmp_path: Path, forged: str) -> None:
    """Rank 1 publishes honestly; a stranger overwrites one of its records, unsigned; rank 0 maps nothing."""
    dist = pytest.importorskip("torch.distributed")
    import datetime

    from tcoll.store.torch_store import TorchStore

    key = secrets.token_hex(16)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    raw = TorchStore(master, 30)
    world = "tcoll/attempt0/tcoll/world1"  # rank 0's first world of attempt 0 of this torchrun job
    honest = SignedStore(PrefixStore(raw, "tcoll/attempt0"), key).prefix("tcoll/world1")  # as rank 1 signs
    me = {"rank": 1, "host": host_identity(), "pid": os.getpid(), "pidns": os.readlink("/proc/self/ns/pid"),
          "start_time": _start_time()}
    honest.set("alive/1", json.dumps(me).encode())
    honest.set("card/1", json.dumps(dict(me, shm={"dir": SHM_DIR})).encode())
    victim = tmp_path / "victim"  # stands for the file the stranger wants rank 0 to map and write
    victim.write_bytes(VICTIM)
    stranger = {"path": str(victim), "name": None, "ring": RING}
    if forged == "segment":  # where rank 1's shared memory is, as the issue's stranger overwrote it
        raw.set(f"{world}/shm/segment/1", json.dumps(stranger).encode())
    else:  # rank 1's whole card, naming a transport of the stranger's choosing
        raw.set(f"{world}/card/1", json.dumps(dict(me, tcp={"addr": ["127.0.0.1", 9]})).encode())
    env = _clean_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master.port), TORCHELASTIC_USE_AGENT_STORE="True",
                     TORCHELASTIC_RUN_ID=f"stranger-{secrets.token_hex(4)}", TCOLL_AUTH_KEY=key,
                     TCOLL_TRANSPORT="shm", TCOLL_SHM_RING=str(RING), TCOLL_TIMEOUT="15")
    done = subprocess.run([sys.executable, "-c", _RANK0], env=env, capture_output=True, text=True, timeout=60,
                          start_new_session=True)
    assert done.returncode == 3, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["error"] == "RendezvousError", result
    assert f"{forged}/1" in result["message"] and "signature" in result["message"], result
    assert victim.read_bytes() == VICTIM  # nothing of rank 0's was written where the stranger pointed


# -- mpiexec, meeting through MPI ------------------------------------------------------------------------

_MPI_RANK = """
import json, os, subprocess, sys
from tcoll.store import tcp as tcp_store

made = []
create = tcp_store.TCPStore.create  # bound to the class: records the store each rank opens

def recording(cls, *args, **kwargs):
    store = create(*args, **kwargs)
    made.append(store)
    return store

tcp_store.TCPStore.create = classmethod(recording)
import tcoll

comm = tcoll.init()
if comm.rank == 0:
    store = made[0]
    stranger = subprocess.run([sys.executable, sys.argv[1], store.host, str(store.port)], capture_output=True,
                              text=True, timeout=60, env=json.loads(sys.argv[3]))
    tried = json.loads(stranger.stdout.strip().splitlines()[-1]) if stranger.returncode == 0 else stranger.stderr
    found = {"stranger": tried, "written": store.check(["stranger"]), "server_keyed": bool(store.server._auth_key)}
    with open(os.path.join(sys.argv[2], "rank0.json"), "w") as out:
        json.dump(found, out)
comm.barrier()
comm.close()
"""

_STRANGER = """
import json, sys
from tcoll.errors import RendezvousError
from tcoll.store import TCPStore

host, port = sys.argv[1], int(sys.argv[2])
tried = {}
for who, key in (("keyless", None), ("another key", "not the job's key")):
    try:
        store = TCPStore(host, port, timeout=5, auth_key=key, connect_timeout=5)
    except RendezvousError as exc:
        tried[who] = "refused: " + str(exc)
        continue
    store.set("stranger", b"was here")
    tried[who] = f"accepted: read {store.num_keys()} keys and wrote one"
    store.close()
print(json.dumps(tried))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", [{"TCOLL_TRANSPORT": "mpi"}, {"TCOLL_INTERHOST": "mpi"}],
                         ids=["transport", "interhost"])
def test_the_store_met_through_mpi_refuses_a_keyless_stranger(tmp_path: Path, setting: dict[str, str]) -> None:
    from tcoll.bench.compare import mpiexec
    from tcoll.transport.mpi import MpiTransport

    launcher = mpiexec()
    if not (launcher and MpiTransport.available()):
        pytest.skip("the optional extra tcoll[mpi] (mpi4py and mpiexec) is not installed")
    (tmp_path / "rank.py").write_text(textwrap.dedent(_MPI_RANK))
    (tmp_path / "stranger.py").write_text(textwrap.dedent(_STRANGER))
    # The ranks' own secret; the stranger, another user, has one of its own and no TCOLL_AUTH_KEY.
    stranger_env = _clean_env(TCOLL_SECRET_FILE=str(tmp_path / "stranger-secret"))
    env = _clean_env(TCOLL_SECRET_FILE=str(tmp_path / "secret"), TCOLL_TIMEOUT="60", **setting)
    done = subprocess.run([launcher, "-n", "2", sys.executable, str(tmp_path / "rank.py"),
                           str(tmp_path / "stranger.py"), str(tmp_path), json.dumps(stranger_env)],
                          env=env, capture_output=True, text=True, timeout=110, start_new_session=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads((tmp_path / "rank0.json").read_text())
    assert isinstance(found["stranger"], dict), found["stranger"]
    keyless, other = found["stranger"]["keyless"], found["stranger"]["another key"]
    assert keyless.startswith("refused: ") and "wrong authentication key" in keyless, keyless
    assert other.startswith("refused: ") and "failed to prove it knows TCOLL_AUTH_KEY" in other, other
    assert found["server_keyed"] and not found["written"]
