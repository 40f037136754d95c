"""describe: an array's kind, dtype and shape in a fixed number of bytes, and back."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tcoll.comm import describe

DTYPES = [np.bool_, np.int8, np.uint16, np.int64, np.float16, ml_dtypes.bfloat16, np.float32, np.complex128,
          np.dtype(">i4"), np.dtype([("value", np.float64), ("index", np.int64)]),
          np.dtype([("a", ">i2", (2, 3)), ("b", [("x", "<f8"), ("y", "u1")])]),  # sub-arrays, nesting
          np.dtype({"names": ["a", "b"], "formats": ["<f4", "<i2"], "titles": ["T1", None]})]  # a titled field


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3, 4)])
def test_numpy_arrays_round_trip(dtype: object, shape: tuple[int, ...]) -> None:
    arr = np.zeros(shape, dtype=dtype)
    encoded = describe.encode(arr)
    assert encoded.dtype == np.uint8 and encoded.size == describe.META_BYTES
    kind, got_dtype, got_shape = describe.decode(encoded)
    assert (kind, got_dtype, got_shape) == ("numpy", np.dtype(dtype), shape)
    made, view = describe.allocate(kind, got_dtype, got_shape)
    assert made.dtype == np.dtype(dtype) and made.shape == shape and view is made


def test_torch_tensors_keep_their_kind() -> None:
    torch = pytest.importorskip("torch")
    for dtype in (torch.bfloat16, torch.int32, torch.bool):
        kind, np_dtype, shape = describe.decode(describe.encode(torch.zeros(2, 3, dtype=dtype)))
        assert (kind, shape) == ("torch", (2, 3))
        made, view = describe.allocate(kind, np_dtype, shape)
        assert isinstance(made, torch.Tensor) and made.dtype == dtype and view.dtype == np_dtype


def test_a_description_that_does_not_fit_is_refused() -> None:
    wide = np.dtype([(f"field_{i}", np.float64) for i in range(40)])
    with pytest.raises(ValueError, match="cannot describe"):
        describe.encode(np.zeros(1, dtype=wide))

