"""The arena kernel's constants are the Python code's: compared at import, and a difference refuses to load.

_arena_kernel.c writes the slot sets, the descriptor's words, the dtype and op
codes and part_bounds in C; tcoll.shm.kernel_abi and tcoll.algos.topology hold the
same in Python. The kernel exports its own, `check_kernel` compares them when
tcoll.shm.kernel_abi is imported, and part_bounds is compared here over many cases.
"""

from __future__ import annotations

import itertools

import pytest

from tcoll.algos.topology import part_bounds
from tcoll.ops import MAX, MIN
from tcoll.shm import kernel_abi

kernel = pytest.importorskip("tcoll.shm._arena_kernel")


def test_the_built_kernel_matches() -> None:
    kernel_abi.check_kernel(kernel)  # what the import did
    assert kernel.SETS == kernel_abi.SETS and len(kernel.DTYPES) == len(kernel_abi.KERNEL_DTYPES)


@pytest.mark.parametrize("name,value", [("SETS", 3), ("DESC_WORDS", 9), ("PROGRESS_LINE", 128), ("REVISION", 3)])
def test_a_layout_constant_changed_in_python_only_refuses_the_kernel(monkeypatch: pytest.MonkeyPatch, name: str,
                                                                    value: int) -> None:
    monkeypatch.setattr(kernel_abi, name, value)
    with pytest.raises(ImportError, match=rf"{name} is \d+ in C but {value} in tcoll.shm.kernel_abi.*Rebuild"):
        kernel_abi.check_kernel(kernel)


def test_dtype_or_op_codes_changed_in_python_only_refuse_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    swapped = dict(kernel_abi.KERNEL_DTYPES)
    f32, f64 = (dtype for dtype, code in swapped.items() if code in (0, 1))
    swapped[f32], swapped[f64] = swapped[f64], swapped[f32]
    monkeypatch.setattr(kernel_abi, "KERNEL_DTYPES", swapped)
    with pytest.raises(ImportError, match="DTYPES is .* in C but"):
        kernel_abi.check_kernel(kernel)
    monkeypatch.undo()
    ops = dict(kernel_abi.KERNEL_OPS)
    ops[MIN], ops[MAX] = ops[MAX], ops[MIN]
    monkeypatch.setattr(kernel_abi, "KERNEL_OPS", ops)
    with pytest.raises(ImportError, match="OPS is .* in C but"):
        kernel_abi.check_kernel(kernel)


def test_a_constant_changed_in_c_only_refuses_the_kernel() -> None:
    class Edited:  # the kernel as if its C side said 4 slot sets
        __name__, __file__ = kernel.__name__, kernel.__file__
        SETS, DESC_WORDS, DTYPES, OPS = 4, kernel.DESC_WORDS, kernel.DTYPES, kernel.OPS

    with pytest.raises(ImportError, match="SETS is 4 in C but 2"):
        kernel_abi.check_kernel(Edited)


def test_part_bounds_in_c_is_topology_part_bounds() -> None:
    for count, parts in itertools.product(list(range(0, 40)) + [97, 1000, 4097, 65537, 10 ** 9 + 7], range(1, 19)):
        for index in range(parts):
            assert kernel.part_bounds(count, parts, index) == part_bounds(count, parts, index), (count, parts, index)
    with pytest.raises(ValueError):
        kernel.part_bounds(10, 3, 3)


def test_a_kernel_built_before_its_steps_changed_refuses_to_load() -> None:
    class Old:  # a build from before REVISION: its split step read a lender's slot (a wrong result)
        __name__, __file__ = kernel.__name__, kernel.__file__
        SETS, DESC_WORDS, PROGRESS_LINE, DTYPES, OPS = (kernel.SETS, kernel.DESC_WORDS, kernel.PROGRESS_LINE,
                                                         kernel.DTYPES, kernel.OPS)

    with pytest.raises(ImportError, match=rf"REVISION is None in C but {kernel_abi.REVISION} in .*Rebuild"):
        kernel_abi.check_kernel(Old)

