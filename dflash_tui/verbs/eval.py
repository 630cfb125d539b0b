"""Benchmark drafters against their target on named prompt sets, side by side.

Each prompt set is a JSONL file (OpenAI "messages", a plain "prompt", or "turns"; a user brings
GSM8K, MT-Bench, ...), rendered with the target's chat template (first turn, generation prompt;
--thinking sets the template's enable_thinking switch). Every drafter (this engine's checkpoints,
DFlash, DSpark or DFlash2, or published drafters in those public folder formats) decodes
each prompt, greedy or at a temperature (speculative sampling's acceptance rule, seeded), and the
target alone decodes it too in the same run: per set, tau, accepted@k, rounds, tokens/s and the
speedup over plain decoding, in one table, and tau by context length (the rounds' positions in
buckets of the target's window; --long-prompts reads a set long: whole conversations, an
answer's first half joining the prompt). Greedy decoding is checked lossless: each drafter's
tokens must equal the target's own, or the prompt and the first differing position are named.
Results go to --out (results.json, and one JSONL file per set and decoder); run again, the same
command continues where it stopped. With --engine vllm, vLLM's offline engine decodes the same
prompts too (plain, and each drafter as its speculative model): its counters, speed and lossless
check beside ours (its log in OUT/vllm/). Exit 0 done, 1 the lossless check failed (ours or
vLLM's) or vLLM failed, 2 bad input, 130 interrupted. docs/eval.md says what each figure means.

examples:
  dflash-tui eval --target /models/Qwen3-8B --drafter runs/q8b/checkpoints/step-4000 \\
      --drafter /models/Qwen3-8B-DFlash-b16 --prompts gsm8k=gsm8k.jsonl \\
      --prompts mt-bench=mt_bench.jsonl --thinking off --max-new-tokens 512
  dflash-tui eval --target builtin:tiny --drafter runs/demo --prompts demo=prompts.jsonl \\
      --device cpu
  dflash-tui eval --target /models/Qwen3-235B-A22B --gpus-per-copy 4 --target-gpus 0,1,2,3 \\
      --device cuda:4 --drafter runs/q235/checkpoints/step-8000 --prompts gsm8k=gsm8k.jsonl
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ._shared import real_number, whole_number


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dflash_core.eval import EvalOptions

    d = EvalOptions("", [], [])
    p.add_argument("--target", required=True,
                   help="the target's model folder (or builtin:tiny, the demo's)")
    p.add_argument("--drafter", action="append", required=True, metavar="CKPT",
                   help="a checkpoint folder (RUN/checkpoints/step-N), a run folder (its newest "
                        "checkpoint) or a DFlash / DSpark / DFlash2 model folder; again to "
                        "compare")
    p.add_argument("--prompts", action="append", default=[], metavar="NAME=FILE",
                   help="a prompt set: JSONL with \"messages\", \"prompt\" or \"turns\" a line; "
                        "again for more sets")
    p.add_argument("--long-prompts", action="append", default=[], metavar="NAME=FILE",
                   help="a long-prompt set: a \"messages\" row whole, up to its last user "
                        "message, and the first half of the answer after it as the start of "
                        "the response (docs/eval.md, \"Tau by context length\"); again for more")
    p.add_argument("--thinking", choices=("on", "off"), default=None,
                   help="the chat template's enable_thinking switch (default: the template's "
                        "own default); refused for a template without it")
    p.add_argument("--temperature", type=real_number(0.0), default=d.temperature,
                   help="0 (default): greedy, with the lossless check; above 0: sampled")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="sampling's seed (each prompt draws from its own generator)")
    p.add_argument("--max-new-tokens", type=whole_number(1), default=d.max_new_tokens,
                   help=f"new tokens per prompt at most (default {d.max_new_tokens})")
    p.add_argument("--batch", type=whole_number(1), default=d.batch,
                   help=f"prompts decoded together (default {d.batch})")
    p.add_argument("--cache", action="store_true",
                   help="decode with the target's cache, one prompt at a time (eval.cache's "
                        "path, hybrid targets included) instead of batched full forwards")
    p.add_argument("--limit", type=whole_number(0), default=0,
                   help="the first N prompts of each set (default 0: all)")
    p.add_argument("--out", default=d.out, metavar="DIR",
                   help=f"where the results go (default {d.out}); the same DIR continues")
    p.add_argument("--device", default=d.device,
                   help="auto (default: CUDA when there is a GPU), cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"),
                   default=d.dtype, help="the target's dtype (auto: bfloat16 on CUDA, float32 "
                                         "on the CPU)")
    p.add_argument("--drafter-dtype", default=None, metavar="DTYPE",
                   help="the drafters' dtype: bfloat16, float16 or float32 (default: each one's "
                        "served dtype, its model.safetensors', as vLLM and SGLang run it)")
    p.add_argument("--gpu-hour-price", type=real_number(0.0), default=d.gpu_hour_price,
                   metavar="PRICE", help="price every run checkpoint's GPU-hours at PRICE, to "
                   "compare drafters at one price (default 0: the price each run recorded, "
                   "else its config.yaml's cost.gpu_hour_price)")
    p.add_argument("--currency", default=d.currency,
                   help="the currency of --gpu-hour-price (default: the one the run recorded)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the Python files of the target's (and tokenizer's) folder when the "
                        "model exists only as such (auto_map, as Kimi-K2's); only for folders "
                        "you trust")
    p.add_argument("--engine", choices=("ours", "vllm"), default=d.engine,
                   help="vllm: vLLM's offline engine decodes the same prompts too, each drafter "
                        "as its speculative model; its counters, speed and lossless check "
                        "beside ours (needs the [vllm] extra; docs/eval.md, \"vLLM as the "
                        "judge\")")
    p.add_argument("--verbose", action="store_true",
                   help="with --engine vllm: vLLM's own log on the terminal (it is kept in "
                        "OUT/vllm/ either way)")
    p.add_argument("--vllm-memory", default=None, metavar="SHARE|SIZE",
                   help="with --engine vllm: vLLM's memory, its share of the GPU (0 < F <= 1, "
                        "its gpu_memory_utilization) or a KV cache size (4GiB); default what is "
                        "free when it starts, at most 0.9 (the CPU: a 1 GiB KV cache)")
    p.add_argument("--gpus-per-copy", type=whole_number(1), default=d.gpus_per_copy,
                   metavar="K", help="load the target as a target group of K GPUs, as a run's "
                   "target.gpus_per_copy (docs/targets.md, \"Targets larger than one GPU\"); "
                   "the drafters stay on --device (default 1: the target whole on --device)")
    p.add_argument("--target-gpus", default=d.target_gpus, metavar="LIST",
                   help="with --gpus-per-copy K: the group's K GPUs, e.g. 0,1,2,3 (default the "
                        "first K; on the CPU K processes)")
    p.add_argument("--parallel", choices=("sharded", "shared"), default=d.parallel,
                   help="with --gpus-per-copy: how the copy is split, as target.parallel "
                        f"(default {d.parallel})")
    p.add_argument("--expert-parallel", choices=("on", "off"), default="on",
                   help="with --gpus-per-copy: a mixture-of-experts target's experts split "
                        "between the GPUs, as target.expert_parallel (default on)")
    p.add_argument("--tokenizer", default=None,
                   help="the tokenizer's folder (default: the target's own)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a jinja chat template replacing the tokenizer's")


def _options(args):
    from dflash_core.eval import EvalOptions

    return EvalOptions(
        target=args.target, drafters=list(args.drafter), prompts=list(args.prompts),
        long_prompts=list(args.long_prompts),
        tokenizer=args.tokenizer, chat_template=args.chat_template, thinking=args.thinking,
        temperature=args.temperature, seed=args.seed, max_new_tokens=args.max_new_tokens,
        batch=args.batch, cache=args.cache, limit=args.limit, out=args.out,
        device=args.device, dtype=args.dtype, drafter_dtype=args.drafter_dtype,
        gpu_hour_price=args.gpu_hour_price,
        currency=args.currency, trust_remote_code=args.trust_remote_code,
        engine=args.engine, verbose=args.verbose, vllm_memory=args.vllm_memory,
        gpus_per_copy=args.gpus_per_copy, target_gpus=args.target_gpus,
        parallel=args.parallel, expert_parallel=args.expert_parallel == "on")


def run(args: argparse.Namespace) -> int:
    from dflash_core.eval import EvalInputError, Evaluation, set_table
    from dflash_core.eval.served import EngineFailed
    from dflash_core.target_group.group import GroupRankFailed
    from dflash_core.target_group.session import verb_hint

    t0 = time.monotonic()

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    from dflash_tui.verbs._signals import as_interrupt

    ev = None
    try:
        with as_interrupt():  # SIGTERM, a hang-up: as Ctrl-C (results kept, vLLM ended)
            ev = Evaluation(_options(args), say)
            ev.load()
            report = ev.run()
    except GroupRankFailed as exc:  # as a run names it: the rank, its GPU, the kind
        print(f"error [{exc.error_kind}]: {exc}\nhint: {verb_hint(exc)}; every whole batch is "
              f"kept in {args.out}", file=sys.stderr)
        return 1
    except EvalInputError as exc:
        print(f"error: {exc}" + (f"\nhint: {exc.hint}" if exc.hint else ""), file=sys.stderr)
        return 2
    except EngineFailed as exc:
        print(f"error: {exc}\nhint: {exc.hint + '; ' if exc.hint else ''}vLLM's log is "
              f"{exc.log}; our own results are kept in {args.out} (the same command continues)",
              file=sys.stderr)
        return 2 if exc.input else 1
    except KeyboardInterrupt:
        print(f"interrupted: every whole batch is kept in {args.out}; run the same command "
              "again to continue", file=sys.stderr)
        return 130
    finally:
        if ev is not None:  # a target group's ranks end here, whichever way it went
            ev.release()
    greedy = args.temperature == 0
    mode = "greedy" if greedy else f"temperature {args.temperature:g}, seed {args.seed}"
    print(f"{args.target}: {mode}, thinking {args.thinking or 'as the template has it'}, "
          f"{args.max_new_tokens} new tokens at most, batch {args.batch}"
          + (", cached" if args.cache else ""))
    served = report.served
    if served is not None:
        e = served.engine
        print(f"vLLM: {e['version']}, {e['runner']}, {e['dtype']}")
    for s in report.sets:
        print()
        print(set_table(s.name, s.prompts, s.plain, s.drafters, report.per_round, greedy,
                        report.hours, served.sets.get(s.name) if served else None))
        if served is not None and served.plain[s.name]["differs_from_our_plain"]:
            ds = served.plain[s.name]["differs_from_our_plain"]
            print(f"vLLM's plain decoding differs from ours on {len(ds)} of {s.prompts} prompts "
                  f"(first: {ds[0]['id']} at new token {ds[0]['position']}): another kernel's "
                  "float rounding, not a drafter's doing")
    costs = [(label, h) for label, h in report.hours.items() if h is not None]
    if costs:  # each run checkpoint's device time in full: its roles, what it was counted from
        from dflash_core.observe.device_hours import figure_text

        print("\ntraining cost to each run checkpoint (dflash-tui run's device time):")
        for label, h in costs:
            print(f"  {label}: {figure_text(h)}")
    print(f"\nresults in {Path(args.out) / 'results.json'} ({time.monotonic() - t0:.0f} s)")
    bad = report.mismatches
    firsts: dict[tuple[str, str], list[dict]] = {}
    for name, label, m in bad:
        firsts.setdefault((name, label), []).append(m)
    for (name, label), ms in firsts.items():
        m = ms[0]
        more = f"; {len(ms) - 1} more prompts differ" if len(ms) > 1 else ""
        print(f"lossless check failed: set {name}, drafter {label}: prompt {m['id']} (index "
              f"{m['index']}) leaves the target's greedy output at new token {m['position']} "
              f"(target {m['plain']}, speculative {m['speculative']}; the target's top two "
              f"logits there {m['target_gap']:g} apart){more}", file=sys.stderr)
    ties = report.near_ties
    if ties:
        name, label, m = ties[0]
        print(f"note: {len(ties)} decodings (prompt, drafter) parted from the target's greedy "
              f"output at a near tie "
              f"of the target (first: set {name}, drafter {label}, prompt {m['id']} at new token "
              f"{m['position']}, its top two logits {m['target_gap']:g} apart): two correct "
              f"computations in {report.settings['dtype']} may order them either way; not a "
              "failure", file=sys.stderr)
    vbad = served.failures if served is not None else []
    for name, label, m in vbad:
        print(f"lossless check failed in vLLM: set {name}, drafter {label}: prompt {m['id']} "
              f"(index {m['index']}) leaves vLLM's plain greedy output at new token "
              f"{m['position']}", file=sys.stderr)
    return 1 if bad or vbad else 0
