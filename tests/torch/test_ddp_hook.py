"""`tcoll.torch.ddp_hook`: DDP with it trains as one process does; ranks that disagree get a named error.

The ranks run tests/helpers/ddp_hook_workers.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from helpers import ddp_hook_workers, torch_workers  # noqa: E402
from helpers.procs import free_port


@pytest.mark.timeout(240)
@pytest.mark.parametrize("size", [2, 3])
def test_ddp_with_the_hook_matches_single_process_training(size: int) -> None:
    torch_workers.spawn(ddp_hook_workers.training, size, free_port())


@pytest.mark.timeout(180)
def test_ranks_that_disagree_get_a_named_error_not_a_hang() -> None:
    torch_workers.spawn(ddp_hook_workers.mismatches, 2, free_port())


def test_a_group_that_is_not_tcolls_is_a_type_error() -> None:
    import torch

    import tcoll.torch

    with pytest.raises(TypeError, match="no default process group"):
        tcoll.torch.ddp_hook(None, ddp_hook_workers.Bucket(0, torch.ones(2)))
    with pytest.raises(TypeError, match="tcoll.torch.ddp_hook needs the tcoll process group"):
        tcoll.torch.ddp_hook(object(), ddp_hook_workers.Bucket(0, torch.ones(2)))
