"""Train-to-serve check before a long run: memorise a few samples, decode them exactly, diagnose.

On the config's target and GPUs, the target writes a short greedy response to one or a few prompts
of the data; the configured drafter is trained on them until it has memorised them; their prompts
are then decoded exactly (greedy speculative decoding, the target verifying), here and, when the
reference implementation (pip install dflash==0.1.0) is importable, with the saved checkpoint in
it. A memorised drafter must be accepted in near-full blocks on text the target itself wrote:
if it is not, or if the probes find training and decoding computing different functions, training
and serving disagree, and the check says where (target.layer_ids, drafter.mask_token_id, labels
shifted by one, a leak in the training attention) and how to fix it. It does not judge the data's
quality or the drafter's tau on new prompts. Exit 0 passed, 1 failed (with the diagnosis), 2 bad
input. Written to <run folder>/check/ (check.json, the checkpoint in the interchange format).

examples:
  dflash-tui check --config config.yaml      before `dflash-tui run --config config.yaml`
  dflash-tui check --demo --device cpu       the same on the built-in tiny model
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ._shared import setting, whole_number

_at_least_one = whole_number(1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dflash_core.check.serve_check import CheckOptions

    d = CheckOptions()
    parser.add_argument("--config", type=Path, help="the run config (YAML) to check")
    parser.add_argument("--demo", action="store_true", help="check the built-in demo")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="--demo only: auto (default) uses the GPUs when CUDA sees any")
    parser.add_argument("--output-dir", default=None, help="--demo only: override run.output_dir")
    parser.add_argument("--samples", type=_at_least_one, default=d.samples,
                        help=f"prompts taken from the data (default {d.samples})")
    parser.add_argument("--response-tokens", type=_at_least_one, default=d.response_tokens,
                        help=f"tokens the target writes after each (default {d.response_tokens})")
    parser.add_argument("--max-steps", type=_at_least_one, default=d.max_steps,
                        help=f"optimizer steps at most to memorise them (default {d.max_steps})")
    parser.add_argument("--no-reference", action="store_true",
                        help="do not decode with the reference implementation even if installed")
    parser.add_argument("--drafter-dtype", default=None, metavar="DTYPE",
                        help="the dtype the memorised drafter decodes in: bfloat16, float16 or "
                             "float32 (default: drafter.dtype, the served one)")
    parser.add_argument("--engine", choices=("ours", "vllm"), default=d.engine,
                        help="vllm: vLLM decodes the prompts too, the memorised drafter as its "
                             "speculative model; its tau and tokens in the evidence (needs the "
                             "[vllm] extra; docs/check.md)")
    parser.add_argument("--vllm-memory", default=None, metavar="SHARE|SIZE",
                        help="with --engine vllm: vLLM's memory, its share of the GPU (0 < F <= "
                             "1) or a KV cache size (4GiB); default what is free when it starts, "
                             "at most 0.9 (the CPU: a 1 GiB KV cache)")
    parser.add_argument("--set", type=setting, action="append", default=[], dest="overrides",
                        metavar="SECTION.KEY=VALUE",
                        help="override one config key, as for run (e.g. --set optim.name=muon)")


def _config(args):
    from dflash_core.config import apply_overrides

    return apply_overrides(_base_config(args), args.overrides)


def _base_config(args):
    from dflash_core.config import ConfigError, load_config

    if args.config is not None and args.demo:
        raise ConfigError("", "--config and --demo contradict each other",
                          hint="pass one of them")
    if args.config is not None:
        if args.device != "auto" or args.output_dir:
            raise ConfigError("layout.device", "--device and --output-dir are for --demo; with "
                              "--config the config decides", hint="set them in the config file")
        return load_config(args.config)
    if not args.demo:
        raise ConfigError("", "nothing to check", hint="pass --config config.yaml or --demo")
    from dflash_core.demo import demo_config

    return demo_config(output_dir=args.output_dir or "runs", device=args.device)


def run(args: argparse.Namespace) -> int:
    from dflash_core.config import ConfigError

    try:  # before the model libraries load (seconds): a bad config answers at once
        cfg = _config(args)
    except ConfigError as exc:
        print(f"config error: {exc}" + (f"\nhint: {exc.hint}" if exc.hint else ""),
              file=sys.stderr)
        return 2
    from dflash_core.check.serve_check import CheckOptions, run_check
    from dflash_core.data import DataError
    from dflash_core.eval.errors import EvalInputError
    from dflash_core.eval.served import EngineFailed
    from dflash_core.models.target.config import TargetLoadError
    from dflash_core.target_group.group import GroupRankFailed
    from dflash_core.target_group.session import verb_hint

    t0 = time.monotonic()

    def say(message: str) -> None:
        s = int(time.monotonic() - t0)
        print(f"[{s // 60}:{s % 60:02d}] {message}", flush=True)

    from dflash_tui.verbs._signals import as_interrupt

    try:
        with as_interrupt():  # SIGTERM, a hang-up: as Ctrl-C (vLLM's processes ended)
            result = run_check(cfg, CheckOptions(
                args.samples, args.response_tokens, args.max_steps,
                reference=not args.no_reference, drafter_dtype=args.drafter_dtype,
                engine=args.engine, vllm_memory=args.vllm_memory), say)
    except EngineFailed as exc:
        print(f"error: {exc}\nhint: {exc.hint + '; ' if exc.hint else ''}vLLM's log is "
              f"{exc.log}", file=sys.stderr)
        return 2 if exc.input else 1
    except GroupRankFailed as exc:  # as a run names it: the rank, its GPU, the kind
        print(f"error [{exc.error_kind}]: {exc}\nhint: {verb_hint(exc)}", file=sys.stderr)
        return 1
    except (ConfigError, DataError, TargetLoadError, EvalInputError) as exc:
        kind = "config error" if isinstance(exc, ConfigError) else "error"
        print(f"{kind}: {exc}" + (f"\nhint: {exc.hint}" if getattr(exc, "hint", "") else ""),
              file=sys.stderr)
        return 2
    v = result.verdict
    say(f"check {v.summary}")
    for f in v.findings:
        print(f"  problem: {f.what}\n  fix: {f.fix}")
    print("evidence:\n  " + "\n  ".join(result.evidence))
    print(f"reference implementation: {result.reference}")
    print(f"details in {result.folder / 'check.json'}")
    return result.exit_code
