"""The run configuration's keys: one dataclass per section of config.yaml (the eval section's in
eval_schema.py), each key a field made by ``key`` (keys.py), which holds its default, what it does
and its valid range in one place; the ranges' check is here too (``check_range``: loading calls
it for every key, load.py). ``--set``'s help and docs/config.md list the keys from here
(reference.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, NamedTuple

from dflash_core.config.errors import ConfigError
from dflash_core.config.eval_schema import EvalConfig, PromptSetConfig  # noqa: F401 (re-exported)
from dflash_core.config.keys import Range, key  # noqa: F401 (re-exported)
from dflash_core.families import dflash2, dspark  # the families' defaults, written once there

@dataclass
class RunConfig:
    """The run: its folder, seed and length."""
    name: str = key("dflash", "Run folder name under output_dir: runs/<name>/.")
    output_dir: str = key("runs", "Parent folder of run folders.")
    seed: int = key(0, "Seeds the data order, the anchors and the drafter's init.",
                    unbounded="any integer")
    max_steps: int = key(0, "Optimizer steps; 0 = run all epochs of optim.epochs. --max-steps N "
                            "is another spelling of --set run.max_steps=N.", ge=0)
    log_every_s: float = key(5.0, "Period of the headless progress line and of train.log's "
                                  "metrics lines, seconds; 0 = a line per event.", ge=0)


@dataclass
class TargetConfig:
    """The frozen target model whose layer outputs the drafter learns from."""
    path: str = key("builtin:tiny", """Local HF folder (config.json + *.safetensors), or
        "builtin:tiny" for the embedded demo target.""")
    dtype: Literal["bfloat16", "float16", "float32"] = key(
        "bfloat16", "Dtype of the target's weights and features on the GPU.")
    layer_ids: list[int] = key([], """Target layers whose OUTPUTS feed the drafter (0-based).
        Empty = num_features layers spread from 1 to N-3 (one alone: the middle layer), never
        the last: transformers reads its output after the final norm, vLLM and SGLang before,
        so naming it here is accepted with a warning at preflight.""")
    num_features: int = key(5, "k, the number of target layers fed to the drafter, used when "
                               "layer_ids is empty.", gt=0)
    attn_implementation: str = key("sdpa", """HF attention implementation for the target ("sdpa",
        "flash_attention_2", "flex_attention", "eager"). One the target's class cannot run is
        settled at preflight: sdpa on gpt-oss (its attention sinks) becomes eager, said in the
        log; any other is refused with the ones it can.""")
    trust_remote_code: bool = key(False, """Run the Python files a target folder ships for its
        model (config.json "auto_map", e.g. Kimi-K2). Off: such a target is refused at preflight,
        naming this key; a model transformers knows is always built from transformers' own code.
        Never asked on the terminal.""")
    gpus_per_copy: int = key(1, """GPUs one copy of the target spans (a target group, for a
        target larger than one card): layout.targets is cut into copies of this many consecutive
        GPUs, each GPU a process of its own, the model split between them by transformers
        (docs/targets.md, "Targets larger than one GPU"). 1 = every GPU of layout.targets holds a
        whole copy, in the engine's own process.""", ge=1)
    parallel: Literal["sharded", "shared"] = key("sharded", """How a copy of several GPUs is
        split. "sharded" = fully-sharded (FSDP; a mixture-of-experts target's experts split
        between the GPUs too): every GPU takes batches of its own, as a one-GPU target does; the
        choice for mixture-of-experts targets. "shared" = tensor parallel (with expert parallel
        on a MoE target): every GPU of the copy runs the same batch; for dense targets whose
        layers do not fit one card.""")
    expert_parallel: bool = key(True, """In a copy of several GPUs, split a mixture-of-experts
        target's experts between them (expert parallel). false: under "sharded", FSDP shards
        them with the rest; under "shared" it is refused (tensor parallel alone keeps every
        expert on every GPU).""")


