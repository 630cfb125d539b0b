"""dflash_core.models.target.config: the default choice of feature layers."""

import pytest

from dflash_core.models.target.config import default_layer_ids


def test_default_layer_ids():
    assert default_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_layer_ids(64) == [1, 16, 31, 46, 61]
    assert default_layer_ids(36, k=1) == [18]
    assert default_layer_ids(6, k=3) == [1, 2, 3]
    assert default_layer_ids(30, k=4) == [1, 10, 18, 27]  # rounded, not truncated
    with pytest.raises(ValueError):
        default_layer_ids(3)
