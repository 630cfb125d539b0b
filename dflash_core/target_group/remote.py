"""A target whose layers run in a target group, as the engine's decoding and evaluation use a
loaded target: ``GroupTarget``. Its forwards are the group's verify requests (verify.py); the
drafter, the acceptance and everything the evaluation counts stay in this process.

The one decoding loop (eval/spec_decode.decode_rows) drives it through the same backends as a
target of this process (eval/target_decoding.py): ``rows_backend`` and ``ModelTarget.decoding``
ask the target for its own when it has one, and a group's are these:

- ``GroupBatch`` (eval.cache off, ``--cache`` not given): one forward per round over every
  prompt, each its kept tokens and its newly fed ones, as ``FullBatch``; the ranks return only
  the logits and the features at the fed positions, and this process keeps each prompt's
  features of the tokens it kept. (FullBatch takes a kept token's features from the latest
  forward, this from the round that fed it: the same values, computed once.)
- ``RemoteCached`` (eval.cache, ``--cache``): each prompt's cache kept in the ranks
  (CachedDecoding there), a round feeding only its new tokens.
- ``RemoteFull``: one prompt's full forwards (the held-out evaluation's ``FullDecoding``), the
  whole prefix each round, the logits of the fed positions only coming back.

The results come back to ``device`` (the drafter's) as tensors this process owns.
bench/target/group_verify.py measured the two paths on the CPU (bench/BENCHMARKS.md).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import weakref
from types import SimpleNamespace

import torch

from dflash_core.target_group.group import TargetGroup, TargetHeads
from dflash_core.target_group.rank import POLL_S


class GroupClosed(RuntimeError):
    """The group was closed (the run stopping) while a verify request waited on it."""


def _own(value, device: torch.device):
    """``value`` (a rank's answer) with every tensor copied into memory of this process on
    ``device``."""
    if isinstance(value, torch.Tensor):
        out = value.to(device, copy=True)
        for d in {value.device, out.device}:
            if d.type == "cuda":
                torch.cuda.synchronize(d)  # copied before the rank may reuse its buffer
        return out
    if isinstance(value, (tuple, list)):
        return type(value)(_own(v, device) for v in value)
    return value


class VerifyClient:
    """Verify requests to every rank of ``group``, rank 0's answers from its verify queue; a
    rank's failure or death raised as GroupRankFailed naming the rank and its GPU."""

    def __init__(self, group: TargetGroup, device: torch.device):
        self.group, self.device = group, torch.device(device)
        self.vseq = 0
        self.lock = threading.Lock()
        self.dropped: list = []  # keys of cached rows no longer held here (their finalizers)

    def call(self, op: str, reply: bool = True, **args):
        with self.lock:
            self.vseq += 1
            if self.dropped:
                args["drop"], self.dropped = self.dropped, []
            msg = ("verify", self.vseq, op, args)
            for q in self.group.requests:
                try:
                    q.put(msg)
                except (OSError, ValueError) as exc:  # closed: the group is being shut down
                    raise GroupClosed(f"target group {self.group.index} is closed") from exc
            return self._answer(self.vseq) if reply else None

    def _answer(self, vseq: int):
        g = self.group
        while True:
            try:
                msg = g.verified.get(timeout=POLL_S)
            except queue.Empty:
                if g.closing:
                    raise GroupClosed(f"target group {g.index} was closed") from None
                dead = g.dead_rank()
                if dead is not None:
                    time.sleep(POLL_S)  # its last words (a traceback) may still be on the way
                    try:
                        msg = g.verified.get_nowait()
                    except (queue.Empty, OSError, ValueError):
                        raise dead from None
                    if msg[0] != "rank-error":
                        raise dead from None
                else:
                    continue
            except (OSError, ValueError) as exc:
                raise GroupClosed(f"target group {g.index} was closed") from exc
            if msg[0] == "rank-error":
                raise g.rank_error(msg[1], msg[2])
            if msg[0] == "verified" and msg[1] == vseq:
                return _own(msg[2], self.device)
            # an answer to an earlier request whose caller gave up (an interrupt): skipped


class RemoteCausalLM:
    """What a caller reads of ``target.model``: its config, and the forward with
    ``output_hidden_states`` (the check's feature probe)."""

    def __init__(self, config, client: VerifyClient):
        self.config, self.client = config, client

    def __call__(self, input_ids: torch.Tensor, output_hidden_states: bool = True,
                 use_cache: bool = False, **_):
        hs = self.client.call("hidden_states", input_ids=input_ids.detach().to("cpu"))
        return SimpleNamespace(hidden_states=hs)


def _rows(x) -> list[list[int]]:
    """Sequences as lists of ints (tensors [T] / [b, T], arrays, lists)."""
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        return [t.tolist()] if t.dim() == 1 else t.tolist()
    rows = list(x)
    if rows and not hasattr(rows[0], "__len__"):
        rows = [rows]
    return [[int(v) for v in r] for r in rows]


class GroupTarget:
    """A target.TargetModel's face for a target whose layers run in ``group``: the accessors
    the drafter and the evaluation read (config, embedding and lm_head, sizes), and its forwards
    run by the ranks. ``device``: where every result is put (the drafter's); ``heads_device``:
    where the embedding and lm_head the drafter borrows are put (None: where they are, the
    CPU)."""

    def __init__(self, group: TargetGroup, heads: TargetHeads, device: torch.device,
                 heads_device: torch.device | None = None):
        self.group, self.heads = group, heads
        self.client = VerifyClient(group, device)
        self.model = RemoteCausalLM(heads.model.config, self.client)
        self.text_config = heads.text_config
        self.embed_tokens, self.lm_head = heads.embed_tokens, heads.lm_head
        if heads_device is not None:
            self.embed_tokens = self.embed_tokens.to(heads_device)
            self.lm_head = self.lm_head.to(heads_device)
        self.hidden_size, self.vocab_size = heads.hidden_size, heads.vocab_size
        self.num_layers = heads.num_layers
        self.quantized = None
        self.device = torch.device(device)
        self.dtype = getattr(torch, group.dtype)
        self._keys = itertools.count()

    # -- TargetModel's forwards ----------------------------------------------------------------
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 layer_ids: list[int] | None = None, stop=None,
                 with_last_hidden: bool = False) -> torch.Tensor:
        return self.client.call(
            "features", input_ids=input_ids.detach().to("cpu"),
            attention_mask=None if attention_mask is None else attention_mask.detach().to("cpu"),
            layer_ids=None if layer_ids is None else list(layer_ids),
            with_last_hidden=with_last_hidden)

    def logits_and_features(self, input_ids: torch.Tensor, layer_ids: list[int] | None = None,
                            attention_mask: torch.Tensor | None = None):
        return self.client.call(
            "logits_and_features", input_ids=input_ids.detach().to("cpu"),
            layer_ids=None if layer_ids is None else list(layer_ids),
            attention_mask=None if attention_mask is None else attention_mask.detach().to("cpu"))

    def forward_rows(self, rows: list[list[int]], fed: list[int], layer_ids: list[int],
                     exact_head: bool, last: list[int] | None = None):
        """verify.Verifier._forward: (logits [m, F, V], features [m, F, k*H]) at the fed
        positions of each row."""
        return self.client.call("forward", rows=[list(r) for r in rows], fed=list(fed),
                                layer_ids=list(layer_ids), exact_head=exact_head,
                                last=None if last is None else list(last))

    # -- what decoding and the evaluation ask of a target (their own, where it has one) ----------
    def head_is_lm_head(self, probe: list[int], layer_ids: list[int]) -> bool:
        return bool(self.client.call("exact_head", probe=list(probe), layer_ids=list(layer_ids)))

    def label_agreement(self, input_ids, loss_mask, max_positions: int, chunk: int,
                        seed: int) -> tuple[int, int]:
        agree, total = self.client.call("agreement", input_ids=_rows(input_ids),
                                        loss_mask=_rows(loss_mask), max_positions=max_positions,
                                        chunk=chunk, seed=seed)
        return int(agree), int(total)

    def decoding(self, layer_ids, cache: bool):
        """One prompt's state (target_decoding.Decoding): its cache in the ranks, or full
        forwards."""
        ids = list(layer_ids) if layer_ids is not None else None
        return RemoteCached(self, ids) if cache else RemoteFull(self, ids)

    def rows_backend(self, layer_ids: list[int], cache: bool, exact_head: bool = True):
        """spec_decode.decode_rows's backend (target_decoding.rows_backend's choice)."""
        from dflash_core.eval.target_decoding import Rows

        if cache:
            return Rows(lambda: RemoteCached(self, list(layer_ids)))
        return GroupBatch(self, list(layer_ids), exact_head)

    def new_key(self) -> int:
        return next(self._keys)


