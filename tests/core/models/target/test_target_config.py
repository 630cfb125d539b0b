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


@pytest.mark.parametrize("layers", [2, 3, 4, 5, 6, 36, 64])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_no_default_names_the_last_layer(layers, k):
    """Serving reads the last layer before the final norm, training after it (issue 46)."""
    try:
        ids = default_layer_ids(layers, k)
    except ValueError:
        assert k > 1 and layers < 4  # too shallow for a spread: refused, not the last layer
        return
    assert len(ids) == k and max(ids) < layers - 1


def test_one_default_layer_is_the_middle_one_below_the_last():
    assert [default_layer_ids(n, k=1) for n in (2, 3, 4, 5)] == [[0], [1], [2], [2]]
    with pytest.raises(ValueError, match="no layer below its last"):
        default_layer_ids(1, k=1)
