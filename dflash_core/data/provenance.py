"""Where a data set's responses came from, said once and carried along: ``data regenerate`` writes
it in its folder (``dflash_regen.json``, key ``provenance``: ``regen_record``), ``data prepare``
carries it into the prepared data's manifest (``dflash_data.json``, key ``provenance``:
``for_manifest``), and the run's data finding and ``data inspect`` read it (``of_manifest``) to
name the likely cause of labels that are not the target's (``acceptance.data_cause``).

Regenerated answers come back as token ids (vLLM with ``return_token_ids``: the target's own
tokens, which prepare trains on) or as text only (``transformers serve``, SGLang's OpenAI API:
prepare re-tokenizes the text, and the round trip can change the target's tokens: round_trip.py).
Which one is counted turn by turn from the rows themselves (regenerate writes ``regenerated`` on
each row and ``token_ids`` on each answer that came with them), so it holds for a copy or a
concatenation of regenerated files too; the regeneration's own record (the server, its settings,
the round trip its probe measured) joins it when the source is the very file regenerate wrote
(its hash). A manifest without it (an older prepare) reads as None: nothing is known.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dflash_core.data.conversations import Conversation

REGEN_MANIFEST = "dflash_regen.json"  # regen/parts.MANIFEST, named here without importing regen/
REGEN_MERGED = "conversations.jsonl"  # regen/parts.MERGED


def answers_kind(text: int, ids: int) -> str | None:
    """How the answers came back: "text", "token_ids", "mixed"; None without any."""
    if text and ids:
        return "mixed"
    return "text" if text else "token_ids" if ids else None


# -- regenerate -----------------------------------------------------------------------------------

def turns_of(row: dict) -> tuple[int, int]:
    """(answers as text, answers with the server's token ids) of a row regenerate wrote."""
    text = ids = 0
    for m in row.get("messages") or ():
        if isinstance(m, dict) and m.get("role") == "assistant":
            if m.get("token_ids"):
                ids += 1
            else:
                text += 1
    return text, ids


def regen_record(*, model: str, api: str, endpoints: list[str], served_by: dict, options,
                 text: int, ids: int, text_only_because: str | None, round_trip: dict | None,
                 conversations_fingerprint: str) -> dict:
    """What ``data regenerate`` records of where its answers came from. ``text`` / ``ids``: the
    answers of every merged row (this run's and the runs before); ``served_by``: each endpoint's
    ``owned_by`` in /v1/models (vLLM: ``vllm``, SGLang: ``sglang``); ``options``: its
    RegenOptions; ``text_only_because`` / ``round_trip``: what the probe found (the round trip
    measured with the target at hand, with the sample it was measured on)."""
    return {
        "answers": answers_kind(text, ids), "answers_as_text": text, "answers_as_token_ids": ids,
        "model": model, "api": api, "endpoints": list(endpoints), "served_by": served_by,
        "temperature": options.temperature, "thinking": options.thinking,
        "max_tokens": options.max_tokens, "text_only_because": text_only_because,
        "round_trip": round_trip, "conversations_fingerprint": conversations_fingerprint,
    }


# -- prepare --------------------------------------------------------------------------------------

@dataclass
class Origins:
    """The used rows' origins, counted in prepare's workers and summed in source order."""

    rows: int = 0
    regenerated_rows: int = 0
    answers_as_text: int = 0  # answers of regenerated rows re-tokenized from text
    answers_as_token_ids: int = 0  # ... trained on the server's token ids
    models: dict = field(default_factory=dict)  # the regenerating model's name: rows

    def count(self, conv: Conversation) -> None:
        self.rows += 1
        reg = conv.extra.get("regenerated")
        if not isinstance(reg, dict):
            return
        self.regenerated_rows += 1
        text, ids = turns_of({"messages": conv.messages})
        self.answers_as_text += text
        self.answers_as_token_ids += ids
        model = str(reg.get("model") or "?")
        self.models[model] = self.models.get(model, 0) + 1

    def add(self, other: "Origins") -> None:
        self.rows += other.rows
        self.regenerated_rows += other.regenerated_rows
        self.answers_as_text += other.answers_as_text
        self.answers_as_token_ids += other.answers_as_token_ids
        for k, v in other.models.items():
            self.models[k] = self.models.get(k, 0) + v


def regen_record_for(files: list[Path], fingerprint: str) -> dict | None:
    """The regeneration's record beside a source that is exactly the file it wrote (a folder of
    regenerate, or its conversations.jsonl, unchanged since: the same hash); None otherwise."""
    if len(files) != 1 or files[0].name != REGEN_MERGED:
        return None
    try:
        summary = json.loads((files[0].parent / REGEN_MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # no record, or one that cannot be read: the rows still say what they are
    rec = summary.get("provenance") if isinstance(summary, dict) else None
    if isinstance(rec, dict) and rec.get("conversations_fingerprint") == fingerprint:
        return rec
    return None


def for_manifest(origins: Origins, record: dict | None) -> dict:
    """The prepared data's ``provenance``: the used rows' origins, and the regeneration's record
    when the source is the file it wrote."""
    return {
        "rows": origins.rows, "regenerated_rows": origins.regenerated_rows,
        "answers": answers_kind(origins.answers_as_text, origins.answers_as_token_ids),
        "answers_as_text": origins.answers_as_text,
        "answers_as_token_ids": origins.answers_as_token_ids,
        "models": dict(sorted(origins.models.items())),
        "regeneration": record,
    }


# -- readers --------------------------------------------------------------------------------------

def of_manifest(manifest: dict | None) -> dict | None:
    """A prepared data's provenance, or None (data of an older prepare, or made otherwise)."""
    p = manifest.get("provenance") if isinstance(manifest, dict) else None
    return p if isinstance(p, dict) else None


def describe(p: dict | None) -> str:
    """One line for ``data prepare`` and ``data inspect``: where the responses came from."""
    if not p:
        return "responses: not recorded (data prepared before provenance was kept)"
    rows, regen = p.get("rows") or 0, p.get("regenerated_rows") or 0
    if not regen:
        return f"responses: as the source gives them ({rows} rows; none regenerated)"
    rec = p.get("regeneration") or {}
    models = ", ".join(repr(m) for m in (p.get("models") or {})) or "?"
    text, ids = p.get("answers_as_text") or 0, p.get("answers_as_token_ids") or 0
    how = {"text": "as text (prepare re-tokenized them)",
           "token_ids": "with the server's token ids",
           "mixed": f"{text} as text (re-tokenized), {ids} with the server's token ids"}.get(
        p.get("answers") or "", "?")
    line = (f"responses: {regen} of {rows} rows regenerated by {models}"
            + (f" through {', '.join(rec['endpoints'])}" if rec.get("endpoints") else "")
            + f", answers {how}")
    rt = rec.get("round_trip")
    if isinstance(rt, dict) and rt.get("positions"):
        line += (f"; the probe's round trip: {rt.get('agree')} of {rt.get('positions')} tokens "
                 f"the target's own on sample {rt.get('sample')}")
    return line
