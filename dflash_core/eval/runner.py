"""One evaluation: drafters against a target on named prompt sets (docs/eval.md).

Everything that can be refused is checked before the target's weights are read: the prompt
files, the tokenizer and its thinking switch, each drafter's folder and its fit to the target's
config.json, the lengths against the target's positions, and the results files (continued only
under the same settings). Then, per set, the prompts are sorted by length and cut into batches;
each batch is decoded by the target alone (plain) and by each drafter in turn, so the baseline
and the drafters are timed side by side on the same prompts, and appended to its results file.
A DFlash2 drafter decodes the batch a second time, untimed, with each slot's unary argmax in
place of its selector's walk (``unary_acceptance``: the run's evaluation's ``tau unary
argmax``, what the selector gains is the difference).
A run stopped anywhere continues from its last whole batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

import dflash_core.eval.drafters as dk
import dflash_core.eval.grouped as grouped
import dflash_core.eval.results as rs
import dflash_core.eval.served as served
import dflash_core.eval.served_memory as served_memory
from dflash_core.eval.drafter_dtype import check_dtype, served_dtype_of
from dflash_core.eval.errors import EvalInputError
from dflash_core.eval.options import (
    EvalOptions, check_values, resolve_device, resolve_dtype, target_folder, target_id,
)
from dflash_core.eval.report import EvalReport, SetReport, report_json  # noqa: F401
from dflash_core.eval.prompt_sets import PromptSet, load_sets
from dflash_core.eval.rendering import (
    generation_config, load_chat_tokenizer, longest_past, render_set, stop_ids, template_kwargs,
    tokenizer_spec,
)
from dflash_core.eval.sampling import prompt_generator
from dflash_core.eval.spec_decode import DecodeSettings, decode_rows
from dflash_core.eval.summary import first_difference, summarise
from dflash_core.eval.target_decoding import head_is_lm_head, rows_backend
from dflash_core.context_buckets import Buckets
from dflash_core.families.registry import family

RESULTS = "results.json"
GROUP_LOGS = ".target-group"  # under --out: a target group's rank logs (grouped.py)
# A greedy mismatch where the target's top two logits lie within this share of the top one is a
# near tie: two correct computations of the same logits (another batch, another kernel) may
# order them either way in this dtype. float32 keeps ~7 digits through the layers; bf16 ~2-3.
NEAR_TIE = {"float32": 1e-5, "float16": 2.0 ** -9, "bfloat16": 2.0 ** -6}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Timed:
    """A target backend whose prefill (``start``) is timed apart from the rounds."""

    def __init__(self, backend, device):
        self.backend, self.device, self.prefill_s = backend, device, 0.0

    def start(self, prompts):
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.backend.start(prompts)
        _sync(self.device)
        self.prefill_s = time.perf_counter() - t0
        return out

    def __getattr__(self, name):
        return getattr(self.backend, name)


@dataclass
class _Decoder:
    """Plain decoding, or one drafter: its results file per set and its target features."""

    label: str  # "plain" or the drafter's label
    layer_ids: list[int]
    drafter: object = None
    spec: dk.DrafterSpec | None = None
    files: dict[str, rs.ResultsFile] = field(default_factory=dict)


class Evaluation:
    """An evaluation prepared (everything checked, files opened) and run batch by batch."""

    def __init__(self, opts: EvalOptions, say: Callable[[str], None] = print):
        self.opts, self.say = opts, say
        check_values(opts)
        if opts.engine not in served.ENGINES:
            raise EvalInputError(f"--engine {opts.engine!r}: use ours or vllm")
        grouped.check_engine(opts.gpus_per_copy, opts.engine)
        if opts.engine == "vllm":
            served.check_available()
        elif opts.vllm_memory is not None:
            raise EvalInputError("--vllm-memory is vLLM's memory: it needs --engine vllm")
        elif opts.verbose:  # harmless, but a user expecting more output is told why not
            say("note: --verbose shows vLLM's own log; without --engine vllm there is none")
        self.vllm_memory = served_memory.parse_memory(opts.vllm_memory)
        self.device = resolve_device(opts.device)
        self.dtype = resolve_dtype(opts.dtype, self.device)
        self.sets = load_sets(opts.prompts, opts.long_prompts, opts.limit, reserved=RESULTS)
        self.folder = target_folder(opts.target)
        self.target_config = self._target_config()
        self.group = grouped.plan_group(opts.gpus_per_copy, opts.target_gpus, opts.parallel,
                                        opts.expert_parallel, self.device, self.folder)
        self.shape = dk.TargetShape.of(self.target_config)
        self.specs = [dk.priced(dk.read_drafter(g), opts.gpu_hour_price, opts.currency)
                      for g in opts.drafters]
        for s in self.specs:
            dk.check_against(s, self.shape)
        dk.unique_labels(self.specs)
        dk.distinct_files(self.specs)
        for s in self.specs:  # a run's checkpoint against its checksums: a flipped bit is named
            dk.check_intact(s)
        if opts.engine == "vllm":  # vLLM runs the drafter in the target's dtype: so do we
            served.check_servable(self.specs, self.device)
        self.drafter_dtypes = {s.label: check_dtype(
            opts.drafter_dtype or (self.dtype if opts.engine == "vllm"
                                   else served_dtype_of(s.path)), self.device)
            for s in self.specs}
        self.tokenizer = load_chat_tokenizer(tokenizer_spec(self.folder, opts.tokenizer),
                                             opts.chat_template, opts.trust_remote_code)
        kwargs = template_kwargs(self.tokenizer, opts.thinking,
                                 f"the chat template of {opts.tokenizer or opts.target}")
        self.rendered = {p.name: render_set(self.tokenizer, p, kwargs) for p in self.sets}
        self._check_lengths()
        self.stop = stop_ids(self.tokenizer, self.target_config, generation_config(self.folder))
        self.out = Path(opts.out).expanduser()
        self.settings = self._settings()
        plain = _Decoder("plain", [self.shape.num_layers - 1])
        self.decoders = [plain] + [_Decoder(s.label, s.target_layer_ids, spec=s)
                                   for s in self.specs]
        # every file checked before any is started: a refusal leaves the folder as it was
        rs.check_out(self.out, RESULTS, [self._where(d, p)[0] for d in self.decoders
                                         for p in self.sets])
        if opts.engine == "vllm":
            served.check_folder(self.out / served.FOLDER, f"--out {self.out}")
        for d in self.decoders:
            for p in self.sets:
                rs.check_header(*self._where(d, p)[:2])
        for d in self.decoders:
            for p in self.sets:
                d.files[p.name] = rs.open_results(*self._where(d, p))
        self.target = None
        self.session = None  # a target group's (grouped.py), while its ranks are up
        self.warm = False
        self.served: served.ServedReport | None = None

    # -- checks before any weight is read -------------------------------------------------
    def _target_config(self):
        from dflash_core.models.target.config import (
            FLAG_WORDS, TargetLoadError, load_target_config,
        )

        try:  # its refusals and hints in the flags' words, not the run's config keys
            return load_target_config(self.folder, self.opts.trust_remote_code,
                                      words=FLAG_WORDS)
        except TargetLoadError as exc:
            raise EvalInputError(str(exc), hint=exc.hint_in(FLAG_WORDS)) from exc

    def _check_lengths(self) -> None:
        from dflash_core.models.target.shape import text_config

        limit = getattr(text_config(self.target_config), "max_position_embeddings", None)
        self.positions = limit
        self.buckets = Buckets.of(limit)  # acceptance by context length, by the target's window
        for p in self.sets:
            past = longest_past(p, self.rendered[p.name], self.opts.max_new_tokens, limit)
            if past:
                raise EvalInputError(past, hint="lower --max-new-tokens, or leave the longest "
                                                "prompts out of the file")

    def _settings(self) -> dict:
        from dflash_core.data.chat_render import fingerprints

        o = self.opts
        return {"target": target_id(self.folder), "tokenizer": fingerprints(self.tokenizer),
                "thinking": o.thinking or "template default", "temperature": o.temperature,
                "seed": o.seed if o.temperature > 0 else None,
                "max_new_tokens": o.max_new_tokens, "batch": o.batch, "cache": o.cache,
                "dtype": self.dtype, "device": _device_name(self.device),
                "stop_ids": sorted(self.stop),
                # only when grouped: the results files of a whole target continue as they were
                **({"target_group": self.group.split.describe(self.group.moe)}
                   if self.group is not None else {})}

    def _where(self, d: _Decoder, p: PromptSet) -> tuple[Path, dict, dict]:
        """(results file, settings compared, what is only said) of decoder ``d`` on set ``p``."""
        settings = dict(self.settings, set=p.name, prompts=p.sha256)
        if p.long:  # read otherwise: other prompts (said only when long: older files continue)
            settings["long"] = True
        about = {"target": str(self.folder), "prompts": str(p.path)}
        if d.spec is not None:
            settings["drafter"] = {"objective": d.spec.objective,
                                   "fingerprint": d.spec.fingerprint,
                                   "dtype": self.drafter_dtypes[d.label]}
            about["drafter"] = str(d.spec.path)
        name = rs.PLAIN if d.spec is None else dk.file_name(d.label)
        return self.out / p.name / name, settings, about

    # -- the run ------------------------------------------------------------------------------
    def load(self) -> None:
        from dflash_core.eval.evaluate import EVAL_ATTENTION
        from dflash_core.models.target.config import FLAG_WORDS, TargetLoadError
        from dflash_core.models.target.load import load_target

        t0 = time.monotonic()
        if self.group is not None:
            self._load_group()
        else:
            self.say(f"loading the target {self.folder} on {self.device} ({self.dtype})")
            from dflash_core.demo import quiet_hf

            try:
                with quiet_hf():  # our own line says what loads; no bar behind the progress
                    self.target = load_target(self.folder, device=self.device,
                                              dtype=self.dtype,
                                              trust_remote_code=self.opts.trust_remote_code,
                                              say=self.say)
            except TargetLoadError as exc:
                raise EvalInputError(str(exc), hint=exc.hint_in(FLAG_WORDS)) from exc
        for d in self.decoders[1:]:
            d.drafter = dk.load_weights(d.spec, self.target, self.device,
                                        self.drafter_dtypes[d.label])
            d.drafter.attn_impl = EVAL_ATTENTION  # uncompiled, as the engine's evaluation
        probe = list(self.rendered[self.sets[0].name].ids[0])[:64]
        # the cache path reads the model's own logits; only the batched one needs the check
        self.exact_head = True if self.opts.cache else head_is_lm_head(self.target, probe, [0])
        self.say(f"loaded in {time.monotonic() - t0:.1f} s; {len(self.specs)} drafter(s): "
                 + ", ".join(f"{s.label} ({s.objective}, block {s.block_size}, "
                             f"{self.drafter_dtypes[s.label]})"
                             for s in self.specs))

    def _load_group(self) -> None:
        """The target over its group's ranks (grouped.py), its embedding and lm_head here on
        --device for the drafters; a rank that fails is named (GroupRankFailed)."""
        from dflash_core.target_group.session import GroupSession

        g = self.group
        self.say(f"loading the target {self.folder} as "
                 f"{g.describe()} ({self.dtype}); the drafters on "
                 f"{self.device}")
        self.session = GroupSession(
            self.folder, g.devices, g.split, dtype=self.dtype, attn_implementation="sdpa",
            layer_ids=[self.shape.num_layers - 1], trust_remote_code=self.opts.trust_remote_code,
            folder=self.out / GROUP_LOGS, say=self.say)
        try:
            self.target = self.session.open(self.device, heads_device=self.device)
        except BaseException:
            self.session.close()
            self.session = None
            raise

    def _backend(self, d: _Decoder):
        return rows_backend(self.target, d.layer_ids, self.opts.cache, self.exact_head)

    def _decode(self, d: _Decoder, prompts: list[list[int]], indices: list[int],
                new_tokens: int):
        o = self.opts
        gens = ([prompt_generator(o.seed, i, self.device) for i in indices]
                if o.temperature > 0 else None)
        backend = _Timed(self._backend(d), self.device)
        # greedy: every round counted as vLLM's counters count it too (served_acceptance)
        settings = DecodeSettings(new_tokens, o.temperature, self.stop, count_whole=True,
                                  positions=self.positions)
        _sync(self.device)
        t0 = time.perf_counter()
        rows = decode_rows(backend, d.drafter, prompts, settings, gens)
        _sync(self.device)
        return rows, time.perf_counter() - t0, backend.prefill_s

    def warm_up(self) -> None:
        """One short decode by each decoder, untimed: first calls set up kernels and buffers."""
        ids = [list(self.rendered[self.sets[0].name].ids[0])]
        for d in self.decoders:
            self._decode(d, ids, [0], min(4, self.opts.max_new_tokens))
        self.warm = True

    def run(self) -> EvalReport:
        if self.target is None:
            self.load()
        t0 = time.monotonic()
        for p in self.sets:
            self._run_set(p, t0)
        if self.opts.engine == "vllm":
            self.release()  # vLLM's share of the card is measured with ours given back
            memory = served_memory.vllm_memory(self.device, self.vllm_memory, self.say)
            self.served = served.Judge(self, self.opts.verbose, memory).run()
        return self.report()

    def release(self) -> None:
        """Drop the target and the drafters (their GPU memory back to the driver; a target
        group's ranks ended): a later ``run`` loads them again."""
        self.target = None
        if self.session is not None:
            self.session.close()
            self.session = None
        for d in self.decoders[1:]:
            d.drafter = None
        self.warm = False
        if self.device.type == "cuda":
            import gc

            gc.collect()
            torch.cuda.empty_cache()

    def _run_set(self, p: PromptSet, t0: float) -> None:
        ids = self.rendered[p.name].ids
        order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))
        size = self.opts.batch
        batches = [order[k:k + size] for k in range(0, len(order), size)]
        left = [b for b in batches if not all(d.files[p.name].done(i)
                                              for d in self.decoders for i in b)]
        if not left:
            self.say(f"{p.name}: all {len(ids)} prompts measured before (results in "
                     f"{self.out / p.name})")
            return
        if len(left) < len(batches):
            self.say(f"{p.name}: {len(batches) - len(left)} of {len(batches)} batches measured "
                     "before; continuing")
        if not self.warm:
            self.warm_up()
        for k, batch in enumerate(batches):
            if batch not in left:
                continue
            parts = []
            for d in self.decoders:
                f = d.files[p.name]
                todo = [i for i in batch if not f.done(i)]
                if not todo:
                    continue
                prompts = [list(ids[i]) for i in todo]
                rows, secs, prefill = self._decode(d, prompts, todo, self.opts.max_new_tokens)
                unary = self._unary_rows(d, prompts, todo)
                lines = [self._line(p, d, i, f.next_batch, r, u)
                         for i, r, u in zip(todo, rows, unary)]
                f.append(lines, rs.Batch(f.next_batch, todo, secs, prefill))
                toks = sum(len(r.tokens) for r in rows) - len(rows)
                rate = toks / max(secs - prefill, 1e-9)
                tau = (sum(len(r.tokens) for r in rows) - len(rows)) / max(
                    1, sum(len(r.acceptance) for r in rows))
                parts.append(f"{d.label} {rate:.0f} tok/s" + (f" tau {tau:.2f}"
                                                             if d.spec else ""))
            done = sum(len(b) for b in batches[:k + 1])
            s = int(time.monotonic() - t0)
            self.say(f"[{s // 60}:{s % 60:02d}] {p.name}: {done}/{len(ids)} prompts; "
                     + "; ".join(parts))

    def _unary_rows(self, d: _Decoder, prompts: list[list[int]], indices: list[int]) -> list:
        """Each prompt decoded again with the drafter's unary argmax in place of its own path
        (a drafter with ``unary_path``: DFlash2's selector), untimed; None each for the
        others."""
        path = getattr(d.drafter, "unary_path", None) if d.spec is not None else None
        if path is None:
            return [None] * len(prompts)
        with path():
            return self._decode(d, prompts, indices, self.opts.max_new_tokens)[0]

    def _line(self, p: PromptSet, d: _Decoder, i: int, batch: int, r, unary=None) -> dict:
        line = {"kind": "prompt", "index": i, "id": p.prompts[i].id, "batch": batch,
                "prompt_tokens": len(self.rendered[p.name].ids[i]), "tokens": r.tokens,
                "acceptance": r.acceptance, "proposed": r.proposed}
        if unary is not None:  # DFlash2: the same prompt with each slot's unary argmax
            line["unary_acceptance"] = unary.acceptance
        if d.spec is not None and r.served_acceptance:  # vLLM's count (served_counts.VllmCounts)
            line["served_acceptance"] = r.served_acceptance
            k = family(d.spec.objective).drafts_per_round(d.spec.block_size)
            line["served_drafts"] = k
            if any(n != k for n in r.served_proposed):  # fewer at the end of the window
                line["served_proposed"] = r.served_proposed
        if d.spec is not None and self.opts.temperature == 0:
            ref = self.decoders[0].files[p.name].prompts[i]["tokens"]
            at = first_difference(ref, r.tokens)
            if at is not None:
                line["lossless"] = self._mismatch(p, i, ref, r.tokens, at)
        return line

    @torch.no_grad()
    def _mismatch(self, p: PromptSet, i: int, ref: list[int], got: list[int], at: int) -> dict:
        """Where speculative decoding left the target's greedy text, and how close the
        target's top two choices were there (a near tie parts at float noise)."""
        prefix = list(self.rendered[p.name].ids[i]) + ref[:at]
        ids = torch.tensor([prefix], dtype=torch.long, device=self.target.device)
        logits, _ = self.target.logits_and_features(ids, [0])
        top = logits[0, -1].float().topk(2).values
        gap = float(top[0] - top[1])
        return {"position": at, "plain": ref[at] if at < len(ref) else None,
                "speculative": got[at] if at < len(got) else None,
                "target_gap": round(gap, 6),
                "near_tie": gap <= NEAR_TIE[self.dtype] * max(1.0, abs(float(top[0])))}

    def report(self) -> EvalReport:
        rep = EvalReport(self.out, self.settings, [s.label for s in self.specs],
                         {s.label: family(s.objective).drafts_per_round(s.block_size)
                          for s in self.specs}, hours={s.label: s.hours for s in self.specs},
                         served=self.served)
        for p in self.sets:
            indices = list(range(len(p.prompts)))
            plain = summarise(self.decoders[0].files[p.name], indices, self.buckets)
            drafted = {}
            for d in self.decoders[1:]:
                sm = summarise(d.files[p.name], indices, self.buckets)
                if plain.tokens_per_s > 0 and sm.tokens_per_s > 0:
                    sm.speedup = sm.tokens_per_s / plain.tokens_per_s
                drafted[d.label] = sm
            rep.sets.append(SetReport(p.name, len(p.prompts), plain, drafted))
        rs.write_json(self.out / RESULTS, report_json(rep, self),
                      kept="every prompt's results are kept in the sets' files; the same command "
                           "writes the summary without decoding again")
        return rep


def run_eval(opts: EvalOptions, say: Callable[[str], None] = print) -> EvalReport:
    """Prepare (every check), load, decode what is not done yet, and summarise."""
    ev = Evaluation(opts, say)
    try:
        return ev.run()
    finally:
        ev.release()