@dataclass
class DrafterConfig:
    """The drafter being trained and its loss (docs/algorithm.md)."""
    objective: Literal["dflash", "dspark", "dflash2"] = key("dspark", """The drafter and its training
        objective: "dspark" = DSpark (arXiv 2607.05147, docs/algorithm.md "DSpark"): the anchor
        slot predicts too (B inputs give B drafts), a Markov head of rank markov_rank and a
        confidence head, trained with ce_weight CE + tv_weight TV against the target's own
        distribution + conf_weight confidence BCE; the target then also sends its post-norm
        last hidden state. "dflash" = DFlash (the same backbone; the anchor slot is input only:
        B inputs give B-1 drafts; cross-entropy on the data's tokens). With dspark, a config
        that leaves block_size or loss_chunk unset gets 7 and 1024 (the reference's B; its
        loss holds ~2.2x DFlash's memory per row); with dflash, their own defaults (16, 4096).
        DSpark is the default because it won where the target is real: on a code target
        trained for it, at equal GPU time, its tau was 50% higher on both sets and at every
        context length (2.99 +- 0.07 against 1.99 +- 0.08 on code, 2 seeds; bench/BENCHMARKS.md
        "Lab scale on one H200"); on the demo's byte-level toy the two tie. DFlash is the
        choice for a server without DSpark's method. "dflash2" = DFlash2 (docs/algorithm.md
        "DFlash2"): DFlash's backbone with each attention and MLP sublayer wrapped in a grouped
        dynamic causal convolution over block positions (conv_kernel_size, conv_group_size) and
        a candidate selector choosing each draft among the top selector_top_k unary candidates
        by a greedy walk (selector_rank); trained with DFlash's loss + selector_alpha x the
        selector's K-way cross-entropy; B inputs give B-1 drafts, 8 when a config does not set
        block_size; needs the target's full vocabulary; drafter.init_from may name a DFlash
        checkpoint (the convolutions start at identity, the selector at no-op).""")
    num_layers: int = key(5, "L, the drafter's decoder layers (paper: 5 for 4B/8B targets).",
                          gt=0)
    block_size: int = key(16, """B, the tokens of a block: an anchor and the positions it
        predicts (dflash: B-1 drafts; dspark: B drafts, 7 when a config does not set it;
        dflash2: B-1 drafts, 8 when a config does not set it).""",
                          ge=2)
    mask_token_id: int = key(-1, "Id of the MASK token; -1 = the last id of the target vocab.",
                             ge=-1)
    num_anchors: int = key(512, "A, anchors drawn per sequence per epoch (the most, with a "
                                "density).", gt=0)
    anchors_per_1k_tokens: float = key(0.0, """A density instead of a count: a sample with P
        trainable positions gets ceil(this x P / 1000) anchors, 1 to num_anchors, so a 100k-token
        answer is not supervised at 0.5% of its positions while a 2k one is at 25% (512 each).
        0 = up to num_anchors each (docs/algorithm.md, "Anchors").""", ge=0)
    loss: Literal["dflash", "dpace"] = key("dflash", """The loss's slot weights
        (docs/algorithm.md, "The loss"): "dflash" = the paper's fixed decay exp(-(k-1)/gamma);
        "dpace" = D-PACE (arXiv 2605.18810), weights from the step's own cross-entropies, w_j =
        sum over m >= j of prod over i <= m of q_i with q = (1 - dpace_alpha) exp(-CE) +
        dpace_alpha, detached. The default stays "dflash": on the demo D-PACE's exact tau was
        +0.00..+0.29 per seed after 512 steps, inside the seed spread; its step costs 0.5-5% more
        (bench/BENCHMARKS.md, "Training recipe").""")
    gamma: float = key(0.0, """The slot weights' decay; 0 = dflash: 7 for B=16, 5 for B=10, 4 for
        B=8, else B/2.3; dspark: 4 (its weights exp(-j/gamma), slot 0 weighing 1).""", ge=0)
    dpace_alpha: float = key(0.5, "D-PACE's floor of q: 1 = fixed linear weights B-j; 0 = "
                                  "exp(-CE).", ge=0, le=1)
    loss_chunk: int = key(4096, """Block tokens per chunk of the chunked loss (its logits exist
        for one chunk at a time); dspark: 1024 when a config does not set it.""", gt=0)
    fused_loss: Literal["auto", "on", "off"] = key("auto", """The loss as one streaming pass
        per row on the GPU (models/fused_loss: Triton kernels beside the lm_head's matmuls; the
        gradient made in the forward pass, nothing rows x vocabulary kept, no logits
        recomputed), for DFlash's cross-entropy (either drafter.loss), DSpark's CE + TV +
        confidence and DFlash2's CE + selector CE (its candidates the top-K of the chunk's
        logits). The same loss as the torch path, which stays the CPU's and the reference
        (they agree to float32 noise). auto = fused where the drafters run on CUDA and Triton is
        installed (it ships with torch's CUDA wheels), torch elsewhere; on = fused, refused at
        preflight where it cannot run; off = torch. Its loss chunk holds one logits buffer in
        the lm_head's dtype (dspark: three) instead of the torch path's float32 arrays. Measured
        in bench/BENCHMARKS.md ("The fused loss"): an 8B DSpark step 1.08 -> 0.68 s.""")
    markov_rank: int = key(dspark.MARKOV_RANK, """dspark: r, the rank of the Markov head (W1 [V, r], W2 r -> V),
        below the target's vocabulary.""", gt=0)
    ce_weight: float = key(dspark.LOSS_WEIGHTS[0], "dspark: the weight of the cross-entropy on the data's tokens.",
                           ge=0)
    tv_weight: float = key(dspark.LOSS_WEIGHTS[1], """dspark: the weight of the total variation (L1) between the
        drafter's and the target's distributions; ce_weight + tv_weight must be above 0.""",
                           ge=0)
    conf_weight: float = key(dspark.LOSS_WEIGHTS[2], """dspark: the weight of the confidence head's loss; 0 = no
        confidence head (neither trained nor saved, no calibration).""", ge=0)
    conv_kernel_size: int = key(dflash2.CONV_KERNEL_SIZE, """dflash2: T, the taps of each
        sublayer's convolution over block positions (slot p mixes slots p-T+1..p of its own
        block).""", gt=0)
    conv_group_size: int = key(dflash2.CONV_GROUP_SIZE, """dflash2: G, channels that share one
        dynamic coefficient; must divide the drafter's width.""", gt=0)
    selector_rank: int = key(dflash2.SELECTOR_RANK, """dflash2: r, the rank of the selector's
        codebooks (predecessor and successor, each [V, r]) and of its context gate [r, H].""",
        gt=0)
    selector_top_k: int = key(dflash2.SELECTOR_TOP_K, """dflash2: K, the unary candidates the
        selector chooses among per slot (at most the vocabulary).""", gt=0)
    selector_alpha: float = key(dflash2.SELECTOR_ALPHA, """dflash2: the weight of the
        selector's K-way cross-entropy beside DFlash's loss (normalised by the same slot
        weights).""", ge=0)
    selector_missing: Literal["drop", "inject"] = key(dflash2.SELECTOR_MISSING_DEFAULT,
        """dflash2: a label outside the draft's top-K in the selector term: "drop" = the slot
        gives no selector loss (SpecForge, NeMo Automodel); "inject" = the label replaces the
        K-th candidate (speculators). drop is the default: on the demo the two tie at K 16
        (5.19 against 5.20, 3 seeds: 99% of the labels are among the candidates) and drop was
        ahead on every seed at K 2 (+0.34, inside the seed spread; bench/BENCHMARKS.md, "DFlash2
        against DFlash and DSpark on the demo").""")
    micro_block_tokens: int = key(65536, """Block tokens (sequences x anchors x block) per drafter
        forward; a batch with more is split into sequence groups, a sequence with more into
        passes of fewer anchors, gradients accumulated: bounds activation memory.""", gt=0)
    recompute: Literal["auto", "on", "off"] = key("auto", """Recompute each drafter layer in
        backward (torch.utils.checkpoint) instead of keeping its activations: what lets a long
        sample fit, for about a third more drafter compute. auto = on when the memory plan says
        the drafter GPU does not fit without it, or a step runs out of memory at its smallest
        pass (docs/architecture.md, "Memory plan").""")
    hidden_size: int = key(0, "Width override; 0 = the target's (the usual choice).", ge=0)
    intermediate_size: int = key(0, "Width override; 0 = the target's.", ge=0)
    num_attention_heads: int = key(0, "Width override; 0 = the target's.", ge=0)
    num_key_value_heads: int = key(0, "Width override; 0 = the target's. The attention heads "
                                      "must be a multiple of it.", ge=0)
    dtype: Literal["bfloat16", "float32"] = key("bfloat16", """Autocast dtype on GPU (CPU trains
        in float32), and the dtype the drafter is served in: checkpoints' model.safetensors holds
        the weights in it (the float32 master weights are in the training state).""")
    init_from: str = key("", "Optional interchange-format checkpoint to start from.")


