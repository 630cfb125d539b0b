"""Top two lines: run name, lifecycle state, step, epoch, elapsed, ETA, error count; then where the
metrics go (wandb URL or offline folder) and the run folder."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from .. import fmt
from ..state import DashboardState
from .panel import field, pack

# Plain ANSI colours: they read the same in 16, 256 and true colour terminals.
STATE_STYLES = {
    "idle": "dim",
    "preflight": "bold cyan",
    "loading": "bold yellow",
    "warmup": "bold magenta",
    "training": "bold green",
    "finished": "bold blue",
    "aborted": "bold black on yellow",
    "failed": "bold white on red",
}


class HeaderBar(Static):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._state: DashboardState | None = None

    def show(self, state: DashboardState) -> None:
        self._state = state
        self.update(self.draw(state, self.size.width or 80))

    def on_resize(self) -> None:
        if self._state is not None:
            self.show(self._state)

    @property
    def text(self) -> str:
        return self.content.plain if isinstance(self.content, Text) else str(self.content)

    @staticmethod
    def draw(s: DashboardState, width: int) -> Text:
        step = s.step
        total = f"/{s.total_steps}" if s.total_steps else ""
        n = s.error_count
        short = width < 100  # 80 columns: short labels keep the first line on one line
        first = [
            Text(s.run_name or "dflash", style="bold"),
            Text(f" {s.state.upper()} ", style=STATE_STYLES.get(s.state, "bold")),
            # why it stopped, where there is room for it (small screens: the log says it)
            Text(s.reason, style="dim") if s.reason and not s.live and not short else Text(),
            field("step", f"{step.step if step else 0}{total}"),
            field("ep" if short else "epoch", str(step.epoch)) if step else Text(),
            field("up" if short else "elapsed", fmt.duration(s.elapsed)),
            field("ETA", fmt.duration(s.eta)) if s.live else Text(),
            field("err" if short else "errors", str(n), "bold white on red" if n else "bold green"),
        ]
        second = [field("wandb", s.wandb or "off")]
        if s.run_dir:
            second.append(field("run", s.run_dir, ""))
        if s.best is not None:  # the checkpoint to serve: highest exact tau so far
            second.append(field("best", f"step {s.best.step} τ {s.best.tau:.2f}", "bold"))
        if s.allocator:  # which CUDA allocator settings the run's numbers come from
            second.append(field("alloc", s.allocator, "dim"))
        if s.stalls:  # a warning, not an error: a compile may take minutes
            second.insert(0, Text("stalled: " + ", ".join(
                f"{w} {fmt.duration(s.now - e.ts + e.seconds)}" for w, e in s.stalls.items()),
                style="bold yellow"))
        if s.attached:  # keys reach another process's run; q leaves it running (first: a long
            second.insert(0, Text("attached" + (", read-only" if s.read_only else "")
                                  + ": q detaches", style="bold cyan"))  # run dir wraps)
        text = pack(first, width)
        text.append("\n")
        text.append_text(pack(second, width))
        return text