class _Feats:
    """One prompt's features of the tokens it fed and kept, as chunks on the result device."""

    def __init__(self):
        self.chunks: list[torch.Tensor] = []  # [n, k*H] each
        self.length = 0

    def add(self, feats: torch.Tensor) -> None:
        self.chunks.append(feats)
        self.length += feats.shape[0]

    def whole(self) -> torch.Tensor:
        if len(self.chunks) > 1:
            self.chunks = [torch.cat(self.chunks, dim=0)]
        return self.chunks[0]

    def cut(self, length: int) -> None:
        if length < self.length:
            self.chunks = [self.whole()[:length]]
            self.length = length


class RemoteFull:
    """One prompt without a cache (target_decoding.FullDecoding's rule): each feed one forward
    of every kept token and the new ones in the ranks; the model's own logits."""

    def __init__(self, target: GroupTarget, layer_ids: list[int] | None):
        self.target = target
        self.layer_ids = layer_ids if layer_ids is not None else _default_ids(target)
        self.tokens: list[int] = []
        self.feats = _Feats()

    def feed(self, new: list[int], last: int = 0) -> torch.Tensor:
        self.tokens.extend(new)
        logits, feats = self.target.forward_rows([self.tokens], [len(new)], self.layer_ids,
                                                 exact_head=False, last=[last or len(new)])
        self.feats.add(feats[0, :len(new)])
        return logits[0, :last or len(new)]

    def features(self) -> torch.Tensor:
        return self.feats.whole()[None]

    def rewind(self, length: int) -> None:
        del self.tokens[length:]
        self.feats.cut(length)


