"""The event vocabulary: everything the engine knows leaves it as one of these frozen dataclasses.

Each one serialises to a single JSON line (``to_json``) and comes back with ``from_json``, so
``events.jsonl`` replays into any subscriber (the dashboard, tests, a post-mortem). The bus that
carries them is ``dflash_core.observe.bus``; the file they are written to and read back from is
``dflash_core.observe.event_log``'s. The base class is ``event_base.Event``; the periodic
samples (GPU, host, queue depths) are ``sample_events``', the progress of loads, background
checkpoints and builds ``progress_events``'; this module names the whole vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dflash_core.observe.event_base import Event
from dflash_core.observe.progress_events import (  # noqa: F401 - part of the vocabulary
    BuildProgress, CheckpointProgress, LoadProgress,
)
from dflash_core.observe.sample_events import (  # noqa: F401 - part of the vocabulary
    HS_QUEUE, GpuSample, HostSample, QueueDepth, prefetch_queue, prefetch_rank,
)

# Lifecycle states, in order. Terminal states end a run; the engine then waits for the operator.
STATES = ("idle", "preflight", "loading", "warmup", "training", "finished", "aborted", "failed")
TERMINAL_STATES = ("finished", "aborted", "failed")

# What an Error is about (its error_kind): out of memory, a bad config value, unusable training
# data, the wandb sink, a CUDA fault, a file or disk problem, or a bug in dflash itself. Each kind
# comes with a hint of what the operator can change; see errors.classify.
# "node": another node of a multi-node run failed, left or hung (nodes.py).
ERROR_KINDS = ("oom", "config", "data", "wandb", "cuda", "io", "internal", "node")

# A worker's own phase, WorkerStatus.status. A target goes loading -> warmup -> running, a drafter
# warmup -> running; each ends with one last status whichever way it ends: done (a target whose
# data ran out), stopped (the run stopped it: an abort, the end, another worker's failure) or
# failed (its body raised; the reason in detail).
WORKER_LOADING = "loading"  # reading its weights (LoadProgress events follow)
WORKER_WARMUP = "warmup"  # first forward or step: kernels compiling
WORKER_RUNNING = "running"
WORKER_DONE = "done"
WORKER_STOPPED = "stopped"
WORKER_FAILED = "failed"
WORKER_STATUSES = (WORKER_LOADING, WORKER_WARMUP, WORKER_RUNNING, WORKER_DONE, WORKER_STOPPED,
                   WORKER_FAILED)

@dataclass(frozen=True)
class RunStarted(Event):
    run_name: str
    run_dir: str
    config: dict
    targets: list  # device labels of target workers, e.g. ["cuda:0", ...] or ["cpu:0"]
    drafters: list
    resumed_from_step: int = 0
    total_steps: int = 0
    # A resume was asked for: the step it starts from comes later, with TrainingPlan (until
    # then no reader should call it step 0).
    resume: bool = False
    allocator: str = ""  # CUDA caching-allocator settings in force ("" on CPU)
    kind: ClassVar[str] = "RunStarted"
    keep_when_behind: ClassVar[bool] = True


@dataclass(frozen=True)
class TrainingPlan(Event):
    """Published as training begins, once the data is planned (RunStarted comes before that):
    the step it starts from (the checkpoint's on a resume), the step that ends it, and which
    limit sets that end, so every reader says the same ("512 steps = 8 epochs of the data")."""

    start_step: int
    total_steps: int
    epochs: int  # optim.epochs
    epoch_steps: int  # the optimizer steps those epochs of the data make
    max_steps: int = 0  # run.max_steps in force (0: none)
    max_steps_from: str = "run.max_steps"  # where it was set: "--max-steps" or "run.max_steps"
    targets: int = 0  # target workers of this node
    drafters: int = 0  # drafter replicas of this node
    recipe: str = ""  # drafter.loss and optim.name with their rates (config.recipe_text)
    kind: ClassVar[str] = "TrainingPlan"
    keep_when_behind: ClassVar[bool] = True

    @property
    def by_epochs(self) -> bool:
        """The epochs end the run (max_steps is unset or past them); else max_steps does."""
        return not self.max_steps or self.max_steps >= self.epoch_steps

    def limit(self, short: bool = False) -> str:
        """Which limit ends the run, in words; ``short``: a few words for a header."""
        max_ = f"{self.max_steps_from} {self.max_steps}"
        epochs = f"{self.epochs} epoch{'s' if self.epochs != 1 else ''}"
        if self.by_epochs:
            if short:
                return epochs
            past = (f"; {max_} is past it" if self.max_steps > self.epoch_steps
                    else f" = {max_}" if self.max_steps else "")
            return f"{self.epoch_steps} steps = {epochs} of the data (optim.epochs){past}"
        if short:
            return max_
        return f"{self.max_steps} steps: {max_} ({epochs} of the data would be {self.epoch_steps})"

    def summary(self) -> str:
        """One line for the logs (train.log, the console, the dashboard's log)."""
        span = (f"from step {self.start_step} to {self.total_steps}" if self.start_step
                else f"{self.total_steps} steps")
        return (f"training {span} on {self.targets} target(s) + {self.drafters} drafter(s): "
                f"{self.limit()}" + (f"; {self.recipe}" if self.recipe else ""))


@dataclass(frozen=True)
class StateChanged(Event):
    state: str
    previous: str
    reason: str = ""
    kind: ClassVar[str] = "StateChanged"
    keep_when_behind: ClassVar[bool] = True


@dataclass(frozen=True)
class WorkerStatus(Event):
    """One worker's own phase: one of WORKER_STATUSES."""

    worker: str  # e.g. "target-0", "drafter-0", "loader-0", "telemetry"
    role: str  # target | drafter | loader | telemetry | sink
    device: str  # "cuda:3", "cpu"
    status: str
    detail: str = ""
    kind: ClassVar[str] = "WorkerStatus"


@dataclass(frozen=True)
class TargetMetrics(Event):
    worker: str
    device: str
    batches: int
    tokens_per_s: float
    blocked_frac: float  # share of recent time spent waiting on a full HS queue
    starved_frac: float = 0.0  # share of recent time spent waiting on an empty prefetch queue
    kind: ClassVar[str] = "TargetMetrics"
    sets_state: ClassVar[bool] = False


@dataclass(frozen=True)
class DrafterMetrics(Event):
    """Where one drafter thread's time went since its last report (shares of wall time)."""

    worker: str
    device: str
    steps: int  # optimizer steps in the window
    waiting_frac: float  # waiting for features on an empty HS queue
    compute_frac: float  # forward + backward (launching them; the GPU may still be busy after)
    barrier_frac: float  # waiting at the step for the other drafters
    step_frac: float  # the optimizer step this thread ran (reduce, the step's one GPU sync, AdamW)
    kind: ClassVar[str] = "DrafterMetrics"
    sets_state: ClassVar[bool] = False


@dataclass(frozen=True)
class StepMetrics(Event):
    step: int
    epoch: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    samples_per_s: float
    tau_tf: float  # teacher-forced tau on this step's blocks
    drafter_wait_frac: float = 0.0  # share of step time drafters waited on an empty HS queue
    target_blocked_frac: float = 0.0  # share of time targets waited on a full HS queue
    padding_frac: float = 0.0
    samples: int = 0  # samples in this optimizer step
    total_steps: int = 0  # planned optimizer steps of the run (known once the data is planned)
    # drafter.objective dspark: its loss's three terms, each a weighted mean (the loss is
    # 0.1 CE + 0.9 TV + 1.0 confidence BCE by default); -1 = not DSpark (or an older file)
    loss_ce: float = -1.0
    loss_tv: float = -1.0
    loss_conf: float = -1.0
    # drafter.objective dflash2: the selector's K-way cross-entropy (its weighted mean; the
    # loss is loss_ce + selector_alpha x this) and its hit rate, the weighted share of labels
    # among the draft's K candidates (named loss_ as every family term is); -1 = not DFlash2
    loss_sel: float = -1.0
    loss_hit: float = -1.0
    kind: ClassVar[str] = "StepMetrics"
    sets_state: ClassVar[bool] = False


@dataclass(frozen=True)
class EvalResult(Event):
    """One evaluation's measures of acceptance (acceptance.py says what each means). A
    measure not taken is -1 (so events.jsonl files written before it existed still replay)."""

    step: int
    tau: float  # (a) exact tau on the held-out prompts
    acceptance: list  # histogram: acceptance[k] = rounds that accepted k drafted tokens
    prompts: int
    tau_tf_target: float = -1.0  # (b) teacher-forced on the target's own decoding of them,
    # at the anchors decoding used (its rounds' starts); and at every position of that text:
    tau_tf_target_all: float = -1.0
    tau_tf_heldout: float = -1.0  # (c) teacher-forced on held-out samples of the data
    tau_tf_train: float = -1.0  # (d) teacher-forced in training, mean over recent steps
    agreement: float = -1.0  # share of trained labels = the target's greedy next token
    agreement_positions: int = 0  # labels the agreement was measured on (0: not measured)
    findings: list = field(default_factory=list)  # kinds raised: "mismatch", "data", "overfit"
    seconds: float = 0.0  # the evaluation's wall time
    # A drafter with a confidence head (DSpark): the head's calibration on the exact-decoding
    # rounds, models/dspark/calibration.Calibration as a dict ({} = none); acceptance.calibration_*
    # words it, calibration.Calibration.from_dict reads it back.
    calibration: dict = field(default_factory=dict)
    # (a) again with each slot's unary argmax in place of the drafter's selector walk (DFlash2,
    # held-out prompts): tau minus it is what the selector gains; -1 = not measured
    tau_unary: float = -1.0
    # The prompts evaluated: "" = the held-out prompts of the data (every measure, the findings);
    # a name = that set of eval.prompt_sets (exact tau and its histogram only; the teacher-forced
    # measures and the agreement -1). Older events.jsonl files, without it, are held-out ones.
    prompt_set: str = ""
    # Serving's counts (acceptance.py, SERVING): proposed[j] = rounds that proposed j drafts;
    # accepted drafts per round without the bonus (tau - 1); per draft position k = 1 .., the
    # rounds that accepted draft k over those that proposed it; accepted / proposed drafts. An
    # older events.jsonl has none ([] / -1: its lines and keys stay as they were).
    proposed: list = field(default_factory=list)
    accept_length_without_bonus: float = -1.0
    acceptance_rate_per_position: list = field(default_factory=list)
    draft_acceptance_rate: float = -1.0
    drafter_dtype: str = ""  # the dtype the drafter decoded in (eval.drafter_dtype); "": older
    # Acceptance by context length (context_buckets.py): per bucket of the rounds' positions,
    # {"bucket", "from", "to", "rounds", "accepted", "tau"}; [] in an older events.jsonl.
    context: list = field(default_factory=list)
    kind: ClassVar[str] = "EvalResult"


@dataclass(frozen=True)
class MemoryPlan(Event):
    """Preflight plan: one row per device with its components in bytes."""

    rows: list  # [{"device", "role", "components": {name: bytes}, "total", "free", "fits"}]
    fits: bool = True
    kind: ClassVar[str] = "MemoryPlan"


@dataclass(frozen=True)
class Checkpoint(Event):
    step: int
    path: str
    seconds: float
    reason: str = "periodic"  # periodic | abort | final | best (checkpoints/best now names it)
    tau: float = -1.0  # with reason "best": the exact tau that made it the best so far
    prompt_set: str = ""  # with reason "best": the set that tau is on (eval.best_set; "" held-out)
    bytes: int = 0  # on disk (0: not known, e.g. "best" naming an existing one)
    blocked_s: float = 0.0  # training stopped for this; ``seconds`` is staging to durable
    kind: ClassVar[str] = "Checkpoint"
    keep_when_behind: ClassVar[bool] = True


@dataclass(frozen=True)
class Log(Event):
    level: str  # debug | info | warning | error
    source: str
    message: str
    kind: ClassVar[str] = "Log"


@dataclass(frozen=True)
class Error(Event):
    # One of ERROR_KINDS; the same name as the ``error_kind`` attribute an exception may carry
    # (errors.classify). Plain "kind" is the event type tag.
    error_kind: str
    source: str  # worker or sink name, e.g. "target-3"
    message: str
    traceback: str = ""
    hint: str = ""
    fatal: bool = True
    device: str = ""
    phase: str = ""  # lifecycle state or worker phase when it happened
    kind: ClassVar[str] = "Error"
    keep_when_behind: ClassVar[bool] = True
    old_names: ClassVar[dict[str, str]] = {"kind_": "error_kind"}


@dataclass(frozen=True)
class SinkStatus(Event):
    """A sink says where its output goes (wandb URL or offline folder, log paths)."""

    sink: str
    status: str  # ok | disabled | failed
    detail: str = ""
    kind: ClassVar[str] = "SinkStatus"


@dataclass(frozen=True)
class RunEnded(Event):
    status: str  # finished | aborted | failed
    step: int
    seconds: float
    reason: str = ""
    kind: ClassVar[str] = "RunEnded"
    keep_when_behind: ClassVar[bool] = True


@dataclass(frozen=True)
class Stall(Event):
    """A worker made no progress for longer than several times its own usual interval (watchdog.py)
    and where its thread is now; ``cleared``: it made progress again. A warning, never fatal."""

    worker: str
    phase: str
    seconds: float  # silent this long when reported
    where: str  # what its stack says it does, e.g. "compiling: torch/_inductor/... (...)"
    stack: str  # its Python stack, innermost frame last ("" when cleared)
    cleared: bool = False
    kind: ClassVar[str] = "Stall"
    keep_when_behind: ClassVar[bool] = True


@dataclass(frozen=True)
class NodeStatus(Event):
    """One node of a multi-node run at a step boundary, from the summary every node sends in the
    step exchange (node_link.py): published on every node, so node 0's dashboard shows all."""

    node: int
    host: str
    step: int
    samples_per_s: float = 0.0  # this node's drafters alone
    tokens_per_s: float = 0.0
    hs_depth: int = 0
    hs_capacity: int = 0
    prefetch: list = field(default_factory=list)  # [[depth, capacity], ...] per target
    gpu_mem: list = field(default_factory=list)  # bytes allocated per CUDA device it uses
    allreduce_s: float = 0.0  # its last gradient all-reduce across nodes, seconds
    ending: str = ""  # "" while it trains; else the status it ended with (failed, aborted, ...)
    error: str = ""  # its last error's message
    kind: ClassVar[str] = "NodeStatus"
    sets_state: ClassVar[bool] = False
    in_text_log: ClassVar[bool] = False


@dataclass(frozen=True)
class DeviceHours(Event):
    """The device time the run has held so far (pipeline/hours_meter.py): every device it holds
    counts wall time from the run's start to its end, split equally among the workers on it, on
    every node; cumulative across resumes (each checkpoint records the figure and a resume goes
    on from it). A CPU run holds the host, counted as one device in ``host_*`` (0 GPU-hours).
    Published periodically, before each evaluation (its x in the report's tau against
    GPU-hours), as each checkpoint's state is taken and at the end."""

    step: int
    gpu_target: float = 0.0  # GPU-hours of the target workers
    gpu_drafter: float = 0.0  # GPU-hours of the drafter workers
    host_target: float = 0.0  # host-hours (CPU runs) of the target workers
    host_drafter: float = 0.0
    # Hours earlier segments of this run folder held that this figure leaves out: a crashed
    # segment's time after its last checkpoint, attempts that failed loading, a resume from an
    # older checkpoint (the run folder's device_hours.json keeps them). GPU and host apart.
    lost_gpu: float = 0.0
    lost_host: float = 0.0
    devices: int = 0  # devices held now, every node's (a CPU run: 1 per node)
    price: float = 0.0  # cost.gpu_hour_price in force (0: no price)
    currency: str = ""
    reason: str = "periodic"  # periodic | eval | checkpoint | end
    since_step: int = 0  # counted from this step (a resume of a checkpoint that has no figure)
    kind: ClassVar[str] = "DeviceHours"
    sets_state: ClassVar[bool] = False

    @property
    def gpu_hours(self) -> float:
        return self.gpu_target + self.gpu_drafter

    @property
    def host_hours(self) -> float:
        return self.host_target + self.host_drafter


EVENT_TYPES: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (
        RunStarted, StateChanged, WorkerStatus, LoadProgress, GpuSample, HostSample, QueueDepth,
        TargetMetrics, DrafterMetrics, StepMetrics, EvalResult, MemoryPlan, Checkpoint, Log, Error,
        SinkStatus, CheckpointProgress, RunEnded, Stall, NodeStatus, TrainingPlan, DeviceHours,
        BuildProgress,
    )
}


def state_after(state: str, event: Event) -> str:
    """The lifecycle state a run is in after ``event``: controllers that do not run the engine
    themselves (replay, attach) track it from the stream this way."""
    if isinstance(event, StateChanged):
        return event.state
    if isinstance(event, RunEnded):
        return event.status
    return state


# Each type's field names, looked up once: a multi-day events.jsonl has millions of lines.
_FIELD_NAMES: dict[type[Event], frozenset[str]] = {}


def from_dict(d: dict[str, Any]) -> Event:
    d = dict(d)
    cls = EVENT_TYPES[d.pop("event")]
    for old, new in cls.old_names.items():
        if old in d and new not in d:
            d[new] = d.pop(old)
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = frozenset(f.name for f in dataclasses.fields(cls))
    return cls(**{k: v for k, v in d.items() if k in names})


def from_json(line: str) -> Event:
    return from_dict(json.loads(line))
