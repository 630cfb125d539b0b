"""What a text round trip does to the tokens the target wrote, measured on one answer.

A server that returns only text leaves ``prepare`` to re-tokenize each answer, and the text may
not give back the target's tokens: a server that strips an answer's leading whitespace (the target
wrote ``'       ', ' if'``, the text re-tokenizes as ``'if'``), merges that differ where the
answer meets the template's text, bytes that are not UTF-8 replaced. With the target at hand this
measures it: the answer, rendered as prepare will, against the target's greedy next token at each
of its positions (the template's end of turn counted only where the target stopped by itself).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_core.data.conversations import Conversation

RISKS = ("a server that strips an answer's leading whitespace, merges that differ where the "
         "answer meets the template's text, bytes that are not UTF-8 replaced")


@dataclass
class RoundTrip:
    agree: int
    total: int
    first_difference: tuple[int, str, str] | None  # (answer token, the text's, the target's)

    def words(self, sample: str) -> str:
        out = (f"round trip measured with the target on {sample}: {self.agree} of {self.total} "
               "tokens of the returned answer are the target's greedy next token")
        if self.first_difference is not None:
            k, text, own = self.first_difference
            out += (f"; first difference at answer token {k}: the text gives {text!r}, the "
                    f"target writes {own!r}")
        return out

    def as_dict(self) -> dict:
        return {"agree": self.agree, "positions": self.total,
                "first_difference": list(self.first_difference) if self.first_difference
                else None}


def _last_run(mask: list[int]) -> tuple[int, int]:
    end = len(mask)
    while end and not mask[end - 1]:
        end -= 1
    start = end
    while start and mask[start - 1]:
        start -= 1
    return start, end


def measure(renderer, target, history: list[dict], answer: dict,
            finish_reason: str | None) -> RoundTrip:
    """``answer``: the assistant message as regenerate writes it (content, reasoning, no ids);
    ``history``: the messages before it; ``target``: an HF causal LM."""
    import torch

    conv = Conversation("round-trip", [*history, {k: v for k, v in answer.items()
                                                  if k != "token_ids"}])
    sample = renderer.render(conv)[-1]  # a split row: the last sample is this turn's
    ids, mask = sample.input_ids, sample.loss_mask
    start, end = _last_run(mask)
    shown = renderer.template_messages(conv.messages)
    closing = renderer.closing_ids(shown[:-1])
    n = len(closing) if closing and ids[end - len(closing):end] == closing else 0
    # the end of turn is the target's own only where it stopped by itself
    stop = end - n + (1 if n and finish_reason == "stop" else 0)
    positions = list(range(max(1, start), stop))
    if not positions:
        return RoundTrip(0, 0, None)
    dev = next(target.parameters()).device
    with torch.no_grad():
        x = torch.tensor([ids[:positions[-1]]], dtype=torch.long, device=dev)
        pred = target(input_ids=x).logits[0].argmax(-1).tolist()
    agree, first = 0, None
    for k, t in enumerate(positions):
        if pred[t - 1] == ids[t]:
            agree += 1
        elif first is None:
            tok = renderer.tok
            first = (k, tok.decode([ids[t]]), tok.decode([pred[t - 1]]))
    return RoundTrip(agree, len(positions), first)
