"""This process's place among the nodes, from torchrun's environment, and its folder's name.

torchrun starts one process per node and hands it ``RANK`` (the node number here),
``WORLD_SIZE`` (the nodes), ``LOCAL_RANK`` and ``MASTER_ADDR`` / ``MASTER_PORT`` (where node 0's
store listens). Outside torchrun (no ``WORLD_SIZE``, or 1) ``node_info`` is None and nothing of
the multinode package runs. Apart from the group (nodes.py): the engine and the run folder ask
where this process stands before any group exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dflash_core.config import ConfigError


@dataclass(frozen=True)
class NodeInfo:
    rank: int  # this node's number, 0 = the node that writes checkpoints and W&B
    world: int  # nodes in the run
    local_world: int = 1  # processes torchrun started on this machine

    @property
    def lead(self) -> bool:
        return self.rank == 0


def node_info(environ=None) -> NodeInfo | None:
    """This process's place among the nodes, from torchrun's environment; None outside torchrun
    or with a single node (then nothing changes)."""
    env = os.environ if environ is None else environ
    try:
        world = int(env.get("WORLD_SIZE", "1") or "1")
    except ValueError:
        world = 1
    if world <= 1:
        return None
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        raise ConfigError("", f"WORLD_SIZE is {world} but {', '.join(missing)} is not set",
                          hint="start every node with torchrun (it sets RANK, WORLD_SIZE, "
                               "MASTER_ADDR, MASTER_PORT), or unset WORLD_SIZE for one node")
    return NodeInfo(rank=int(env["RANK"]), world=world,
                    local_world=int(env.get("LOCAL_WORLD_SIZE", "1") or "1"))


def node_dir_name(rank: int) -> str:
    return f"node-{rank}"
