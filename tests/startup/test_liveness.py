"""A peer is dead only on a definite answer: a rank out of file descriptors must not bury a live one."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

from tcoll.errors import RendezvousError
from tcoll.startup.liveness import PeerWatch
from tcoll.store.memory import MemoryStore
from tcoll.transport.shm import channel as shm_module
from tcoll.transport.shm.channel import process_alive

pytestmark = pytest.mark.timeout(60)


def _start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as handle:
        return int(handle.read().rpartition(b")")[2].split()[19])


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.EACCES, errno.ENOMEM, errno.EIO])
def test_a_failed_look_is_no_answer(code: int, monkeypatch: pytest.MonkeyPatch) -> None:
    def cannot_open(*args: object, **kwargs: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(shm_module, "open", cannot_open, raising=False)
    assert process_alive(os.getpid(), None)
    assert process_alive(os.getpid(), 12345)  # not even a start time to compare: no answer, so alive


def test_only_a_definite_answer_is_death(monkeypatch: pytest.MonkeyPatch) -> None:
    me = os.getpid()
    assert process_alive(me, _start_time(me))
    assert not process_alive(me, _start_time(me) + 1)  # the pid names another process now
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not process_alive(child.pid, None)  # reaped: /proc/<pid> is gone (ENOENT)
    for code in (errno.ENOENT, errno.ESRCH):
        def gone(*args: object, code: int = code, **kwargs: object) -> None:
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(shm_module, "open", gone, raising=False)
        assert not process_alive(me, None)


_OUT_OF_DESCRIPTORS = r"""
import errno, json, os, resource, sys
from tcoll.errors import RendezvousError
from tcoll.startup.liveness import PeerWatch
from tcoll.store.memory import MemoryStore
from tcoll.transport.shm.channel import process_alive

parent, start = int(sys.argv[1]), int(sys.argv[2])
card = json.loads(sys.argv[3])
store = MemoryStore()
store.set("alive/1", json.dumps(dict(card, pid=parent, start_time=start)).encode())
watch = PeerWatch(store, 0, 2, card)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
while True:  # use up every descriptor this process may have
    try:
        held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError as exc:
        assert exc.errno == errno.EMFILE, exc
        break
try:
    open(f"/proc/{parent}/stat", "rb")
    looked = "opened"
except OSError as exc:
    looked = errno.errorcode[exc.errno]
watch.check()  # raises RendezvousError if it buries the live parent
print(json.dumps({"looked": looked, "alive": process_alive(parent, start)}))
"""


def test_out_of_descriptors_a_live_peer_stays_alive() -> None:
    card = {"rank": 0, "host": "h", "pidns": "pid:[1]", "pid": 1, "start_time": 1}
    out = subprocess.run([sys.executable, "-c", _OUT_OF_DESCRIPTORS, str(os.getpid()), str(_start_time(os.getpid())),
                          json.dumps(card)], capture_output=True, text=True, timeout=30,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"looked": "EMFILE", "alive": True}


def test_peer_watch_names_a_dead_neighbour() -> None:
    """The other side of the rule: a definite death is still seen, and named."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    me = {"rank": 0, "host": "h", "pidns": "pid:[1]", "pid": os.getpid(), "start_time": None}
    store = MemoryStore()
    store.set("alive/1", json.dumps(dict(me, rank=1, pid=child.pid)).encode())
    with pytest.raises(RendezvousError, match=f"rank 1 \\(pid {child.pid}\\) died"):
        PeerWatch(store, 0, 2, me).check()
