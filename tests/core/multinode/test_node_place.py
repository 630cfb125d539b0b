"""dflash_core.multinode.node_place: this process's place among the nodes, from torchrun's
environment."""

import pytest

from dflash_core.config import ConfigError
from dflash_core.multinode.node_place import node_info


def test_node_info_only_under_torchrun_with_several_nodes():
    assert node_info({}) is None
    assert node_info({"WORLD_SIZE": "1", "RANK": "0"}) is None
    info = node_info({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert (info.rank, info.world, info.lead) == (1, 2, False)
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        node_info({"WORLD_SIZE": "2", "RANK": "1"})
