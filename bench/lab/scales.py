"""The two scales of the lab chain: ``tiny`` (the whole chain on a CPU in a few minutes, to prove
it) and ``lab`` (issue 50's defaults, on one GPU). Every knob of every stage is a field here, with
why it has its value; the caches' keys are built from these fields, so changing one rebuilds
what depends on it (and a folder built under other values is refused, not mixed in).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

# Bump when the code changes what a stage builds from the same fields: every key changes with it.
LAB_VERSION = "lab-v1"


@dataclass(frozen=True)
class Scale:
    name: str
    # -- the corpus (corpus.py) -------------------------------------------------------------------
    # Top-level packages whose .py / .pyi / .md / .rst files (and their distribution's METADATA,
    # the package's long description) are the text; one missing on a machine is left out and
    # named in the target's record (the corpus digest then differs: another target).
    packages: tuple[str, ...]
    heldout_per_mille: int = 40  # files whose path hash falls here: never trained, the eval sets
    chat_per_mille: int = 60  # ... here: the prompts of the drafter's conversations only
    max_file_bytes: int = 256_000  # larger files are generated tables more than code
    # -- the tokenizer (tokenizer.py) -------------------------------------------------------------
    vocab_size: int = 16384  # BPE ids including <|endoftext|> and <|MASK|> (the last id)
    tokenizer_train_bytes: int = 48_000_000  # text the merges are learned from (train files)
    # -- the target (target.py): Qwen3's layout, tied embeddings ---------------------------------
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 2048
    max_position_embeddings: int = 2048
    # 79M tokens, ~2.2 passes over the 36M training tokens: 299-318 s on one H200 (0.25-0.27
    # s/step; bench/BENCHMARKS.md), so the target and the data take under 10 minutes
    train_steps: int = 1200
    train_batch: int = 64  # windows per step
    train_seq: int = 1024  # tokens per window
    train_lr: float = 1.5e-3
    train_warmup: int = 100
    # The target's training may not pass this many minutes (0 = no cap): measured after its first
    # steps, a longer projection stops the build naming the train_steps that fit (the steps stay
    # what the command says, never cut by the clock: the same command, the same target).
    train_minutes_cap: float = 6.0
    heldout_windows: int = 64  # windows of the held-out files the reported loss is taken on
    # -- the drafter's data (conversations.py, prompt_sets.py) -----------------------------------
    conversations: int = 8192
    prompt_min_tokens: int = 64  # a user turn: a file's first lines, this long or longer ...
    prompt_max_tokens: int = 1024  # ... and no longer
    answer_tokens: int = 256  # the target's greedy continuation, at most
    # prompts generated together: the 8192 took 215 s at 256 and 169 s at 512 on one H200, a
    # batch's 256 steps bound by launches more than by the GPU's work (KV cache at 512: ~8 GB)
    gen_batch: int = 512
    # The eval sets' prompts are spread evenly over these context lengths (tokens), so tau can be
    # read by context length; a bucket the held-out files cannot fill is left short.
    set_buckets: tuple[int, ...] = (64, 128, 256, 512, 1024)
    set_prompts: int = 64  # per set
    # -- the recipe (recipe.py) --------------------------------------------------------------------
    drafter_layers: int = 2  # a sixth of the target's depth: the drafter stays cheap beside it
    layer_ids: tuple[int, ...] = ()  # () = the engine's default spread of 5 layers
    num_anchors: int = 128
    token_budget: int = 32768
    max_seqs_per_batch: int = 64
    drafter_lr: float = 1e-3
    probe_steps: int = 60  # steps of the timing run per objective (median of its second half)
    train_seconds: float = 100.0  # each run trains this long (equal GPU time): steps from its probe
    seeds: tuple[int, ...] = (0, 1)
    # Runs trained at once on the one GPU (seed-major: all four of two seeds together). Steps
    # still come from the probes, timed alone, so each objective gets the same GPU time as if
    # trained alone; only the wall clock shrinks, and little: four side by side took 3.72x one
    # alone on an H200 (each run's own target forward keeps the GPU busy), 7% saved.
    parallel_runs: int = 4
    # Changes to the runs' configs, "[OBJECTIVE:]SECTION.KEY=VALUE" (YAML values), e.g.
    # "dspark:drafter.markov_rank=64" or "drafter.num_anchors=256": one setting at a time against
    # the defaults (issue 50's item 4). Runs and probes made under them carry a tag of them in
    # their names, and their evaluation and table go to eval-vTAG/ and recipe-vTAG.md, so they
    # sit beside the default runs in the same --dir (the target and data are shared); so do runs
    # of any other recipe field changed by --set (recipe.RECIPE_FIELDS, e.g. train_seconds).
    # Items that all name one objective train that objective only.
    run_sets: tuple[str, ...] = ()
    dtype: str = "bfloat16"  # the target's in the runs (drafter: its served bf16)
    eval_new_tokens: int = 128
    eval_batch: int = 16
    run_eval_prompts: int = 8  # the runs' own held-out exact tau at their end (0 = none) ...
    run_eval_new_tokens: int = 64  # ... on this many new tokens
    device: str = "cuda"

    @property
    def arch(self) -> dict:
        """The Qwen3 config's shape fields."""
        return {k: getattr(self, k) for k in (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "max_position_embeddings")}

    def key_of(self, *names: str) -> str:
        """A short hash of the named fields: what a cached stage depends on."""
        picked = {"version": LAB_VERSION, **{n: getattr(self, n) for n in names}}
        return hashlib.sha256(json.dumps(picked, sort_keys=True, default=list).encode()
                              ).hexdigest()[:12]

    def replace(self, **changes) -> "Scale":
        return dataclasses.replace(self, **changes)


