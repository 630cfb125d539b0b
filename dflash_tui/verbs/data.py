"""Data: prepare conversations into training shards, regenerate responses with the target, inspect.

    dflash-tui data prepare SOURCE --tokenizer TARGET --out FOLDER
    dflash-tui data regenerate SOURCE --endpoint http://HOST:PORT [--endpoint ...] --out FOLDER
    dflash-tui data inspect FOLDER [--tokenizer TARGET] [--target TARGET]

The work is in ``dflash_core.data`` (prepare, regenerate, inspect); this module only reads the
command line, prints, and maps bad input to exit code 2 with the cause and the fix.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from ._shared import real_number, whole_number

# Checked where they are parsed: argparse's one line and exit 2, before anything runs.
_length = whole_number(0, "tokens", "0 = no limit")
_workers = whole_number(0, "processes", "0 = one per core", maximum=256)
_per_shard = whole_number(1, "samples")
_concurrency = whole_number(1, "requests", maximum=1024)
_tokens = whole_number(1, "tokens")
_retries = whole_number(0, "retries", maximum=100)
_rows = whole_number(0, "rows", "0 = all rows")
_shown = whole_number(0, "samples", maximum=10_000)
_probed = whole_number(1, "samples", maximum=100_000)
_seconds = real_number(0, strict=True, unit="seconds")
_temperature = real_number(0)
_seed = whole_number(0, "seed")
_wait = real_number(0, unit="seconds")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", metavar="{prepare,regenerate,inspect}",
                                required=True)
    # every option's default shown in --help
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = sub.add_parser("prepare", help="conversations -> tokenized shards with a loss mask",
                       formatter_class=fmt, description="Render conversations with the target's tokenizer and chat "
                                   "template into the shards a run reads; manifest written last.")
    p.add_argument("source", help="a .jsonl (messages or conversations), .parquet, or a "
                                  "datasets save_to_disk folder")
    p.add_argument("--out", required=True, help="output folder (new or empty)")
    _tokenizer_args(p, required=True)
    p.add_argument("--max-length", type=_length, default=0,
                   help="samples longer than this many tokens are cut to their first "
                        "--max-length tokens, as a run cuts them at data.max_length (counted, "
                        "with where each cut fell); one with no answer before the cut is left "
                        "out (too_long); 0 = no limit")
    p.add_argument("--workers", type=_workers, default=0, help="processes (0 = one per core)")
    p.add_argument("--samples-per-shard", type=_per_shard, default=10_000,
                   help="samples per shard file")
    p.add_argument("--format", dest="fmt", choices=("arrow", "parquet"), default="arrow",
                   help="shard file format")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the data an earlier prepare wrote in --out (never a folder "
                        "a prepare did not write)")
    p.add_argument("--quiet", action="store_true", help="no progress line")

    r = sub.add_parser("regenerate", help="rewrite every assistant turn with the target, "
                                          "through OpenAI-compatible servers",
                       formatter_class=fmt,
                       description="Turn by turn, each assistant turn answered by the target "
                                   "(vLLM, SGLang or transformers serve serving it). One probe "
                                   "request goes first: it says whether the server returns "
                                   "token ids or text only, and stops with the fix when the "
                                   "server refuses the request. A re-run of the same command "
                                   "continues where it stopped.")
    r.add_argument("source", help="conversations, as for prepare")
    r.add_argument("--out", required=True, help="output folder (continued when it holds an "
                                                "earlier run of the same command)")
    r.add_argument("--endpoint", action="append", required=True,
                   help="server base URL, e.g. http://127.0.0.1:8000 (repeat for several)")
    r.add_argument("--model", help="served model name (default: what the first endpoint "
                                   "serves); every endpoint must serve it")
    r.add_argument("--api", choices=("chat", "completions"), default="chat",
                   help="chat: /v1/chat/completions (the server's template); completions: "
                        "prompt ids rendered here (needs --tokenizer)")
    _tokenizer_args(r, required=False)
    r.add_argument("--concurrency", type=_concurrency, default=8,
                   help="requests in flight per endpoint")
    r.add_argument("--max-tokens", type=_tokens, default=2048, help="longest answer per turn")
    r.add_argument("--temperature", type=_temperature, default=0.0,
                   help="sampling temperature (0 = greedy: the target's own next tokens)")
    r.add_argument("--timeout", type=_seconds, default=600.0,
                   help="seconds a request may take, to the answer's last byte, before it "
                        "is retried")
    r.add_argument("--retries", type=_retries, default=4,
                   help="retries per request (with backoff); a server that does not answer "
                        "at all is waited for instead (--down-wait)")
    r.add_argument("--down-wait", type=_wait, default=1800.0,
                   help="seconds an endpoint that stops answering (connection refused) is "
                        "waited for, trying again with backoff, before its samples are left "
                        "for the next run")
    r.add_argument("--no-token-ids", action="store_true",
                   help="do not ask for return_token_ids (the probe finds a server that "
                        "refuses the field and asks for text only)")
    r.add_argument("--target", help="the target's model folder (or builtin:tiny): when the "
                                    "server returns text only, measures on the probe's answer "
                                    "what the text round trip changes (loads the model here)")
    r.add_argument("--api-key-env", default="OPENAI_API_KEY",
                   help="environment variable holding the servers' API key, if they need one")
    r.add_argument("--limit", type=_rows, default=0, help="only the first N rows (0 = all)")
    r.add_argument("--quiet", action="store_true", help="no progress line")

    i = sub.add_parser("inspect", help="samples, lengths, trained share, target agreement",
                       formatter_class=fmt, description="What a data folder holds; with --target, how often its "
                                   "trained labels are the target's own greedy next token.")
    i.add_argument("folder", help="a prepared data folder (or any folder of shards)")
    i.add_argument("--tokenizer", help="decode samples with this tokenizer (default: the one "
                                       "the manifest names)")
    i.add_argument("--target", help="target model folder (or builtin:tiny) for the agreement")
    _trust_arg(i)
    i.add_argument("--samples", type=_shown, default=2, help="samples to show")
    i.add_argument("--agreement-samples", type=_probed, default=16,
                   help="samples the agreement is measured on")
    i.add_argument("--seed", type=_seed, default=0,
                   help="which samples are shown and measured (the same seed, the same figure)")
    i.add_argument("--json", action="store_true", help="print the report as JSON")


def _trust_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the Python files of the tokenizer's and target's folders when "
                        "they exist only as such (auto_map, as Kimi-K2's); only for folders "
                        "you trust")


def _tokenizer_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--tokenizer", required=required,
                   help="the target's model folder (its tokenizer and chat template), or "
                        "builtin:tiny for the demo target")
    p.add_argument("--chat-template", help="a jinja chat template file replacing the "
                                           "tokenizer's own (e.g. the one it is served with)")
    _trust_arg(p)
    p.add_argument("--thinking", choices=("keep", "last", "drop"), default="keep",
                   help="reasoning content: keep it in every turn, only in the last assistant "
                        "turn, or drop it")


def run(args: argparse.Namespace) -> int:
    from dflash_core.data.regen.errors import ServerFailing
    from dflash_core.data.shards import DataError

    try:
        return {"prepare": _prepare, "regenerate": _regenerate,
                "inspect": _inspect}[args.data_command](args)
    except DataError as exc:
        print(f"data error: {exc}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return 2
    except ServerFailing as exc:  # the server, not the input: the same command continues
        print(f"server error: {exc}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: nothing finished is lost; run the same command again to continue "
              "(regenerate), or to prepare again (an interrupted prepare leaves --out as it "
              "was)", file=sys.stderr)
        return 130
    except OSError as exc:  # the disk, not the input: full, read-only, gone
        print(f"io error: {exc}", file=sys.stderr)
        print("hint: free space or fix permissions, then run the same command again",
              file=sys.stderr)
        return 1
    except Exception:  # what no input check foresaw is a bug: its traceback, said as such
        traceback.print_exc()
        print("internal error: a bug in dflash (the traceback above); please report it with "
              "the command line", file=sys.stderr)
        return 1


def _prepare(args) -> int:
    from dflash_core.data.cutting import describe as describe_cut
    from dflash_core.data.prepare import PrepareOptions, prepare
    from dflash_core.data.provenance import describe

    m = prepare(PrepareOptions(args.source, args.out, tokenizer=args.tokenizer,
                               chat_template=args.chat_template, thinking=args.thinking,
                               trust_remote_code=args.trust_remote_code,
                               max_length=args.max_length, workers=args.workers,
                               overwrite=args.overwrite, samples_per_shard=args.samples_per_shard,
                               fmt=args.fmt, progress=not args.quiet))
    c, t = m["counts"], m["tokens"]
    print(f"prepared {c['samples']} samples from {c['rows']} rows into {args.out} "
          f"({t['tokens']} tokens, {t['trained_share']:.1%} trained) in {m['seconds']} s")
    if describe_cut(c.get("cut", {})):
        print(f"  {describe_cut(c['cut'])}")
    for reason, n in c["dropped"].items():
        print(f"  left out {n} rows: {reason} (e.g. {m['examples'][reason]})")
    if c["split_rows"]:
        print(f"  {c['split_rows']} conversations split into one sample per assistant turn "
              "(the template renders history differently from the last turn)")
        for reason, n in c.get("split_samples_dropped", {}).items():
            print(f"    of their turns, {n} left out: {reason} (the rest of each row is used)")
    if c.get("tool_call_turns") or c.get("tool_turns"):
        print(f"  {c.get('tool_call_turns', 0)} assistant turns with tool calls (rendered by the "
              f"template and trained) and {c.get('tool_turns', 0)} tool results (context)")
    if c.get("joined_rows"):
        print(f"  {c['joined_rows']} conversations tokenized piece by piece at the turn "
              "boundaries (the tokenizer merges an answer's first characters with the "
              "template's text before it; the ids are joined as the target saw and wrote them)")
    print(f"  {describe(m['provenance'])}")
    return 0


def _load_target(spec: str, trust_remote_code: bool = False):
    """An HF causal LM of the target, for an agreement: a model folder, or builtin:tiny."""
    from pathlib import Path

    from dflash_core import demo
    from dflash_core.data.shards import DataError
    from dflash_core.models.target.config import FLAG_WORDS, TargetLoadError

    folder = demo.ensure_tiny_target() if spec == "builtin:tiny" else spec
    try:
        return demo.load_lm(Path(folder).expanduser(), trust_remote_code)
    except TargetLoadError as exc:  # in this verb's words: --target, not target.path
        raise DataError(str(exc), file=folder, hint=exc.hint_in(FLAG_WORDS)) from exc
    except (OSError, ValueError, KeyError) as exc:
        raise DataError(f"cannot load the target model ({str(exc).splitlines()[0]})",
                        file=folder, hint="pass --target a model folder (config.json and "
                                          "weights) or builtin:tiny") from exc


def _regenerate(args) -> int:
    from dflash_core.data.regen.options import RegenOptions
    from dflash_core.data.regen.parts import DAMAGED, MERGED
    from dflash_core.data.regen.regenerate import regenerate

    target = _load_target(args.target, args.trust_remote_code) if args.target else None
    # the target's own folder holds its tokenizer and template: what the measure renders with
    tokenizer = args.tokenizer or args.target
    s = regenerate(RegenOptions(
        args.source, args.out, args.endpoint, model=args.model, api=args.api,
        tokenizer=tokenizer, chat_template=args.chat_template, thinking=args.thinking,
        trust_remote_code=args.trust_remote_code, concurrency=args.concurrency, max_tokens=args.max_tokens, temperature=args.temperature,
        timeout_s=args.timeout, retries=args.retries, down_wait_s=args.down_wait,
        token_ids=not args.no_token_ids,
        api_key=os.environ.get(args.api_key_env) if args.api_key_env else None,
        limit=args.limit, progress=not args.quiet, target=target))
    c = s["counts"]
    print(f"regenerated {c['done_now']} samples now, {c['resumed']} before, of {c['samples']} "
          f"({s['samples_per_s']} samples/s) with {s['model']}; request errors "
          f"{c['request_errors'] or 'none'}, retries {c['retries']}; answers "
          f"{'with their token ids' if c['turns_with_server_ids'] else 'as text'}")
    if c.get("answers_cut"):  # the samples end mid-answer, where the server stopped
        print(f"  {c['answers_cut']} of {c['turns']} answers written now were cut at "
              f"--max-tokens {args.max_tokens} (finish_reason \"length\"): they end where the "
              "server stopped, not where the target would; raise --max-tokens to let them "
              "finish", file=sys.stderr if c["answers_cut"] == c["turns"] else sys.stdout)
    ex = s.get("examples", {})
    for what, by in (("malformed", c["malformed"]), ("left out", c.get("left_out", {}))):
        for reason, n in by.items():
            print(f"  {what}: {n} rows {reason} (e.g. {ex.get(reason, '?')})")
    if c.get("damaged_lines"):
        print(f"  repaired {c['damaged_lines']} damaged lines of {args.out}/parts (first: "
              f"{s['damaged'][0]}); set aside in {args.out}/{DAMAGED}, their samples asked "
              "again", file=sys.stderr)
    if not s["finished"]:
        first = "; ".join(f"{k}: {n} (e.g. {ex.get(k, '?')})" for k, n in c["failed"].items())
        print(f"{sum(c['failed'].values())} samples failed ({first}): run the same command "
              f"again to retry them; {MERGED} is written once every sample is done",
              file=sys.stderr)
        return 1
    print(f"wrote {args.out}/{MERGED}; next: dflash-tui data prepare {args.out}/{MERGED} "
          f"--tokenizer TARGET --out DATA")
    return 0


def _inspect(args) -> int:
    from pathlib import Path

    from dflash_core.data.chat_render import load_tokenizer
    from dflash_core.data.inspect import format_report, inspect
    from dflash_core.data.manifest import read_manifest

    spec = args.tokenizer
    if spec is None and Path(args.folder).is_dir():
        spec = ((read_manifest(args.folder) or {}).get("tokenizer") or {}).get("name")
    tok = None
    if spec:
        try:
            tok = load_tokenizer(spec, trust_remote_code=args.trust_remote_code)
        except Exception as exc:  # samples are then shown as ids; say why
            print(f"note: samples shown as ids ({exc})", file=sys.stderr)
    target = _load_target(args.target, args.trust_remote_code) if args.target else None
    r = inspect(args.folder, samples=args.samples, tokenizer=tok, target=target,
                agreement_samples=args.agreement_samples, seed=args.seed)
    from dflash_core.config import EvalConfig

    # low as the run's data finding calls it (eval.agreement_warn's default)
    print(json.dumps(r, indent=2, default=str) if args.json
          else format_report(r, agreement_warn=EvalConfig().agreement_warn))
    return 0
