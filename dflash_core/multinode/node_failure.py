"""The error of a run across nodes: a node died, hung past the timeout, left, or ended before
joining. Apart because every part raises it: the join (node_join.py), the collectives (nodes.py)
and the run's step-boundary protocol (node_link.py)."""

from __future__ import annotations


class NodeFailure(RuntimeError):
    """A collective across nodes failed: a node died, hung past the timeout, or left."""

    error_kind = "node"

    def __init__(self, message: str, nodes: list[int], hint: str = "", ending: str = "failed"):
        super().__init__(message)
        self.nodes = nodes
        self.ending = ending  # how the named node(s) ended: "aborted" when one stopped on request
        self.hint = hint or ("look at that node's train.log (runs/NAME/node-K/) and its console; "
                             "start all nodes again with --resume to go on from the last "
                             "checkpoint")
