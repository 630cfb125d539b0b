"""What the GPU tests watch: an engine run's events, kept from its bus, and the drafter's
FlexAttention calls, split by whether autograd was on (training) or off (evaluation)."""

import torch

from dflash_core.observe.bus import EventBus
from dflash_core.observe.events import Error
from dflash_core.pipeline.engine import Engine


class Watched:
    """An event bus whose every event is kept in ``seen``."""

    def __init__(self) -> None:
        self.bus = EventBus()
        self.seen: list = []
        self.bus.tap(self.seen.append)

    def of(self, *kinds: type) -> list:
        return [e for e in self.seen if isinstance(e, kinds)]

    def errors(self) -> str:
        """The run's errors as text, tracebacks included (an assertion's message)."""
        return "\n".join(f"{e.source} {e.phase}: {e.message}\n{e.traceback}"
                         for e in self.of(Error))

    def run(self, cfg, timeout: float = 300, keep: bool = False) -> Engine:
        """Runs an engine on cfg to its end and asserts it finished. It is shut down after (and
        on a failure); keep=True hands it back running, for a test that restarts it."""
        engine = Engine(cfg, bus=self.bus)
        try:
            engine.start()
            assert engine.wait(timeout) == "finished", self.errors()
        except BaseException:
            engine.shutdown()
            raise
        if not keep:
            engine.shutdown()
        return engine


def watch_flex(monkeypatch) -> tuple[list, list]:
    """Counts the drafter's FlexAttention calls: (with autograd on, with it off)."""
    import dflash_core.models.block_attention as ba

    real = ba.flex_block_attention
    training, outside = [], []

    def flex(*a, **k):
        (training if torch.is_grad_enabled() else outside).append(1)
        return real(*a, **k)

    monkeypatch.setattr(ba, "flex_block_attention", flex)
    return training, outside