@dataclass
class DataConfig:
    """The training data and how it is batched (docs/data.md)."""
    path: str = key("builtin:demo", """Tokenized data: a datasets save_to_disk folder or a folder
        of .arrow / .parquet files with columns input_ids and optional loss_mask.
        "builtin:demo" = generated by the demo target.""")
    token_budget: int = key(65536, "Max tokens (padded) in one target batch; at least "
                                   "max_length.", gt=0)
    max_seqs_per_batch: int = key(64, "Max sequences in one batch.", gt=0)
    max_length: int = key(3072, "Longer samples are truncated to their first max_length "
                                "tokens (data prepare --max-length cuts them so and counts the "
                                "cuts); a sample needs 2+ tokens to train on.", ge=2)
    prefetch_batches: int = key(4, "Capacity of each target's prefetch queue.", gt=0)
    eval_prompts: int = key(8, "Held-out samples used for exact tau; 0 = no evaluation.", ge=0)
    balance_steps: bool = key(True, """Order each epoch's batches so that the batches of one
        optimizer step (one per data-parallel drafter) cost the drafters alike: sorted by drafter
        work (rows x anchors) into runs of a few steps, the runs in random order. Drafters step
        together, so a step lasts as long as its dearest batch, and at one token budget a batch
        of short samples (many rows) costs the drafter up to ~4x one of long samples. false =
        batch order fully shuffled. No effect with one drafter. A resumed run keeps the order its
        checkpoint was written with.""")
    allow_changed_data: bool = key(False, """A resume refuses data other than what its checkpoint
        trained on (the manifest's hash and the shards' names and sizes, recorded in every
        checkpoint), naming both: the checkpoint's data position (epoch, batches done) names
        batches of that data's plan. true = resume on the data of data.path deliberately; the
        position then counts its batches (in the epoch it resumes, some of its samples are
        skipped or repeated).""")


