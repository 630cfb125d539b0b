"""Speculative decoding through a target group against one process, on the same tiny target:
decoded tokens/s of the group's two verify paths (target_group/remote.py), full forwards of the
whole prefix each round (GroupBatch: every prompt in one forward) and each prompt's cache kept
in the ranks (RemoteCached: one forward per prompt, only its new tokens), beside the same two
paths in one process (FullBatch, CachedRows).

    OMP_NUM_THREADS=1 python bench/target/group_verify.py --device cpu --ranks 2

The drafter is an oracle (it proposes the target's own greedy text, one slot spoiled at every
third position), so rounds accept part of their blocks as a trained drafter's do and every path
decodes the same tokens; its own cost is nil, so the figures are the target's side alone. One
process runs with as many threads as the group has ranks; each figure is the best of --repeat.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from dflash_core.models.proposal import Proposal  # noqa: E402


def build_target(folder: Path, hidden: int, layers: int, vocab: int) -> None:
    import transformers as tf
    cfg = tf.Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=hidden // 4, tie_word_embeddings=False)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)


class Oracle:
    """Drafts the continuation in ``truth`` ((position, token) -> the tokens after), one slot
    spoiled at every third position."""

    def __init__(self, truth: dict, block_size: int):
        self.truth, self.block_size = truth, block_size

    def draft_batch(self, context, lengths, last, temperature=0.0, gens=None) -> Proposal:
        n = self.block_size - 1
        rows = []
        for S, t in zip(lengths, last):
            row = (list(self.truth.get((S, t), [])) + [0] * n)[:n]
            if S % 3 == 0:
                row[n // 2] = (row[n // 2] + 1) % 7
            rows.append(row)
        return Proposal(torch.tensor(rows), None)


def timed(backend, drafter, prompts, new: int, repeat: int = 1):
    """(rows, the best of ``repeat`` decodings' seconds): the machine may be shared."""
    from dflash_core.eval.spec_decode import DecodeSettings, decode_rows
    best = float("inf")
    for _ in range(repeat):
        b = backend()
        t0 = time.perf_counter()
        rows = decode_rows(b, drafter, prompts, DecodeSettings(new))
        best = min(best, time.perf_counter() - t0)
    return rows, best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mode", default="sharded", choices=("sharded", "shared"))
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3, help="best of this many decodings")
    args = ap.parse_args()
    from dflash_core.eval.target_decoding import rows_backend
    from dflash_core.models.target.load import load_target
    from dflash_core.target_group.session import GroupSession
    from dflash_core.target_group.split import GroupSplit

    device = torch.device(args.device)
    layers = [1, 2]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "target"
        build_target(folder, args.hidden, args.layers, args.vocab)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, args.vocab, (args.prompt_tokens,), generator=g).tolist()
                   for _ in range(args.prompts)]
        torch.set_num_threads(args.ranks)
        one = load_target(folder, device=device, dtype="float32")
        plain, _ = timed(lambda: rows_backend(one, layers, False), None, prompts,
                         args.new + args.block)
        truth = {}
        for p, r in zip(prompts, plain):
            full = p + r.tokens
            for S in range(len(p), len(full) - 1):
                truth[(S, full[S])] = full[S + 1:]
        results = {}
        for cache in (False, True):
            rows, secs = timed(lambda: rows_backend(one, layers, cache),
                               Oracle(truth, args.block), prompts, args.new, args.repeat)
            results[("one process", cache)] = (rows, secs)
        devices = ([torch.device("cuda", i) for i in range(args.ranks)]
                   if device.type == "cuda" else [device] * args.ranks)
        t0 = time.perf_counter()
        session = GroupSession(folder, devices, GroupSplit(args.ranks, args.mode, True),
                               dtype="float32", attn_implementation="sdpa", layer_ids=layers,
                               trust_remote_code=False, folder=Path(tmp) / "run",
                               say=lambda m: None)
        try:
            target = session.open(device)
            start = time.perf_counter() - t0
            timed(lambda: rows_backend(target, layers, False), None, prompts[:1], 4)  # warm-up
            for cache in (False, True):
                rows, secs = timed(lambda: rows_backend(target, layers, cache),
                                   Oracle(truth, args.block), prompts, args.new, args.repeat)
                results[(f"group of {args.ranks} ({args.mode})", cache)] = (rows, secs)
        finally:
            session.close()
    want = [r.tokens for r in plain]
    print(f"{args.prompts} prompts x {args.prompt_tokens} tokens, {args.new} new each, block "
          f"{args.block}, hidden {args.hidden}, {args.layers} layers, {device}; the group "
          f"started in {start:.1f} s")
    print("| decoding | verify path | tokens/s | rounds | tau | output = plain |")
    print("|---|---|---|---|---|---|")
    for (who, cache), (rows, secs) in results.items():
        toks = sum(len(r.tokens) for r in rows)
        rounds = sum(len(r.acceptance) for r in rows)
        tau = sum(a + 1 for r in rows for a in r.acceptance) / max(1, rounds)
        same = all(r.tokens == w[:len(r.tokens)] for r, w in zip(rows, want))
        path = "cache" if cache else "full forwards"
        print(f"| {who} | {path} | {toks / secs:,.0f} | {rounds} | {tau:.2f} | {same} |")


if __name__ == "__main__":
    main()
