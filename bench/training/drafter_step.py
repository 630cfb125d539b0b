"""Figure 2: drafter optimizer steps through the engine's trainer (block-sparse FlexAttention,
chunked loss), 8B- and 27B-shaped, 3072-token samples, 512 anchors; DFlash (block 16), DSpark
(block 7, Markov rank 256, loss chunk 1024: the config's DSpark defaults) or DFlash2 (block 8,
loss chunk 4096, convolutions of 2 taps x groups of 16, selector rank 256 over the top 16: the
config's DFlash2 defaults).

    python bench/training/drafter_step.py [--samples 8] [--steps 6]
    # config.yaml's drafter (8 layers, one sequence per micro-group, loss chunk 4096), 27B shape:
    python bench/training/drafter_step.py --shapes 27B --layers 8 --micro 8192 --loss-chunk 4096 --samples 4
    # what token-budget batches of different lengths cost the drafter (data.balance_steps):
    python bench/training/drafter_step.py --shapes 8B --batches 64x256,32x512,16x1024,8x2048,5x3072
    # the training recipe (drafter.loss, optim.name): step time and peak memory of each
    python bench/training/drafter_step.py --shapes 8B --loss dpace --optim muon
    # DSpark next to DFlash: step time, samples/s, MFU, peak memory against the plan
    python bench/training/drafter_step.py --shapes 8B --objective dflash
    python bench/training/drafter_step.py --shapes 8B --objective dspark [--markov-rank 256]
    python bench/training/drafter_step.py --shapes 8B --objective dflash2 [--selector-top-k 16] \\
        [--selector-rank 256] [--conv-kernel-size 2] [--conv-group-size 16]
    # the loss alone, forward + backward of one micro-group (DSpark's CE+TV+confidence with its
    # recompute, and DFlash's chunked CE over the same rows: what the TV term costs)
    python bench/training/drafter_step.py --shapes 8B --objective dspark --time-loss
    python bench/training/drafter_step.py --shapes 8B --objective dflash --time-loss
    # DFlash2's CE + selector term against DFlash's chunked CE over the same rows; with the
    # fused loss (auto on CUDA), DFlash2's torch loss beside them
    python bench/training/drafter_step.py --shapes 8B --objective dflash2 --time-loss
    python bench/training/drafter_step.py --shapes 8B --objective dflash2 --time-loss --fused-loss off
    # the fused loss (drafter.fused_loss; auto = fused on CUDA with Triton) against the torch one
    python bench/training/drafter_step.py --shapes 8B --objective dspark --time-loss --fused-loss on
    python bench/training/drafter_step.py --shapes 8B --objective dspark --time-loss --fused-loss off
    # a CPU smoke run of this script (tiny shape; no MFU nor peak memory there)
    python bench/training/drafter_step.py --device cpu --shapes tiny --objective dspark --seq-len 96 \\
        --anchors 8 --samples 2 --steps 1 --warmup 1
    python bench/training/drafter_step.py --device cpu --shapes tiny --objective dflash2 --seq-len 96 \\
        --anchors 8 --samples 2 --steps 1 --warmup 1

MFU counts model FLOPs, forward x 3 for everything that backpropagates (the frozen lm_head too, as
this figure always has). DSpark's count adds its loss's extra matmuls: the lm_head over the
target's last hidden state at the block positions (forward only: it takes no gradient), the Markov
head's W2 (x 3) and the confidence head, and every slot predicts (DFlash: B-1 of B). DFlash2's
count (B-1 of B slots predict, as DFlash's) adds, all x 3 (everything of it backpropagates): per
block token and layer its two kernel projections y -> Delta (2 x 2 H 2TM, M = H/G groups) and
per block its four convolutions (each tap t over the B - t positions it reaches: beta + Delta, its
product with x, after the first the running sum, H each); per labelled slot its selector (the gate W_h h, 2 H r; A[a] x gate, r; the pair term, 2 r K
over the K candidates' codebook rows, or 2 r V where the loss takes the product over the whole
vocabulary, K r > V; U + pair, K). Its top-K choice carries no gradient and is a selection, not
arithmetic: not counted. Recompute in backward (every loss's chunks, DSpark's target
distribution, DFlash2's convolution coefficients) and the softmax / TV / softcap / logsumexp
passes are not counted. The fused loss (--fused-loss) recomputes nothing: its FLOPs are the same
matmuls (DFlash2's too: its candidates are the top-K of the chunk's logits buffer).
"""

