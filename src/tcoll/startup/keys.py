"""The job's key: what every TCP connection of a job (store or transport) must prove it knows.

Where the key comes from, first match wins:

1. ``TCOLL_AUTH_KEY``, when set. `tcoll run` and `tcoll.spawn` set it to a fresh
   random key for each job; a user may set their own (the same on every host).
   Set but empty, it turns authentication off, with a warning.
2. Otherwise (torchrun, Slurm, mpirun, a script started by hand) the key is
   derived from the user's secret, a file only its owner can read
   (``~/.config/tcoll/secret``, or ``TCOLL_SECRET_FILE``; made on first use),
   and from what every rank of the job already agrees on (its run id and
   master address): ``HMAC-SHA256(secret, "tcoll-job/" + run id + "/" + master)``.

Why a file and not the launcher's environment: torchrun, srun and mpiexec pass
their environment to every rank, but a key must exist before any of them starts,
and those launchers will not make one. The user's secret is what ssh and MUNGE
rely on too: another local user cannot read it (the file must be mode 0600),
and the ranks of one user on hosts that share a home directory all can. On
hosts without a shared home, copy the file, or set TCOLL_AUTH_KEY.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import warnings
from collections.abc import Mapping

from ..errors import RendezvousError

__all__ = ["job_key", "new_job_key", "secret_path", "user_secret", "derived_key", "AUTH_OFF_WARNING"]

AUTH_OFF_WARNING = ("TCOLL_AUTH_KEY is set but empty: authentication is off, so any local user (or any host "
                    "that can reach the store) can join this job and run code in its ranks")


def new_job_key() -> str:
    """A fresh random key for one job: 32 hexadecimal characters (128 bits)."""
    return secrets.token_hex(16)


def secret_path(env: Mapping[str, str] | None = None) -> str:
    """Where the user's secret lives: TCOLL_SECRET_FILE, else $XDG_CONFIG_HOME/tcoll/secret or ~/.config/tcoll/secret."""
    env = os.environ if env is None else env
    if env.get("TCOLL_SECRET_FILE"):
        return env["TCOLL_SECRET_FILE"]
    base = env.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "tcoll", "secret")


def user_secret(path: str) -> bytes:
    """Read the user's secret at `path`, creating it (mode 0600) if there is none yet.

    Ranks starting together may race to create it: the first link wins and
    every rank reads that one.

    Args:
        path: the secret's file.

    Returns:
        The secret's bytes.

    Raises:
        RendezvousError: the file cannot be made or read, is not the user's own,
            or others may read it.
    """
    try:
        return _read_private(path)
    except FileNotFoundError:
        pass
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        temp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_hex(32).encode() + b"\n")
        finally:
            os.close(fd)
        try:
            os.link(temp, path)  # atomic: a rank that lost the race reads the winner's
        except FileExistsError:
            pass
        finally:
            os.unlink(temp)
        return _read_private(path)
    except OSError as exc:
        raise RendezvousError(f"cannot make the tcoll secret {path} ({exc}): set TCOLL_AUTH_KEY to the same "
                              f"value on every rank, or TCOLL_SECRET_FILE to a file only you can read") from exc


def _read_private(path: str) -> bytes:
    """The contents of `path`, which must belong to this user and be unreadable by others."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise RendezvousError(f"the tcoll secret {path} must belong to you and be readable by you only "
                                  f"(mode {stat.S_IMODE(info.st_mode):o}): chmod 600 {path}")
        data = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(data) < 16:
        raise RendezvousError(f"the tcoll secret {path} is too short: delete it and a new one is made")
    return data


def derived_key(secret: bytes, *context: str) -> str:
    """The key for a job named by `context` (run id, master address, ...), from the user's secret."""
    message = "tcoll-job/" + "/".join(context)
    return hmac.new(secret, message.encode(), hashlib.sha256).hexdigest()


def job_key(run_id: str, master: str, env: Mapping[str, str] | None = None) -> str:
    """The key every TCP connection of this job proves: TCOLL_AUTH_KEY, else derived from the user's secret.

    Args:
        run_id: the job's run id, the same on every rank.
        master: the rendezvous address ("host:port"), the same on every rank ("" if none).
        env: the variables to read (default: os.environ).

    Returns:
        The key; "" when TCOLL_AUTH_KEY is set but empty (authentication off, warned once).

    Raises:
        RendezvousError: no key is given and the user's secret cannot be read or made.
    """
    env = os.environ if env is None else env
    if "TCOLL_AUTH_KEY" in env:
        if not env["TCOLL_AUTH_KEY"]:
            warnings.warn(AUTH_OFF_WARNING, RuntimeWarning, stacklevel=3)
        return env["TCOLL_AUTH_KEY"]
    return derived_key(user_secret(secret_path(env)), run_id, master)