CORPUS_FIELDS = ("packages", "heldout_per_mille", "chat_per_mille", "max_file_bytes")
TOKEN_FIELDS = CORPUS_FIELDS + ("vocab_size", "tokenizer_train_bytes")
TARGET_FIELDS = TOKEN_FIELDS + (
    "hidden_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "max_position_embeddings", "train_steps", "train_batch", "train_seq", "train_lr",
    "train_warmup", "heldout_windows")
DATA_FIELDS = ("conversations", "prompt_min_tokens", "prompt_max_tokens", "answer_tokens",
               "gen_batch", "set_buckets", "set_prompts")

# Present in this project's environment and on the GPU machines' image alike (torch, transformers
# and what they pull in), largest first: 157M characters here, 37.9M training tokens at the
# vocabulary of 16384 (bench/BENCHMARKS.md, "The lab chain").
LAB_PACKAGES = ("transformers", "torch", "sympy", "numpy", "matplotlib", "networkx", "pygments",
                "huggingface_hub", "setuptools", "rich", "_pytest", "fsspec", "packaging",
                "jinja2", "click", "requests", "tqdm")

SCALES = {
    "lab": Scale(name="lab", packages=LAB_PACKAGES),
    # The demo target's shape (head_dim 32 runs the compiled attention on a GPU) with a BPE
    # vocabulary; three small packages the project depends on (~1.2 MB).
    "tiny": Scale(
        name="tiny", packages=("packaging", "jinja2", "yaml"), heldout_per_mille=100,
        chat_per_mille=150, vocab_size=1024, tokenizer_train_bytes=4_000_000,
        hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=256, max_position_embeddings=512, train_steps=300,
        train_batch=16, train_seq=128, train_lr=5e-3, train_warmup=20, heldout_windows=16,
        conversations=192, prompt_min_tokens=24, prompt_max_tokens=192, answer_tokens=32,
        gen_batch=64, set_buckets=(16, 64, 160, 400), set_prompts=8, drafter_layers=1,
        layer_ids=(1, 2, 3), num_anchors=16, token_budget=2048, max_seqs_per_batch=16,
        drafter_lr=6e-3, probe_steps=12, train_seconds=20.0, seeds=(0, 1), parallel_runs=1,
        dtype="float32",
        eval_new_tokens=32, eval_batch=8, run_eval_prompts=0, train_minutes_cap=0.0,
        device="cpu"),
}


def scale_named(name: str) -> Scale:
    try:
        return SCALES[name]
    except KeyError:
        raise ValueError(f"--scale {name!r}: use one of {', '.join(SCALES)}") from None


def with_settings(scale: Scale, settings: list[str]) -> Scale:
    """``scale`` with ``FIELD=VALUE`` settings applied (a tuple's VALUE comma-separated), each
    read as its field's type; ValueError names a field that is not one or a value of another
    type."""
    fields = {f.name: f for f in dataclasses.fields(Scale)}
    changes: dict = {}
    for item in settings:
        name, eq, text = item.partition("=")
        if not eq or name not in fields or name == "name":
            raise ValueError(f"--set {item!r}: want FIELD=VALUE with FIELD one of "
                             f"{', '.join(n for n in fields if n != 'name')}")
        current = getattr(scale, name)
        try:
            if isinstance(current, tuple):
                kind = int if "int" in str(fields[name].type) else str
                value = tuple(kind(v) for v in text.split(",") if v.strip())
            else:
                value = type(current)(text)
        except ValueError:
            now = ",".join(map(str, current)) if isinstance(current, tuple) else current
            raise ValueError(f"--set {item!r}: {name} takes a {type(current).__name__}, as its "
                             f"value now: {name}={now}") from None
        changes[name] = value
    return scale.replace(**changes) if changes else scale