@dataclass
class LayoutConfig:
    """Which devices the targets and drafters run on, and the memory they may use."""
    device: Literal["auto", "cuda", "cpu"] = key("auto", "auto = cuda when available.")
    targets: list[int] = key([0], "Target GPU indices (CPU: worker ids); non-empty, distinct.")
    drafters: list[int] = key([0], "Drafter GPU indices; non-empty, distinct.")
    hs_queue: int = key(8, """Capacity of the hidden-state queue from targets to drafters
        (batches). Each target queues at most ceil(hs_queue / targets) of them, and they stay on
        its GPU until a drafter takes them.""", gt=0)
    gpu_memory_gib: float = key(0.0, """Plan for and enforce (per-process memory fraction) a card
        of this many GiB on every GPU; 0 = the card's own size. Rehearses the real node's cards on
        bigger ones (e.g. 95 on an H200 for a 96 GB RTX PRO 6000, which offers about 95.6
        GiB).""", ge=0)
    auto_fit: bool = key(False, """When the memory plan does not fit: false = refuse, naming the
        sizes that would fit; true = lower drafter.micro_block_tokens, drafter.loss_chunk,
        layout.hs_queue, data.token_budget to the largest values that fit and log the
        choice.""")


@dataclass
class OptimConfig:
    """The optimizer and its schedule (warmup, then cosine)."""
    name: Literal["adamw", "muon"] = key("adamw", """"adamw" = AdamW on every drafter parameter;
        "muon" = torch.optim.Muon (torch 2.9+) on the 2-D weight matrices (the layers' projections
        and fc) with AdamW on the norms (models/training/optimizers.py says why). The default stays
        "adamw": a Muon step takes 28% longer at the 27B shape (14% at 8B), and on the demo at
        equal wall time (400 Muon steps against 512 AdamW steps) Muon's exact tau was higher on
        every seed but inside the seed spread; after 80 steps it was beyond it
        (bench/BENCHMARKS.md, "Training recipe").""")
    lr: float = key(6e-4, "AdamW's peak learning rate (warmup then cosine).", gt=0, le=1)
    muon_lr: float = key(0.0, """Muon's peak learning rate, on the same schedule; 0 = optim.lr.
        Muon scales it per matrix to match AdamW's update size (Moonshot's match_rms_adamw), so
        AdamW's rate is the start.""", ge=0, le=1)
    weight_decay: float = key(0.0, "AdamW's weight decay.", ge=0, le=1)
    betas: list[float] = key([0.9, 0.95], "AdamW's two betas, each in [0, 1).")
    warmup_frac: float = key(0.04, "Share of the total steps with linear warmup.", ge=0, lt=1)
    min_lr_frac: float = key(0.0, "The cosine's floor as a share of lr.", ge=0, le=1)
    grad_clip: float = key(1.0, "Max gradient norm.", gt=0)
    grad_accum: int = key(1, "Batches per optimizer step (per drafter).", gt=0)
    epochs: int = key(6, "Passes over the data (run.max_steps may end the run sooner).", gt=0)


