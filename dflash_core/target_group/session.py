"""A target group outside a run: ``dflash-tui check`` and ``dflash-tui eval`` load a target that
needs several GPUs as a run does (its ranks, group.py), and decode through it
(remote.GroupTarget). No batch stream feeds it: the ranks load, send the embedding and lm_head,
and from then on answer verify requests only.

A rank's failure or death is raised as GroupRankFailed naming the rank and its GPU, as a run
names it; the verbs print it in one error line with its hint and exit 1.
"""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path
from typing import Callable

import torch

from dflash_core.target_group.group import GroupRankFailed, TargetGroup, TargetHeads
from dflash_core.target_group.rank import POLL_S, RESUME
from dflash_core.target_group.remote import GroupTarget
from dflash_core.target_group.split import GroupSplit

# The hint of a rank's failure in a verb (a run's says --resume)
AGAIN = "the same command again once the cause is fixed"


def verb_hint(exc: GroupRankFailed) -> str:
    """A rank failure's hint in a verb's words (its log, the command again)."""
    return exc.hint.replace(RESUME, AGAIN)


def moe_of(target_path: Path) -> bool:
    from dflash_core.models.target.shape import model_shape

    raw = json.loads((Path(target_path) / "config.json").read_text(encoding="utf-8"))
    return model_shape(raw).experts > 0


class GroupSession:
    """One copy of the target over ``devices``, started, loaded, and closed by ``close``."""

    def __init__(self, target_path: Path, devices: list[torch.device], split: GroupSplit, *,
                 dtype: str, attn_implementation: str, layer_ids: list[int],
                 trust_remote_code: bool, folder: Path, say: Callable[[str], None]):
        self.say = say
        self.group = TargetGroup(
            0, devices, split, target_path=target_path, dtype=dtype,
            attn_implementation=attn_implementation, layer_ids=list(layer_ids),
            last_hidden=False, trust_remote_code=trust_remote_code,
            # one rank holds the whole target (the CUDA hand-off alone): no split to ask for
            distributed=split.distributed(moe_of(target_path)) if split.k > 1 else {},
            run_dir=folder,
            publish=lambda ev: say(getattr(ev, "message", str(ev))))
        self.target: GroupTarget | None = None

    def open(self, device: torch.device, heads_device: torch.device | None = None
             ) -> GroupTarget:
        """Start the ranks, wait until every one has loaded (rank 0's embedding and lm_head
        too), end their batch streams (there are none), and give the target."""
        g = self.group
        g.start()
        loaded: dict[int, tuple] = {}
        t0, said = time.monotonic(), 0.0
        while len(loaded) < g.split.k or g.heads is None:
            for r in range(g.split.k):
                msg = self._reply(r)
                if msg is None:
                    continue
                if msg[0] == "loaded":
                    loaded[r] = msg[1:]
                elif msg[0] == "heads":
                    from dflash_core.models.target.config import load_target_config

                    config = load_target_config(g.target_path, g.trust_remote_code)
                    g.heads = TargetHeads(config, msg[2], msg[3])
                elif msg[0] == "progress" and time.monotonic() - said > 10:
                    said = time.monotonic()
                    f = msg[1]
                    self.say(f"  rank {r}: {f['bytes_loaded'] / 2 ** 30:.1f} of "
                             f"{f['bytes_total'] / 2 ** 30:.1f} GiB read")
        for req in g.requests:
            req.put(("end",))
        gib = sum(m[0] for m in loaded.values()) / 2 ** 30
        self.say(f"target group: {g.split.k} ranks loaded in {time.monotonic() - t0:.0f} s "
                 f"({gib:.1f} GiB of the target's weights over them; logs "
                 f"{g.log_path(0).name} ...)")
        self.target = GroupTarget(g, g.heads, device, heads_device)
        return self.target

    def _reply(self, rank: int):
        g = self.group
        dead = g.dead_rank()
        if dead is not None:
            time.sleep(POLL_S)  # its last words (a traceback) may still be in its queue
            try:
                msg = g.replies[rank].get_nowait()
            except queue.Empty:
                raise dead from None
            if msg[0] == "error":
                raise g.rank_error(rank, msg)
            raise dead
        try:
            msg = g.replies[rank].get(timeout=POLL_S / max(1, g.split.k))
        except queue.Empty:
            return None
        except (OSError, EOFError, ValueError):
            # the rank ended while handing over a tensor (its fd): name it as a death
            time.sleep(POLL_S)
            raise g.dead_rank() or GroupRankFailed(f"target group rank {rank}: its reply queue "
                                                   "broke while the rank was alive") from None
        if msg[0] == "error":
            raise g.rank_error(rank, msg)
        return msg

    def close(self) -> None:
        """End every rank (group.shutdown); what had to be forced is said."""
        forced = self.group.shutdown() if self.group.procs else []
        if forced:
            self.say(f"target group: {', '.join(forced)}")
        self.target = None
