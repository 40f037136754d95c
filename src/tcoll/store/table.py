"""The TCP store server's data and requests: keys and values, the bytes they hold, the requests waiting for keys.

The server (`tcp_server`) owns connections and frames; this module answers
decoded requests. It is used only from the server's event-loop thread, so it
takes no locks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import cas_result, parse_counter
from .limits import ENTRY_OVERHEAD, StoreLimits
from .wire import ERROR, F64, I64, LIMIT, OK, TIMEOUT, Op, ProtocolError, encode_parts

__all__ = ["Table"]


def _cost(key: bytes, value: bytes) -> int:
    return len(key) + len(value) + ENTRY_OVERHEAD


def _show(key: bytes) -> str:
    text = key.decode(errors="replace")
    return repr(text if len(text) <= 80 else text[:77] + "...")


class Table:
    """Key-value data with a byte budget, and the waiters parked on missing keys.

    Args:
        limits: the value and total-size caps to enforce.
        answer: called with (waiter, reply frame) when a parked request is satisfied.
    """

    def __init__(self, limits: StoreLimits, answer: Callable[[Any, list[bytes]], None]) -> None:
        self.limits = limits
        self.answer = answer
        self.data: dict[bytes, bytes] = {}
        self.held = 0  # bytes counted for every stored key (see ENTRY_OVERHEAD)
        self.waiters: dict[bytes, set[Any]] = {}  # key -> the parked requests to recheck when it is set
        self.parked: dict[Any, tuple[list[bytes], bool, bytes]] = {}  # waiter -> keys, with values, parked on
        self.parked_for = 0.0  # the seconds the last request that parked may wait
        self._handlers: dict[int, Callable[[Any, list[bytes]], list[bytes] | None]] = {
            Op.SET: self._op_set, Op.MGET: self._op_mget, Op.WAIT: self._op_wait, Op.ADD: self._op_add,
            Op.CAS: self._op_cas, Op.CHECK: self._op_check, Op.DELETE: self._op_delete, Op.NUM_KEYS: self._op_num_keys,
        }  # fmt: skip

    def request(self, waiter: Any, op: int, fields: list[bytes]) -> tuple[list[bytes] | None, float]:
        """Answer one request.

        Returns:
            (reply frame, 0), or (None, seconds) when the request waits for keys:
            `answer` gets its reply when they come, `expire` when the seconds pass.

        Raises:
            ProtocolError, struct.error, IndexError: the request is malformed.
        """
        handler = self._handlers.get(op)
        if handler is None:
            raise ProtocolError(f"unknown operation {op}")
        reply = handler(waiter, fields)
        if reply is None:
            return None, self.parked_for
        return reply, 0.0

    def expire(self, waiter: Any) -> list[bytes]:
        """The TIMEOUT reply of a parked request whose time ran out (it is no longer parked)."""
        keys, _, _ = self.forget(waiter)
        return encode_parts(TIMEOUT, *self.missing(keys))

    def forget(self, waiter: Any) -> tuple[list[bytes], bool, bytes]:
        """Drop a parked request (its client left, or its time ran out); return what it waited for."""
        entry = self.parked.pop(waiter)
        self.unpark(waiter, entry[2])
        return entry

    def refusal(self, key: bytes, value: bytes) -> str | None:
        """Why storing `value` under `key` would exceed a limit, or None when it fits."""
        cap = self.limits.max_value
        for what, data in (("value", value), ("key", key)):
            if len(data) > cap:
                return (f"a {what} of {len(data)} bytes (key {_show(key)}) exceeds the store's limit of "
                        f"{cap} bytes per {what} (TCOLL_STORE_MAX_VALUE)")
        old = self.data.get(key)
        after = self.held - (0 if old is None else _cost(key, old)) + _cost(key, value)
        if after > self.limits.max_bytes:
            return (f"storing {len(value)} bytes under key {_show(key)} would make the store hold {after} bytes, "
                    f"above its limit of {self.limits.max_bytes} (TCOLL_STORE_MAX_BYTES); "
                    "delete keys that are no longer needed, or raise the limit")
        return None

    def store(self, key: bytes, value: bytes) -> list[bytes] | None:
        """Store a value and recheck its waiters; a LIMIT reply (nothing stored) when it does not fit."""
        why = self.refusal(key, value)
        if why is not None:
            return encode_parts(LIMIT, why.encode())
        old = self.data.get(key)
        if old is not None:
            self.held -= _cost(key, old)
        self.data[key] = value
        self.held += _cost(key, value)
        for waiter in self.waiters.pop(key, ()):
            self._recheck(waiter)
        return None

    def delete(self, key: bytes) -> bool:
        """Remove a key; whether it existed."""
        old = self.data.pop(key, None)
        if old is None:
            return False
        self.held -= _cost(key, old)
        return True

    def missing(self, keys: list[bytes]) -> list[bytes]:
        """The keys not stored, in order."""
        return [k for k in keys if k not in self.data]

    def park(self, waiter: Any, keys: list[bytes], with_values: bool, key: bytes) -> None:
        """Recheck `waiter` when `key` is set (a waiter parks on one missing key at a time)."""
        self.parked[waiter] = (keys, with_values, key)
        self.waiters.setdefault(key, set()).add(waiter)

    def unpark(self, waiter: Any, key: bytes) -> None:
        """Forget a waiter parked on `key`."""
        parked = self.waiters.get(key)
        if parked is not None:
            parked.discard(waiter)
            if not parked:
                del self.waiters[key]

    # -- operations: each takes the waiter and the request's fields, and returns the reply ----

    def _op_set(self, waiter: Any, f: list[bytes]) -> list[bytes]:
        return self.store(f[0], f[1]) or encode_parts(OK)

    def _op_mget(self, waiter: Any, f: list[bytes]) -> list[bytes] | None:
        return self._wait_keys(waiter, f, with_values=True)

    def _op_wait(self, waiter: Any, f: list[bytes]) -> list[bytes] | None:
        return self._wait_keys(waiter, f, with_values=False)

    def _wait_keys(self, waiter: Any, f: list[bytes], with_values: bool) -> list[bytes] | None:
        """Answer when the keys f[1:] exist (their values, if asked) or after f[0] seconds; park till then."""
        (timeout,) = F64.unpack(f[0])
        timeout = 0.0 if timeout != timeout else min(max(timeout, 0.0), 1e9)  # NaN waits not at all
        keys = f[1:]
        missing = self.missing(keys)
        if not missing:
            return self._found(keys, with_values)
        if timeout <= 0:
            return encode_parts(TIMEOUT, *missing)
        self.park(waiter, keys, with_values, missing[0])
        self.parked_for = timeout
        return None

    def _found(self, keys: list[bytes], with_values: bool) -> list[bytes]:
        if not with_values:
            return encode_parts(OK)
        try:
            return encode_parts(OK, *(self.data[k] for k in keys))  # references, not copies, of the values
        except ValueError as exc:  # more than one frame can carry
            return encode_parts(LIMIT, str(exc).encode())

    def _recheck(self, waiter: Any) -> None:
        """A key this request waits for was set: answer it, or park it on the next missing key."""
        keys, with_values, _ = self.parked.pop(waiter)
        missing = self.missing(keys)
        if missing:
            self.park(waiter, keys, with_values, missing[0])
        else:
            self.answer(waiter, self._found(keys, with_values))

    def _op_add(self, waiter: Any, f: list[bytes]) -> list[bytes]:
        (amount,) = I64.unpack(f[1])
        try:
            value = parse_counter(f[0].decode(errors="replace"), self.data.get(f[0])) + amount
        except ValueError as exc:
            return encode_parts(ERROR, str(exc).encode())
        return self.store(f[0], str(value).encode("ascii")) or encode_parts(OK, I64.pack(value))

    def _op_cas(self, waiter: Any, f: list[bytes]) -> list[bytes]:
        swap, result = cas_result(self.data.get(f[0]), f[1], f[2])
        return (swap and self.store(f[0], f[2])) or encode_parts(OK, result)

    def _op_check(self, waiter: Any, f: list[bytes]) -> list[bytes]:
        return encode_parts(OK, b"\x00" if self.missing(f) else b"\x01")

    def _op_delete(self, waiter: Any, f: list[bytes]) -> list[bytes]:
        return encode_parts(OK, b"\x01" if self.delete(f[0]) else b"\x00")

    def _op_num_keys(self, waiter: Any, f: list[bytes]) -> list[bytes]:
        return encode_parts(OK, I64.pack(len(self.data)))