from __future__ import annotations

import argparse
import faulthandler
import io
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import (FIXTURES, H200_BF16_PEAK, decoder_flops_per_token, env_line, gib, hf_config,
                    use_transformers_norm)
from dflash_core.config import ConfigError, config_from_dict
from dflash_core.data import Batch
from dflash_core.families import dflash2 as d2
from dflash_core.families.registry import settings as family_settings
from dflash_core.models import registry as drafter_kinds
from dflash_core.models.dflash2.loss import dflash2_loss
from dflash_core.models.dspark import loss as dspark_loss
from dflash_core.models.fused_loss import select as fused_loss
from dflash_core.models import objective as obj
from dflash_core.families.dspark import LOSS_CHUNK as DSPARK_LOSS_CHUNK
from dflash_core.families.dspark import MARKOV_RANK as DSPARK_MARKOV_RANK
from dflash_core.models.target.shape import model_shape
from dflash_core.models.training.replica import ANCHOR_PAD, prepare_batch
from dflash_core.models.training.trainer import make_replicas, reduce_and_step
from dflash_core.planning.drafter_memory import drafter_phases
from dflash_core.planning.memory import plan_memory

# name -> the target's config.json (the releases' own; a tiny Qwen3 for the CPU smoke run)
SHAPES = {
    "8B": json.loads((FIXTURES / "qwen3_8b_config.json").read_text()),
    "27B": json.loads((FIXTURES / "qwen3_6_27b_config.json").read_text()),
    "tiny": {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
             "tie_word_embeddings": False},
}
LAYER_IDS = [1, 2, 3, 4, 5]  # k = 5 target layers, the config's default count


def config_defaults(objective: str) -> tuple[int, int]:
    """(drafter.block_size, drafter.loss_chunk) of a config that sets only the objective."""
    d = config_from_dict({"drafter": {"objective": objective}}).drafter
    return d.block_size, d.loss_chunk


# Per objective: (block size, loss chunk) when not given. DFlash keeps this figure's 16 and 8192;
# DSpark takes the config's DSpark defaults (drafter.block_size 7, drafter.loss_chunk 1024),
# DFlash2 the config's DFlash2 defaults (its family's block 8; the key's own loss chunk, 4096).
OBJECTIVE_DEFAULTS = {"dflash": (16, 8192), "dspark": (7, DSPARK_LOSS_CHUNK),
                      "dflash2": config_defaults("dflash2")}