@dataclass
class CheckpointConfig:
    """When checkpoints are written and how many are kept (docs/checkpoint-format.md)."""
    every: int = key(1000, "Optimizer steps between checkpoints; 0 = only on abort and at the "
                           "end.", ge=0)
    keep: int = key(3, """Newest checkpoints kept; 0 = all. Preflight refuses a run whose disk
        cannot hold keep of them plus the one being written (checkpoint/size.py counts one),
        naming a keep that fits.""", ge=0)
    on_abort: bool = key(True, "Write a checkpoint when the run is aborted.")
    abort_budget_s: float = key(25.0, """An abort's checkpoint (SIGTERM, SIGINT, a) must be
        durable within this many seconds, so the process exits before the SIGKILL that systemd,
        Kubernetes and Slurm send 30 s after SIGTERM. When the measured write rate says it cannot
        be (the run says so at start), the abort writes none and names the periodic checkpoint
        that stands; one that runs over is abandoned.""", gt=0)
    writers: int = key(0, "Writers of a checkpoint, each writing a disjoint shard at once; 0 = "
                          "one per drafter.", ge=0)


@dataclass
class WandbConfig:
    """Weights & Biases logging (optional)."""
    enabled: bool = key(False, "Log step metrics and evaluations to W&B.")
    mode: Literal["offline", "online", "disabled"] = key("offline", "W&B's mode.")
    project: str = key("dflash", "W&B project.")
    entity: str = key("", "W&B entity; empty = W&B's default.")
    settings: dict[str, Any] = key({}, "Extra wandb.Settings keys, checked against the INSTALLED "
                                       "wandb at preflight.")


@dataclass
class TelemetryConfig:
    """GPU and host sampling, and the stall watchdog."""
    interval_s: float = key(1.0, "GPU / host sampling period, seconds.", gt=0)
    stall_floor_s: float = key(60.0, """A worker silent for longer than this, and than 5 times its
        own usual interval between signs of progress, is reported as stalled (with where its
        stack is); a compile can take minutes, so a stall is a warning, never a failure.""",
        gt=0)


@dataclass
class NodesConfig:
    """Several nodes; only read under torchrun with more than one node (docs/multi-node.md)."""
    timeout_s: float = key(900.0, """Joining and every collective across nodes (the exchange that
        starts each run, the step-boundary exchange, the gradient all-reduce) give up after this
        many seconds and fail the run naming the node that did not come. A killed node is noticed
        at once (its connection closes) and a node that fails before joining tells the others at
        once; this bounds a node that hangs or never starts. It must cover the longest wait of a
        healthy node for the others: the spread of start-up and target load times before the
        first step, node 0's checkpoint and evaluation at a step boundary, and after a restart
        node 0's teardown (its checkpoint) before the new run starts.""", gt=0)
    checksum_every: int = key(100, """Steps between the cross-node check that every node's drafter
        weights are identical (a checksum compared in the step exchange; a mismatch fails the run
        naming the step). It is also checked at the first step. 0 = the first step only.""", ge=0)