class RemoteCached:
    """One prompt with its cache in the ranks (verify.py's "feed" / "rewind": CachedDecoding
    there). The ranks drop the cache once this object is gone (its key rides on the next
    request)."""

    def __init__(self, target: GroupTarget, layer_ids: list[int] | None):
        from dflash_core.eval.target_decoding import attention_only

        self.target = target
        self.layer_ids = layer_ids if layer_ids is not None else _default_ids(target)
        self.key = target.new_key()
        self.croppable = attention_only(target.text_config)
        self.tokens: list[int] = []
        self.before = 0  # tokens kept before the last feed
        self.feats = _Feats()
        dropped = target.client.dropped
        weakref.finalize(self, dropped.append, self.key)

    def feed(self, new: list[int], last: int = 0) -> torch.Tensor:
        self.before = len(self.tokens)
        logits, feats = self.target.client.call("feed", key=self.key, tokens=list(new),
                                                last=last, layer_ids=self.layer_ids)
        self.tokens.extend(new)
        self.feats.add(feats[0])
        return logits

    def features(self) -> torch.Tensor:
        return self.feats.whole()[None]

    def rewind(self, length: int) -> None:
        if length >= len(self.tokens):
            return
        # a cache cut back answers nothing; one taken back and fed again sends the features of
        # what it fed again
        again = self.target.client.call("rewind", reply=not self.croppable, key=self.key,
                                        length=length, since=self.before)
        del self.tokens[length:]
        self.feats.cut(self.before if again is not None else length)
        if again is not None:
            self.feats.add(again[0])


def _default_ids(target: GroupTarget) -> list[int]:
    from dflash_core.models.target.config import default_layer_ids

    return default_layer_ids(target.num_layers)


class GroupBatch:
    """spec_decode.decode_rows's backend for a batch of prompts: one forward per round in the
    ranks over every prompt (target_decoding.FullBatch's rule; see the module)."""

    def __init__(self, target: GroupTarget, layer_ids: list[int], exact_head: bool = True):
        self.target, self.layer_ids, self.exact_head = target, list(layer_ids), exact_head
        self.tokens: dict[int, list[int]] = {}
        self.feats: dict[int, _Feats] = {}

    def start(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        self.tokens = {i: [] for i in range(len(prompts))}
        self.feats = {i: _Feats() for i in range(len(prompts))}
        return [lg[-1] for lg in self.verify(list(range(len(prompts))), prompts)]

    def verify(self, rows: list[int], feeds: list[list[int]]) -> list[torch.Tensor]:
        """Append ``feeds[j]`` to row ``rows[j]``; the target's logits [len(feed), V] at each."""
        for r, f in zip(rows, feeds):
            self.tokens[r].extend(f)
        fed = [len(f) for f in feeds]
        logits, feats = self.target.forward_rows([self.tokens[r] for r in rows], fed,
                                                 self.layer_ids, self.exact_head)
        for j, (r, n) in enumerate(zip(rows, fed)):
            self.feats[r].add(feats[j, :n])
        return [logits[j, :n] for j, n in enumerate(fed)]

    def context(self, rows: list[int], lengths: list[int]) -> torch.Tensor:
        """[m, max(lengths), k*H]: each row's features of its first ``lengths`` tokens."""
        S = max(lengths)
        parts = [self.feats[r].whole()[:S] for r in rows]
        out = parts[0].new_zeros((len(rows), S, parts[0].shape[-1]))
        for j, p in enumerate(parts):
            out[j, :p.shape[0]] = p
        return out

    def keep(self, row: int, length: int) -> None:
        del self.tokens[row][length:]
        self.feats[row].cut(length)
