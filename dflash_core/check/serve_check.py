"""The train-to-serve check, phase by phase (docs/check.md).

1. preflight: devices of the config's layout, the target, its layer ids and mask id, the data;
2. load the target on the first target GPU, or with target.gpus_per_copy > 1 as the run's first
   target group (its ranks on the first copy's GPUs; every forward below runs in them);
3. samples: the first prompts of the data, each with the target's own greedy response;
4. memorise: train the configured drafter on them (the engine's step) to near-full teacher-forced
   blocks, or the step cap;
5. decode: exact greedy speculative decoding of their prompts with this engine's drafter, and
   with the saved checkpoint in the public reference implementation when it is importable (a
   DFlash drafter only: the reference decodes no DSpark drafter; DSpark's chain drafting is
   judged by its own probes);
6. diagnose: probes of the trained drafter (for DSpark also models/dspark/probes.py's), then the
   verdict.

Everything it writes goes to ``<run folder>/check/`` (the samples as shards, the checkpoint in
the interchange format, ``check.json``), which a later run in that folder ignores.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from dflash_core import strict_json
from dflash_core.check import decode as dec
from dflash_core.check.diagnose import Verdict, diagnose, evidence_lines, feature_gap, probe
from dflash_core.check.memorise import memorise
from dflash_core.check.samples import pick_prompts, write_responses
from dflash_core.config import Config
from dflash_core.context_buckets import buckets_of
from dflash_core.eval.drafter_dtype import check_dtype, parameter_dtype, served_copy
from dflash_core.eval.evaluate import evaluation_attention, target_fn_for
from dflash_core.models.target.load import load_target
from dflash_core.planning import data_checks, preflight, target_checks

CHECK_FOLDER = "check"


@dataclass
class CheckOptions:
    samples: int = 2  # prompts taken from the data
    response_tokens: int = 64  # tokens the target writes for each
    max_steps: int = 300  # optimizer steps at most to memorise them
    reference: bool = True  # also decode with the reference implementation when importable
    # the dtype the drafter decodes in (eval/drafter_dtype.py); None: the served one, drafter.dtype
    drafter_dtype: str | None = None
    # "vllm": the prompts decoded by vLLM too, the memorised drafter as its speculative model
    # (eval/served.py); its tau and tokens beside ours, in the evidence and check.json
    engine: str = "ours"
    # with engine vllm: its memory, as eval's --vllm-memory (served_memory.parse_memory); None: what
    # is free when it starts (at most 0.9 of the card), 1 GiB of KV cache on the CPU
    vllm_memory: str | None = None


@dataclass
class CheckResult:
    verdict: Verdict
    folder: Path
    evidence: list[str] = field(default_factory=list)
    reference: str = ""  # "used", or why it was not
    seconds: float = 0.0
    drafter_dtype: str = ""  # the dtype the drafter decoded in

    @property
    def exit_code(self) -> int:
        return 0 if self.verdict.passed else 1


@dataclass
class Prepared:
    """What the check works on once the target is loaded and has written the samples."""

    cfg: Config
    folder: Path
    target: object  # target.TargetModel on the first target device, or a group's GroupTarget
    target_fn: Callable
    samples: list
    layer_ids: list[int]
    mask_id: int
    drafter_devices: list[torch.device]
    started: float
    drafter_dtype: str = "float32"  # what decoding casts the memorised drafter to
    target_path: Path | None = None  # the target's folder (check --engine vllm serves it)
    target_dtype: str = "float32"
    session: object = None  # target_group/session.GroupSession of a target group, else None


def run_check(cfg: Config, opts: CheckOptions | None = None,
              say: Callable[[str], None] = print) -> CheckResult:
    """Run the check; ``say`` gets one line per phase (and progress inside long ones). Raises
    ConfigError / DataError / TargetLoadError for bad input (nothing trained yet)."""
    opts = opts or CheckOptions()
    prep = prepare(cfg, opts, say)
    try:
        return judge(prep, train(prep, opts, say), opts, say)
    finally:
        release(prep)


def prepare(cfg: Config, opts: CheckOptions, say: Callable[[str], None]) -> Prepared:
    """Preflight, the target, and the samples it writes."""
    t0 = time.monotonic()
    run_dir = cfg.run_dir
    say("preflight: devices, target, data")
    tdev, ddev = preflight.resolve_devices(cfg)
    grouped = cfg.target.gpus_per_copy > 1
    if opts.engine == "vllm" and grouped:
        from dflash_core.eval.errors import EvalInputError

        raise EvalInputError(
            f"--engine vllm with target.gpus_per_copy {cfg.target.gpus_per_copy}: the check "
            "serves the target through vLLM on one GPU", hint="leave --engine out (the check "
            "decodes through the target group), or check with target.gpus_per_copy: 1")
    if opts.engine == "vllm":  # vLLM missing, or a drafter it cannot serve here: one line
        from types import SimpleNamespace

        from dflash_core.eval import served, served_memory

        served.check_available()
        served.check_servable([SimpleNamespace(objective=str(cfg.drafter.objective),
                                               label="of the check")], tdev[0])
        served_memory.parse_memory(opts.vllm_memory)
    elif opts.vllm_memory is not None:
        from dflash_core.eval.errors import EvalInputError

        raise EvalInputError("--vllm-memory is vLLM's memory: it needs --engine vllm")
    drafter_dtype = check_dtype(opts.drafter_dtype or cfg.drafter.dtype, ddev[0])
    run_dir.mkdir(parents=True, exist_ok=True)
    progress = preflight.demo_log_progress(lambda e: say(e.message), lambda: None)
    # preflight's warnings too (the last layer as a feature, an attention replaced), as a run says
    target_path, hf_config, layer_ids, mask_id = target_checks.resolve_target(
        cfg, run_dir, progress, say=lambda m: say(f"  warning: {m}"))
    if grouped:  # what transformers cannot split: refused before any weight is read
        preflight.check_group(cfg, hf_config, lambda e: say(e.message))
    from dflash_core.data import ShardedDataset

    data_path = data_checks.resolve_data(cfg, target_path, progress)
    data_checks.check_data_manifest(cfg, data_path, target_path)
    dataset = ShardedDataset.open(data_path)
    prompts = pick_prompts(dataset, opts.samples, cfg.data.max_length - opts.response_tokens)

    dtype = cfg.target.dtype if tdev[0].type == "cuda" else "float32"
    folder = run_dir / CHECK_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    session = None
    if grouped:
        target, session = _group_target(cfg, target_path, tdev, ddev[0], dtype, layer_ids,
                                        folder, say)
    else:
        say(f"loading the target {target_path} on {tdev[0]}")
        target = load_target(target_path, device=tdev[0], dtype=dtype,
                             attn_implementation=cfg.target.attn_implementation,
                             trust_remote_code=cfg.target.trust_remote_code, say=say)
    try:
        return _samples(cfg, opts, target, session, prompts, layer_ids, mask_id, ddev, t0,
                        drafter_dtype, target_path, dtype, folder, say)
    except BaseException:
        if session is not None:
            session.close()
        raise


def _group_target(cfg: Config, target_path: Path, tdev, device, dtype: str, layer_ids,
                  folder: Path, say):
    """The run's first target group (its first copy's GPUs), its answers on ``device`` (the
    first drafter's): (GroupTarget, its session)."""
    from dflash_core.target_group.session import GroupSession
    from dflash_core.target_group.split import copies, split_of

    split = split_of(cfg.target)
    devices = copies(tdev, split.k)[0]
    say(f"loading the target {target_path} as a target group of {split.k} ranks on "
        f"{', '.join(str(d) for d in devices)}")
    session = GroupSession(target_path, devices, split, dtype=dtype,
                           attn_implementation=cfg.target.attn_implementation,
                           layer_ids=layer_ids, trust_remote_code=cfg.target.trust_remote_code,
                           folder=folder, say=say)
    try:
        return session.open(device), session
    except BaseException:
        session.close()
        raise


def _samples(cfg, opts, target, session, prompts, layer_ids, mask_id, ddev, t0, drafter_dtype,
             target_path, dtype, folder, say) -> Prepared:
    target_fn = target_fn_for(target, layer_ids)

    say(f"samples: the target writes {opts.response_tokens} tokens after each of "
        f"{len(prompts)} prompts (data samples {[i for i, _ in prompts]})")
    samples = write_responses(target_fn, prompts, opts.response_tokens, eos_token_id=None,
                              device=target.device)
    return Prepared(cfg, folder, target, target_fn, samples, layer_ids, mask_id, ddev, t0,
                    drafter_dtype, Path(target_path), dtype, session)


def train(prep: Prepared, opts: CheckOptions, say: Callable[[str], None]):
    """Memorise the samples (memorise.Memorised)."""
    drafters = ", ".join(str(d) for d in prep.drafter_devices)
    say(f"memorise: training the drafter on them on {drafters} (at most {opts.max_steps} steps)")
    mem = memorise(prep.cfg, prep.target, prep.samples, prep.drafter_devices,
                   layer_ids=prep.layer_ids, mask_id=prep.mask_id, folder=prep.folder,
                   max_steps=opts.max_steps, say=lambda m: say(f"  {m}"))
    say(f"memorise: {'done' if mem.reached else 'stopped at the cap'} after {mem.steps} steps "
        f"({mem.seconds:.0f} s): teacher-forced tau {mem.tau_tf:.2f} of {mem.tau_ceiling:.2f}")
    return mem


def judge(prep: Prepared, mem, opts: CheckOptions, say: Callable[[str], None]) -> CheckResult:
    """Save the checkpoint, decode exactly (ours, the reference), probe, and give the verdict."""
    drafter, samples, target = mem.drafter, prep.samples, prep.target
    ckpt = prep.folder / "drafter"
    drafter.save(ckpt)

    dtype = prep.drafter_dtype  # as it is served (--drafter-dtype float32: the trained weights)
    buckets = buckets_of(target)  # acceptance by context length, by the target's window
    say(f"decode: exact speculative decoding of the prompts, the target verifying, the drafter "
        f"in {dtype}")
    served = (drafter if parameter_dtype(drafter) == getattr(torch, dtype)
              else served_copy(drafter, dtype))
    with evaluation_attention(served):  # as the run's evaluation decodes
        ours = dec.decode("this engine", prep.target_fn, served, samples, prep.layer_ids,
                          eos_token_id=None, device=target.device, buckets=buckets)
    del served
    say(f"  this engine: exact tau {ours.tau:.2f} of {ours.ceiling:.2f}")
    ref, ref_note, ref_mask = None, "not asked for (--no-reference)", None
    dsp = drafter.anchor_predicts  # DSpark: its chain drafting, judged by its own probes
    if opts.reference and dsp:
        ref_note = (f"not used: {dec.REFERENCE} decodes DFlash drafters, not DSpark's (the "
                    "DSpark probes judge its chain drafting)")
        say(f"  reference implementation {ref_note}")
    elif opts.reference and prep.session is not None:
        ref_note = ("not used: the target runs in a target group's processes, and the reference "
                    "decodes with the whole model in its own")
        say(f"  reference implementation {ref_note}")
    elif opts.reference and drafter.objective != "dflash":
        # DFlash2: the reference would read the folder as DFlash's, without its convolutions
        # and selector (tests/core/models/dflash2/test_format.py reads it by the format)
        ref_note = (f"not used: {dec.REFERENCE} decodes DFlash drafters, not "
                    f"{drafter.family.title}'s convolutions and selector")
        say(f"  reference implementation {ref_note}")
    elif opts.reference:
        cls, why = dec.reference_class()
        if cls is None:
            ref_note = (f"not importable ({why}); pip install {dec.REFERENCE} to decode the "
                        "checkpoint with it too")
            say(f"  reference implementation {ref_note}")
        else:
            model = dec.load_reference(cls, ckpt, drafter.embed_tokens, drafter.lm_head,
                                       next(drafter.parameters()).device, dtype)
            ref_mask = model.mask_token_id
            ref = dec.decode(f"reference {dec.REFERENCE}", dec.reference_target_fn(
                target.model, model.target_layer_ids), model, samples, model.target_layer_ids,
                eos_token_id=None, device=target.device, buckets=buckets)
            ref_note = "used"
            say(f"  {ref.name}: exact tau {ref.tau:.2f} of {ref.ceiling:.2f}")

    say("diagnose: probes of the trained drafter")
    s0 = samples[0]
    probes = probe(drafter, mem.batch.input_ids, mem.context, len(s0.prompt), len(s0.input_ids))
    probes.features, probes.last_hidden = feature_gap(
        target, mem.batch.input_ids, prep.layer_ids, mem.features, len(s0.input_ids),
        last_hidden=drafter.family.last_hidden)
    with evaluation_attention(drafter):  # the family's own probes (DSpark's; DFlash has none)
        probes.dspark = drafter.family_probes(
            mem.context[:1], mem.batch.input_ids[0, : len(s0.input_ids)],
            [a for a in probes.anchors if a < len(s0.input_ids) - 1])
    verdict = diagnose(ours, ref, memorised=mem.reached, tau_tf=mem.tau_tf,
                       ceiling_tf=mem.tau_ceiling, probes=probes, steps=mem.steps,
                       trained_mask_id=drafter.mask_token_id, reference_mask_id=ref_mask,
                       target_layers=target.num_layers)
    vllm = None
    if opts.engine == "vllm":
        from dflash_core.eval import served, served_memory

        # the probes are done: the target's memory back to the driver before vLLM measures its
        # share of the card
        config, device = target.model.config, target.device
        target = None
        release(prep)
        vllm = served.check_decoding(
            prep.target_path, config, ckpt, drafter.objective, drafter.block_size,
            [list(x.prompt) for x in samples], [list(x.response) for x in samples],
            prep.target_dtype, device, prep.folder / "vllm", lambda m: say(f"  {m}"),
            served_memory.parse_memory(opts.vllm_memory))
        say(f"  vLLM ({vllm['version']}, {vllm['runner']}, {vllm['dtype']}): tau {vllm['tau']:.2f}"
            f" by its counters; its tokens "
            + ("are the target's greedy text" if not vllm["differs_from_the_target_here"] else
               f"differ from the target's greedy text here on "
               f"{len(vllm['differs_from_the_target_here'])} of {len(samples)} prompts"))
    evidence = evidence_lines(ours, ref, mem.tau_tf, mem.tau_ceiling, probes)
    if vllm is not None:
        evidence.append(f"served by vLLM ({vllm['version']}): tau {vllm['tau']:.2f} by its "
                        f"counters against {ours.tau:.2f} here; its tokens "
                        + ("the target's greedy text" if not vllm["differs_from_the_target_here"]
                           else "part from the target's greedy text here on "
                           f"{len(vllm['differs_from_the_target_here'])} prompts"))
    result = CheckResult(verdict, prep.folder, evidence, ref_note,
                         time.monotonic() - prep.started, dtype)
    _write_record(prep.folder / "check.json", result, mem, ours, ref, vllm)
    return result


def release(prep: Prepared) -> None:
    """Drop the target (GPU memory back to the driver's cache; a target group's ranks
    ended)."""
    prep.target = prep.target_fn = None
    if prep.session is not None:
        prep.session.close()
        prep.session = None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _finite(x: float):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def _write_record(path: Path, result: CheckResult, mem, ours, ref, vllm=None) -> None:
    """check.json: the verdict and its numbers, for a later look (written whole, then renamed)."""
    def dec_record(d):
        if d is None:
            return None
        return {"name": d.name, "tau": d.tau, "ceiling": d.ceiling,
                "accepted_at": [_finite(v) for v in d.accepted_at()],
                "correct_at": [_finite(v) for v in d.correct_at()],
                "one_later": [_finite(v) for v in d.correct_at(1)],
                "context": d.by_context()}
    record = {
        "passed": result.verdict.passed, "summary": result.verdict.summary,
        "objective": mem.drafter.objective, "drafter_dtype": result.drafter_dtype,
        "findings": [asdict(f) for f in result.verdict.findings],
        "memorise": {"steps": mem.steps, "tau_tf": mem.tau_tf, "ceiling": mem.tau_ceiling,
                     "loss": _finite(mem.loss), "reached": mem.reached,
                     "share": mem.terms.share, "keys": mem.terms.keys, "why": mem.terms.why},
        "ours": dec_record(ours), "reference": dec_record(ref), "reference_note": result.reference,
        "seconds": round(result.seconds, 1),
        "vllm": vllm,  # check --engine vllm (eval/served.check_decoding); None without it
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(strict_json.dumps(record, indent=2), encoding="utf-8")
    tmp.replace(path)