@dataclass
class CostConfig:
    """What the run's device time costs (docs/eval.md, "Cost"). The run always counts its
    GPU-hours, per role and across resumes; a price turns them into money."""
    gpu_hour_price: float = key(0.0, """Price of one GPU-hour in cost.currency; 0 = no price (the
        run, its report and dflash-tui eval show GPU-hours only). Every GPU the run holds counts
        wall time from the run's start to its end (loading, warm-up, evaluations and checkpoints
        included), on every node; a GPU shared by a target and a drafter is split between them
        equally. A run on the CPU counts host-hours instead, never priced.""", ge=0)
    currency: str = key("USD", "The price's currency, printed beside the money (USD, EUR, ...).")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    nodes: NodesConfig = field(default_factory=NodesConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    # Not a field: the drafter keys the loaded config itself set (load.config_from_dict), None
    # when built otherwise; --set's drafter.objective re-chooses the others' objective defaults.
    given = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name


class KeySpec(NamedTuple):
    """One key as the schema states it."""
    path: str  # "optim.lr"
    section: type  # OptimConfig
    default: Any
    doc: str
    range: Range | None  # numbers only
    unbounded: str  # a number with no range: why ("any integer")


def config_keys() -> Iterator[KeySpec]:
    """Every key of the config, section by section in the order config.yaml has them."""
    for sec in dataclasses.fields(Config):
        cls = sec.default_factory
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            yield KeySpec(f"{sec.name}.{f.name}", cls, default, f.metadata["doc"],
                          f.metadata["range"], f.metadata["unbounded"])


# The ranges of the numeric keys, by dotted path (read from the fields above).
RANGES: dict[str, Range] = {k.path: k.range for k in config_keys() if k.range is not None}
# Numeric keys with no range to hold them to, and why.
UNBOUNDED: dict[str, str] = {k.path: k.unbounded for k in config_keys() if k.unbounded}


def describe_range(key_path: str, rng: Range | None = None) -> str:
    """The valid range of a numeric key in words: ">= 0", "> 0", "in (0, 1]" (``rng``: a range
    not in RANGES, a key of a list's items such as eval.prompt_sets[].prompts)."""
    lo, hi, lo_in, hi_in = rng or RANGES[key_path]
    if hi is None:
        return f"{'>=' if lo_in else '>'} {lo}"
    return f"in {'[' if lo_in else '('}{lo}, {hi}{']' if hi_in else ')'}"


def check_range(key: str, value: float, rng: tuple | None = None) -> None:
    """Refuse a value outside its key's range (``rng``: a range not in RANGES, such as a list
    item's key eval.prompt_sets[0].prompts)."""
    lo, hi, lo_in, hi_in = rng or RANGES[key]
    below = lo is not None and (value < lo if lo_in else value <= lo)
    above = hi is not None and (value > hi if hi_in else value >= hi)
    if below or above or value != value:  # value != value: NaN
        said = describe_range(key, rng)
        raise ConfigError(key, f"must be {said}, got {value!r}",
                          hint=f"set {key} to a value {said} in config.yaml")


def key_value(cfg: Config, key_path: str) -> Any:
    """The value at a dotted key, e.g. "drafter.loss_chunk"."""
    section, name = key_path.split(".")
    return getattr(getattr(cfg, section), name)


def set_key_value(cfg: Config, key_path: str, value: Any) -> None:
    section, name = key_path.split(".")
    setattr(getattr(cfg, section), name, value)


def default_gamma(block_size: int) -> float:
    """Loss decay (docs/algorithm.md): 7 for B=16, 5 for B=10, 4 for B=8."""
    table = {16: 7.0, 10: 5.0, 8: 4.0}
    return table.get(block_size, max(1.0, block_size / 2.3))
