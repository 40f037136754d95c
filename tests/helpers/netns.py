"""Hosts on one machine: network namespaces joined by a bridge, each with its own hostname and /dev/shm.

`namespace_hosts(n)` makes n "hosts". Each is a network namespace with a
veth pair whose outer end is on a private bridge, and an address in a private
/24 of 10.77.0.0/16 (host i is .i+1). Commands run in a host through
`ip netns exec`, then `unshare --uts --mount`, which gives the process a
hostname of its own and a fresh tmpfs on /dev/shm: to tcoll it is another
machine (another host identity, no shared memory with the others). The
namespaces, links and processes are removed when the context ends.

It needs root (CI is root). `unavailable()` says why namespaces cannot be
made here, for the single skip of the tests that use them.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["unavailable", "namespace_hosts", "NamespaceHosts", "wait_all", "GROUP"]

GROUP = "namespace-hosts"  # the xdist group of every test that makes hosts: one worker runs them, one at a time

_SRC = str(Path(__file__).resolve().parents[2] / "src")
_TESTS = str(Path(__file__).resolve().parents[1])


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why namespace-hosts cannot be made on this machine, or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command is missing"
    probe = f"tcprobe{os.getpid()}"
    try:
        made = _ip("netns", "add", probe, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"`ip netns add` failed: {exc}"
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class NamespaceHosts:
    """n namespace-hosts on a bridge (see the module docstring).

    Attributes:
        names: each host's namespace name (also its hostname).
        addrs: each host's IPv4 address.
        links: each host's outer veth end (in the root namespace): `link_down(i)` takes it down.
    """

    def __init__(self, count: int) -> None:
        tag = f"{os.getpid() % 100000}{random.randrange(100)}"
        self.subnet = random.randrange(10, 250)
        self.bridge = f"tcb{tag}"[:15]
        self.names = [f"tch{tag}h{i}" for i in range(count)]
        self.links = [f"tcv{tag}h{i}"[:15] for i in range(count)]
        self.addrs = [f"10.77.{self.subnet}.{i + 1}" for i in range(count)]
        self.procs: list[subprocess.Popen[Any]] = []

    def build(self) -> None:
        """Create the bridge, the namespaces and their links (raises CalledProcessError).

        The bridge has an address too (.254), so that a launcher in the root namespace (mpiexec) can be
        reached by the processes it starts in the hosts.
        """
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"10.77.{self.subnet}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for name, link, addr in zip(self.names, self.links, self.addrs):
            _ip("netns", "add", name)
            _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("link", "set", link, "master", self.bridge)
            _ip("link", "set", link, "up")
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")

    def command(self, host: int, args: Sequence[str]) -> list[str]:
        """`args` wrapped to run in host `host`: its network, its hostname, its own /dev/shm."""
        setup = f"hostname {self.names[host]} && mount -t tmpfs -o size=2g tmpfs /dev/shm && exec \"$@\""
        return ["ip", "netns", "exec", self.names[host], "unshare", "--uts", "--mount", "--propagation", "private",
                "sh", "-c", setup, "sh", *args]

    def start(self, host: int, args: Sequence[str], env: dict[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen[str]:
        """Start `args` in host `host` (its own session, so teardown kills the whole tree)."""
        environ = dict(os.environ)
        environ["PYTHONPATH"] = os.pathsep.join([_SRC, _TESTS, environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        environ.update(env or {})
        proc = subprocess.Popen(self.command(host, args), env=environ, text=True, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)
        self.procs.append(proc)
        return proc

    def tcoll_run(self, nprocs: int, script: Sequence[str], env: dict[str, str] | None = None,
                  port: int = 29500) -> list[subprocess.Popen[str]]:
        """`tcoll run --nnodes N --node-rank R --master ADDR:PORT -n nprocs script...` in every host."""
        count = len(self.names)
        return [self.start(host, [sys.executable, "-m", "tcoll", "run", "--nnodes", str(count), "--node-rank",
                                  str(host), "--master", f"{self.addrs[0]}:{port}", "-n", str(nprocs), *script], env)
                for host in range(count)]

    def mpiexec(self, nprocs: int, args: Sequence[str], env: dict[str, str], workdir: Path,
                mpiexec: str = "mpiexec") -> subprocess.Popen[str]:
        """MPICH's `mpiexec` in the root namespace starting `nprocs` ranks per host, in the hosts.

        Hydra starts its proxy on each host through a launch script in place of ssh (it is called as
        `script [options] HOST COMMAND`), which runs the command as `command()` does.
        """
        cases = "\n".join(f"  {addr}) ns={name} ;;" for addr, name in zip(self.addrs, self.names))
        script = workdir / "netns-launch.sh"
        script.write_text(f"""#!/bin/sh
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case $host in
{cases}
  *) echo "unknown host $host" >&2; exit 1 ;;
esac
exec ip netns exec $ns unshare --uts --mount --propagation private sh -c \
  "hostname $ns && mount -t tmpfs -o size=2g tmpfs /dev/shm && exec $*"
""")
        script.chmod(0o755)
        command = [mpiexec, "-hosts", ",".join(self.addrs), "-ppn", str(nprocs), "-n", str(nprocs * len(self.addrs)),
                   "-launcher", "ssh", "-launcher-exec", str(script), "-iface", self.bridge, *args]
        environ = dict(os.environ)
        environ["PYTHONPATH"] = os.pathsep.join([_SRC, _TESTS])
        environ.update(env)
        proc = subprocess.Popen(command, env=environ, text=True, start_new_session=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def run_in(self, host: int, *args: str) -> subprocess.CompletedProcess[str]:
        """Run a quick command (tc, ip) in host `host`'s network namespace."""
        return subprocess.run(["ip", "netns", "exec", self.names[host], *args], capture_output=True, text=True,
                              check=True, timeout=30)

    def link_down(self, host: int) -> None:
        """Cut host `host` off the bridge: its packets go nowhere, no FIN, no RST."""
        _ip("link", "set", self.links[host], "down")

    def teardown(self) -> None:
        """Kill every process started here, remove the namespaces, links and bridge."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=10)
        for name in self.names:
            _ip("netns", "del", name, check=False)
        for link in self.links:
            _ip("link", "del", link, check=False)
        _ip("link", "del", self.bridge, check=False)


@contextlib.contextmanager
def namespace_hosts(count: int) -> Iterator[NamespaceHosts]:
    """`count` namespace-hosts for the duration of the block (see the module docstring)."""
    hosts = NamespaceHosts(count)
    try:
        hosts.build()
        yield hosts
    finally:
        hosts.teardown()


def wait_all(procs: Sequence[subprocess.Popen[str]], timeout: float) -> list[tuple[int | None, str]]:
    """Wait for every process; (return code, output) of each (None: still running at the deadline, killed)."""
    import time

    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            results.append((None, out))
            continue
        results.append((proc.returncode, out))
    return results