# DFlash2's keys this script sets, each by its flag (--conv-kernel-size, ...), with their
# defaults; selector_alpha and selector_missing keep the config's (neither changes the work).
DFLASH2_KEYS = {"conv_kernel_size": d2.CONV_KERNEL_SIZE, "conv_group_size": d2.CONV_GROUP_SIZE,
                "selector_rank": d2.SELECTOR_RANK, "selector_top_k": d2.SELECTOR_TOP_K}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="timed steps (or loss passes)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (compiling)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the timed steps, one more under torch.profiler: its N kernels "
                         "of most device time (where the step goes)")
    ap.add_argument("--shapes", default="8B,27B",
                    help=f"comma list of {', '.join(SHAPES)}; one per call keeps each under a "
                         "limit")
    ap.add_argument("--objective", choices=tuple(OBJECTIVE_DEFAULTS), default="dflash",
                    help="drafter.objective")
    ap.add_argument("--markov-rank", type=int, default=None,
                    help=f"drafter.markov_rank (dspark only; default {DSPARK_MARKOV_RANK})")
    for key, default in DFLASH2_KEYS.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=None,
                        help=f"drafter.{key} (dflash2 only; default {default})")
    ap.add_argument("--block-size", type=int, default=None,
                    help="drafter.block_size (default: dflash 16, dspark 7, dflash2 "
                         f"{OBJECTIVE_DEFAULTS['dflash2'][0]})")
    ap.add_argument("--micro", type=int, default=16384,
                    help="drafter.micro_block_tokens: block tokens live at once (memory)")
    ap.add_argument("--layers", type=int, default=5, help="drafter.num_layers")
    ap.add_argument("--loss-chunk", type=int, default=None,
                    help="drafter.loss_chunk (default: dflash 8192, dspark 1024, dflash2 "
                         f"{OBJECTIVE_DEFAULTS['dflash2'][1]})")
    ap.add_argument("--loss", choices=("dflash", "dpace"), default="dflash", help="drafter.loss")
    ap.add_argument("--optim", choices=("adamw", "muon"), default="adamw", help="optim.name")
    ap.add_argument("--seq-len", type=int, default=3072, help="tokens per sample")
    ap.add_argument("--anchors", type=int, default=512, help="drafter.num_anchors")
    ap.add_argument("--hf-norm", action="store_true",
                    help="transformers' eager Qwen3RMSNorm instead of the fused one (before/after)")
    ap.add_argument("--batches", default="",
                    help="ROWSxLENGTH,...: time one step of each batch shape instead (16384 "
                         "tokens as 64x256 .. 5x3072), against rows x min(anchors, length)")
    ap.add_argument("--fused-loss", choices=fused_loss.MODES, default="auto",
                    help="drafter.fused_loss: the loss by the fused kernels (on), the torch loss "
                         "(off), or fused where CUDA and Triton are (auto)")
    ap.add_argument("--time-loss", action="store_true",
                    help="time the loss alone instead (forward + backward of one micro-group; "
                         "dspark, dflash2: also DFlash's chunked CE over the same rows)")
    ap.add_argument("--stacks-after", type=float, default=240,
                    help="print every thread's stack if a step takes longer than this (s)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a smoke run of this script (--shapes tiny)")
    ap.add_argument("--gpu-memory-gib", type=float, default=None,
                    help="cap the process at this much of the GPU, as layout.gpu_memory_gib does "
                         "(95: the 96 GB card's usable share rehearsed on a larger one)")
    args = ap.parse_args(argv)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown or not args.shapes:
        ap.error(f"--shapes: unknown {unknown}; choose from {', '.join(SHAPES)}")
    for name in ("samples", "steps", "micro", "layers", "seq_len", "anchors"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    try:
        args.batch_shapes = [tuple(int(x) for x in item.lower().split("x", 1))
                             for item in args.batches.split(",") if item.strip()]
    except ValueError:
        ap.error(f"--batches {args.batches!r}: expected ROWSxLENGTH,... e.g. 64x256,5x3072")
    if any(n < 1 or S < 2 for n, S in args.batch_shapes):
        ap.error(f"--batches {args.batches!r}: each shape needs rows >= 1 and length >= 2")
    if args.batches and args.time_loss:
        ap.error("--batches and --time-loss each replace the steps: give one of them")
    if args.markov_rank is not None and args.objective != "dspark":
        ap.error("--markov-rank is DSpark's: add --objective dspark")
    for key, default in DFLASH2_KEYS.items():
        if getattr(args, key) is not None and args.objective != "dflash2":
            ap.error(f"--{key.replace('_', '-')} is DFlash2's: add --objective dflash2")
        if getattr(args, key) is None:
            setattr(args, key, default)
    block, chunk = OBJECTIVE_DEFAULTS[args.objective]
    args.block_size = block if args.block_size is None else args.block_size
    args.loss_chunk = chunk if args.loss_chunk is None else args.loss_chunk
    if args.markov_rank is None:
        args.markov_rank = DSPARK_MARKOV_RANK
    try:  # the config refuses what the engine would (dpace with dspark, ranges)
        cfg = run_config(args, args.samples * args.seq_len)
    except ConfigError as exc:
        ap.error(f"{exc} ({exc.hint})" if exc.hint else str(exc))
    settings = family_settings(cfg)
    for shape in args.shapes:
        ms = model_shape(SHAPES[shape])
        if settings is None:
            bad = []
        elif args.objective == "dflash2":  # its groups must divide the width (the target's)
            bad = settings.problems(ms.vocab, ms.hidden)
        else:
            bad = settings.problems(ms.vocab)
        if bad:
            ap.error(f"{shape}: {bad[0]}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here: --device cpu --shapes tiny for a smoke run")
    refused = fused_loss.refusal(args.fused_loss, args.device)
    if refused is not None:
        ap.error(f"--fused-loss {args.fused_loss}: {refused.message} ({refused.hint})")
    return args


def run_config(args, token_budget: int):
    """The engine config the measurement stands for: one drafter GPU (cuda:0) fed by one target
    GPU, a batch of --samples x --seq-len tokens. The memory plan is always the drafter GPU's,
    also in a CPU smoke run."""
    drafter = {"objective": args.objective, "num_layers": args.layers,
               "block_size": args.block_size, "num_anchors": args.anchors,
               "micro_block_tokens": args.micro, "loss_chunk": args.loss_chunk, "loss": args.loss,
               "fused_loss": args.fused_loss}
    if args.objective == "dspark":
        drafter["markov_rank"] = args.markov_rank
    if args.objective == "dflash2":
        drafter.update({key: getattr(args, key) for key in DFLASH2_KEYS})
    return config_from_dict({
        "drafter": drafter, "optim": {"name": args.optim},
        "data": {"token_budget": max(token_budget, args.seq_len), "max_length": args.seq_len},
        "layout": {"device": "cuda", "targets": [1], "drafters": [0]}})


def step_flops(dc, n, S, A, B, vocab, k=5, objective="dflash", rank=0,
               confidence=True, settings=None) -> dict[str, float]:
    """Model FLOPs of one step by part (forward x 3 for what backpropagates), counting only
    unmasked attention. DSpark: every slot predicts, plus its loss's extra matmuls. DFlash2
    (``settings``: its DFlash2Settings, default the family's at B): DFlash's parts, plus its
    convolutions and its selector (the module docstring says what each counts)."""
    H = dc.hidden_size
    hd, heads, kvh = dc.head_dim, dc.num_attention_heads, dc.num_key_value_heads
    T = A * B
    per_layer_ctx = 2 * S * H * 2 * kvh * hd  # k/v of the context
    dense = decoder_flops_per_token(dc, dc.num_hidden_layers) * T + per_layer_ctx * dc.num_hidden_layers
    attn = dc.num_hidden_layers * 2 * 2 * T * (S / 2 + B) * heads * hd
    fc = 2 * S * k * H * H
    dspark = objective == "dspark"
    rows = T if dspark else T * (B - 1) / B  # the slots the loss projects
    parts = {"drafter": 3 * n * (dense + attn + fc), "lm_head": 3 * n * 2 * rows * H * vocab}
    if dspark:
        # the target's distribution: its lm_head at each block position, no gradient
        parts["target lm_head"] = n * 2 * rows * H * vocab
        parts["markov head"] = 3 * n * 2 * rows * rank * vocab  # W2: r -> V (W1 is a lookup)
        if confidence:
            parts["confidence head"] = 3 * n * 2 * rows * (H + rank)
    if objective == "dflash2":
        s = settings or d2.DFlash2Settings(block_size=B)
        taps, M = s.conv_kernel_size, H // s.conv_group_size
        r, K = s.selector_rank, s.selector_top_k
        # per block token and layer (models/dflash2/conv.py): two projections y -> Delta
        # [2TM] (attention's, MLP's); per block, four convolutions (each side of each
        # sublayer), each tap t < min(T, B) over the B - t positions it reaches: beta + Delta,
        # its product with x and, after the first tap, the running sum
        reach = [B - t for t in range(min(taps, B))]
        per_block = 4 * H * (2 * sum(reach) + sum(reach[1:]))
        parts["convolutions"] = 3 * n * dc.num_hidden_layers * (
            T * 2 * (2 * H * 2 * taps * M) + A * per_block)
        # per labelled slot (models/dflash2/loss.py): gate 2Hr, A[prev] x gate r, the pair
        # term over the K candidates (or, where K r exceeds the vocabulary, the loss's one
        # product over it: 2rV), U + pair K
        pair = 2 * r * (vocab if K * r > vocab else K)
        parts["selector"] = 3 * n * rows * (2 * H * r + r + pair + K)
    return parts


def batch_of(n, S, vocab):
    ids = torch.randint(0, vocab - 1, (n, S))
    mask = torch.ones(n, S, dtype=torch.long)
    mask[:, :min(256, S // 4)] = 0  # a prompt
    return Batch(input_ids=ids, loss_mask=mask, attention_mask=torch.ones_like(mask),
                 lengths=torch.full((n,), S), indices=list(range(n)), epoch=0, batch_index=0,
                 num_tokens=n * S, padded_tokens=n * S, padding_frac=0.0)


def ready_batch(rep, n, S, vocab, anchors):
    """A random batch with its anchors and labels made beforehand, as the engine's loader thread
    makes them (so host work the drafter never waits for is not timed)."""
    dev = rep.device
    return prepare_batch(batch_of(n, S, vocab), anchors, rep.drafter.label_width, seed=0,
                         pad_to=ANCHOR_PAD if dev.type == "cuda" else 1)


def features(rep, n, S, k, H):
    """Random target features: k layer features, and for DSpark the post-norm last hidden state
    after them; bf16 on a GPU, float32 on the CPU (as the engine sends them)."""
    dt = torch.bfloat16 if rep.device.type == "cuda" else torch.float32
    width = rep.drafter.feature_vectors * H
    return torch.randn(n, S, width, device=rep.device, dtype=dt)


def size(n: float) -> str:
    """GiB, or MiB below one (the tiny shape's plan is not all 0.0 GiB)."""
    return gib(n) if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def watch(seconds: float) -> None:
    """A step stuck (compiling or otherwise) shows where it is instead of a silent limit."""
    try:
        faulthandler.dump_traceback_later(seconds, repeat=True, file=sys.stdout)
    except (AttributeError, ValueError, io.UnsupportedOperation):
        pass  # stdout captured in memory (a test) has no file descriptor to dump to


def batch_costs(rep, shapes: list[tuple[int, int]], tc, args, k: int) -> None:
    """One step per batch shape (after two warm-up steps of that shape): its time against the
    drafter cost the batch planner balances (rows x min(anchors, length))."""
    print("| batch | tokens | rows x min(anchors, length) | s / step | ms per 1k block positions |")
    print("|---|---|---|---|---|")
    for n, S in shapes:
        batch = ready_batch(rep, n, S, tc.vocab_size, args.anchors)
        feats = features(rep, n, S, k, tc.hidden_size)
        times = []
        for s in range(5):
            watch(args.stacks_after)
            sync(rep.device)
            t = time.perf_counter()
            rep.accumulate(batch, feats, seed=s)
            reduce_and_step([rep], s, 1000)
            sync(rep.device)
            times.append(time.perf_counter() - t)
            faulthandler.cancel_dump_traceback_later()
        dt = sum(times[2:]) / 3
        cost = n * min(args.anchors, S)
        print(f"| {n} x {S} | {n * S} | {cost} | {dt:.3f} | {dt / cost * 1e6:.2f} |", flush=True)
        del feats


def loss_passes(rep, batch, feats):
    """{name: (run, rows)} for one micro-group of the batch: ``run`` is the loss forward +
    backward the step makes on the drafter's final states of that group (computed once here),
    ``rows`` the labelled slots it projects. DSpark's also against DFlash's chunked CE over the
    same rows, same chunk: the difference is what TV, the Markov head and the confidence term
    cost. DFlash2's (its step loss: CE + selector) against the same CE: the difference is what
    the selector costs; where the step's loss is fused, DFlash2's torch loss too (what the fused
    loss saves). Gradients land in the replica's
    buffer (zero it after)."""
    d, dev, dcfg = rep.drafter, rep.device, rep.dcfg
    g = min(len(batch), obj.sequences_per_group(rep.micro_block_tokens,
                                                batch.anchors.shape[1] * d.block_size))
    a = batch.anchors[:g].to(dev)
    ids, pos = d.block_inputs(batch.input_ids[:g].to(dev), a)
    f = feats[:g]
    H = d.config.hidden_size
    labels_host = batch.labels[:g]
    if d.family.last_hidden:
        f, last = f[..., :-H], f[..., -H:]
    with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=rep.autocast):
        hidden = d(f, d.embed_tokens(ids).float(), pos, a)
    hidden = hidden.detach().requires_grad_()
    chunk = dcfg.loss_chunk
    fused = loss_fused(rep)

    def pass_of(loss_fn):
        def run():
            lo = loss_fn()
            (lo.loss * lo.weight_sum).backward()
            hidden.grad = None
        return run

    if rep.settings is None:
        picked = obj.label_rows(labels_host, rep.loss.gamma, rep.loss.dpace_alpha)
        labels = labels_host.to(dev)
        return g, {"DFlash chunked CE": (pass_of(lambda: obj.chunked_loss(
            hidden, labels, d.lm_head.weight, rep.loss.gamma, chunk, rows=picked, fused=fused)),
            len(picked.rows))}
    if d.objective == "dflash2":  # the step's own loss, as the replica calls it
        t = rep.loss.targets(d, f, labels_host, batch.input_ids[:g], batch.anchors[:g])[1]
        labels = t.labels.to(dev)
        n_rows = len(t.picked.rows)
        out = {
            "DFlash2 CE+selector": (pass_of(lambda: rep.loss(d, hidden, pos, labels, t)),
                                    n_rows),
            "DFlash chunked CE, same rows": (pass_of(lambda: obj.chunked_loss(
                hidden, labels, d.lm_head.weight, rep.loss.gamma, chunk, rows=t.picked,
                fused=fused)), n_rows),
        }
        if fused:
            (prev,) = t.extra
            s = rep.loss.settings
            out["DFlash2 CE+selector, torch"] = (pass_of(lambda: dflash2_loss(
                hidden, labels, prev.to(dev), d, gamma=rep.loss.gamma, alpha=s.selector_alpha,
                inject=s.selector_missing == "inject", chunk=chunk, rows=t.picked)), n_rows)
        return g, out
    dsp = rep.settings
    labels_host, prev = dspark_loss.dspark_targets(
        labels_host, dspark_loss.anchor_tokens(batch.input_ids[:g], batch.anchors[:g]))
    picked = dspark_loss.label_rows(labels_host, rep.loss.gamma)
    labels, prev = labels_host.to(dev), prev.to(dev)
    n_rows = len(picked.rows)
    return g, {
        "DSpark CE+TV+conf": (pass_of(lambda: dspark_loss.dspark_loss(
            hidden, last, pos, labels, prev, d, gamma=rep.loss.gamma, chunk=chunk, rows=picked,
            loss_weights=(dsp.ce_weight, dsp.tv_weight, dsp.conf_weight), fused=fused)), n_rows),
        "DFlash chunked CE, same rows": (pass_of(lambda: obj.chunked_loss(
            hidden, labels, d.lm_head.weight, rep.loss.gamma, chunk, rows=picked, fused=fused)),
            n_rows),
    }


def loss_fused(rep) -> bool:
    """Whether the replica's loss runs fused: drafter.fused_loss on its device, and a family
    that has the fused loss (all three have)."""
    return (rep.drafter.family.has_fused_loss
            and fused_loss.fused(rep.dcfg.fused_loss, rep.device.type))


def time_loss(rep, batch, feats, args, shape: str, planned_chunk: int) -> None:
    """The loss alone: mean forward + backward of one micro-group over --steps passes (after
    --warmup), per labelled row and per anchor, its peak memory over what was live before it
    (CUDA) against the plan's loss chunk, and its share of a step (groups x one group)."""
    dev = rep.device
    cuda = dev.type == "cuda"
    g, passes = loss_passes(rep, batch, feats)
    groups = -(-len(batch) // g)
    anchors = g * batch.anchors.shape[1]
    path = "fused" if loss_fused(rep) else "torch"
    print(f"| {shape} loss (one micro-group) | rows | chunk | ms / pass | us / row | us / anchor "
          f"| peak over live | plan's loss chunk | a step's loss ({groups} groups) | loss |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    per_pass = {}
    for name, (run, rows) in passes.items():
        for _ in range(args.warmup):
            run()
        sync(dev)
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev) if cuda else 0
        t = time.perf_counter()
        for _ in range(args.steps):
            run()
        sync(dev)
        dt = (time.perf_counter() - t) / args.steps
        peak = size(torch.cuda.max_memory_allocated(dev) - base) if cuda else "-"
        rep.flat.zero_()
        per_pass[name] = dt
        print(f"| {name} | {rows} | {args.loss_chunk} | {dt * 1e3:.2f} | "
              f"{dt / max(rows, 1) * 1e6:.2f} | {dt / anchors * 1e6:.2f} | {peak} | "
              f"{size(planned_chunk)} | {dt * groups:.3f} s | {path} |", flush=True)
    if len(per_pass) >= 2:
        name = next(iter(per_pass)).split()[0]  # DSpark, DFlash2
        own, ce = list(per_pass.values())[:2]
        print(f"  {shape}: {name}'s loss costs {own / ce:.2f}x DFlash's chunked CE over the same "
              f"rows: +{(own - ce) * groups:.3f} s per step of {len(batch)} samples", flush=True)
    if len(per_pass) == 3:  # DFlash2's fused loss against its torch loss
        torch_pass = list(per_pass.values())[2]
        print(f"  {shape}: DFlash2's fused loss takes {own / torch_pass:.2f}x its torch loss: "
              f"{(torch_pass - own) * groups:.3f} s less per step", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    print(env_line())
    if args.hf_norm:
        use_transformers_norm()
    cuda = args.device == "cuda"
    device = torch.device("cuda:0" if cuda else "cpu")
    if cuda and args.gpu_memory_gib:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_gib * 2**30 / total),
                                                   device)
        print(f"  GPU capped at {args.gpu_memory_gib:g} GiB of {total / 2**30:.1f}", flush=True)
    S, A, B, k = args.seq_len, args.anchors, args.block_size, len(LAYER_IDS)
    dspark, dflash2 = args.objective == "dspark", args.objective == "dflash2"
    for shape in args.shapes:
        hf = SHAPES[shape]
        tc = hf_config(hf)
        cfg = run_config(args, args.samples * S)
        planned = plan_memory(cfg, hf)
        plan = {r.device: r for r in planned.rows}["cuda:0"]
        margin = plan.components.get("cuda context", 0) + plan.components.get("allocator reserve", 0)
        # the loss's phase holds the chunk, whichever phase peaks (planning/drafter_memory.py)
        planned_chunk = drafter_phases(cfg, model_shape(hf), hf, True,
                                       planned.recompute)["loss"]["loss chunk"]
        print(f"  {shape}: preflight plan for the drafter GPU {size(plan.total)}, its tensors "
              f"{size(plan.total - margin)}, of it loss chunk {size(planned_chunk)} "
              f"(micro_block_tokens {args.micro}, loss_chunk {args.loss_chunk})", flush=True)
        settings = family_settings(cfg)
        torch.manual_seed(0)
        drafter = drafter_kinds.new_drafter(
            args.objective, tc, num_layers=args.layers, target_layer_ids=LAYER_IDS,
            block_size=B, mask_token_id=tc.vocab_size - 1, settings=settings)
        dc = drafter.config
        wdt = torch.bfloat16 if cuda else torch.float32  # the frozen head as the engine keeps it
        embed = torch.nn.Embedding(tc.vocab_size, tc.hidden_size, dtype=wdt, device=device)
        head = torch.nn.Linear(tc.hidden_size, tc.vocab_size, bias=False, dtype=wdt, device=device)
        (rep,) = make_replicas(drafter, [device], cfg.drafter, cfg.optim, embed, head, settings)
        if args.batches:
            batch_costs(rep, args.batch_shapes, tc, args, k)
            del rep, drafter, embed, head
            if cuda:
                torch.cuda.empty_cache()
            continue
        batch = ready_batch(rep, args.samples, S, tc.vocab_size, A)
        feats = features(rep, args.samples, S, k, tc.hidden_size)
        if args.time_loss:
            time_loss(rep, batch, feats, args, shape, planned_chunk)
            del rep, drafter, embed, head, feats
            if cuda:
                torch.cuda.empty_cache()
            continue
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times, opt_times = [], []
        for s in range(args.steps + args.warmup):
            watch(args.stacks_after)
            sync(device)
            t = time.perf_counter()
            rep.accumulate(batch, feats, seed=0)
            sync(device)
            t_opt = time.perf_counter()
            res = reduce_and_step([rep], s, 1000)
            sync(device)
            times.append(time.perf_counter() - t)
            opt_times.append(time.perf_counter() - t_opt)  # reduce, clip, optimizer step
            faulthandler.cancel_dump_traceback_later()
            terms = ", ".join(f"{n[5:]} {v:.3f}" for n, v in res.extra.items())
            # Each step as it happens: the first ones compile FlexAttention (forward and backward).
            print(f"  {shape} step {s}: {times[-1]:.2f} s, loss {res.loss:.3f}"
                  + (f" ({terms})" if terms else ""), flush=True)
        timed = times[args.warmup:]
        dt = sum(timed) / len(timed)
        parts = step_flops(dc, args.samples, S, A, B, tc.vocab_size, k, args.objective,
                           args.markov_rank, dspark and settings.confidence_head,
                           settings if dflash2 else None)
        fl = sum(parts.values())
        n_params = sum(p.numel() for p in rep.params())
        what = (f"dspark (B {B}, Markov rank {args.markov_rank}), {args.optim}" if dspark
                else f"dflash2 (B {B}, conv {args.conv_kernel_size} taps x groups of "
                     f"{args.conv_group_size}, selector rank {args.selector_rank} top-"
                     f"{args.selector_top_k}), {args.optim}" if dflash2
                else f"dflash (B {B}), loss {args.loss}, {args.optim}")
        what += ", fused loss" if loss_fused(rep) else ", torch loss"
        trainable = (f"{n_params / 1e9:.2f}B" if n_params >= 1e8 else f"{n_params / 1e6:.2f}M")
        mfu = f"{fl / dt / H200_BF16_PEAK:.2f}" if cuda else "- (CPU)"
        peak = size(torch.cuda.max_memory_allocated()) if cuda else "- (CPU)"
        print(f"| {shape}-shaped drafter, {what} (H {dc.hidden_size}, {args.layers} layers, "
              f"vocab {tc.vocab_size}, {trainable} trainable) "
              f"| {args.samples / dt:.2f} samples/s | MFU {mfu} | peak {peak} "
              f"| plan {size(plan.total)} (tensors {size(plan.total - margin)}) "
              f"| first step {times[0]:.1f} s (compile) "
              f"| step {dt:.3f} s, of it optimizer "
              f"{sum(opt_times[args.warmup:]) / len(timed):.3f} s |")
        counted = ", ".join(f"{name} {v / 1e12:.3g}" for name, v in parts.items())
        print(f"  {shape} FLOPs per step {fl / 1e12:.3g} TFLOP ({counted}; forward x 3 of what "
              "backpropagates" + ("; DSpark's loss adds the target lm_head at the block "
                                  "positions, forward only, and the Markov and confidence heads"
                                  if dspark else "; DFlash2 adds its convolutions' projections "
                                  "and taps, and its selector's gate and pair scores"
                                  if dflash2 else "")
              + "; recompute in backward not counted)", flush=True)
        if args.profile:
            profile_step(rep, batch, feats, device, args.profile, args.steps + args.warmup)
        del rep, drafter, embed, head, feats
        if cuda:
            torch.cuda.empty_cache()


def profile_step(rep, batch, feats, device, top: int, step: int) -> None:
    """One more step (accumulate, then reduce and the optimizer) under torch.profiler: the
    ``top`` kernels by device time (self), and their share of the step's."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=acts) as prof:
        rep.accumulate(batch, feats, seed=0)
        reduce_and_step([rep], step, 1000)
        sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=70),
          flush=True)


if __name__ == "__main__":
    main()
