"""One assistant turn of ``data regenerate``: the request that asks for it (chat messages, or
the prompt's token ids for ``/v1/completions``) and the server's answer read into a ``Turn``."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_core.data.conversations import RowError, split_thinking
from dflash_core.data.regen.endpoint import RequestFailed
from dflash_core.data.regen.errors import ModelMismatch
from dflash_core.data.regen.options import RegenOptions


@dataclass
class Turn:
    content: str
    reasoning: str | None
    token_ids: list[int] | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


class Asker:
    """Builds the request for the next assistant turn and reads the answer."""

    def __init__(self, opts: RegenOptions, model: str, renderer=None):
        self.opts, self.model, self.renderer = opts, model, renderer
        self.token_ids = opts.token_ids  # False once the probe found the field refused

    @property
    def path(self) -> str:
        return "/v1/completions" if self.opts.api == "completions" else "/v1/chat/completions"

    def body(self, history: list[dict]) -> tuple[str, dict]:
        o = self.opts
        body: dict = {"model": self.model, "max_tokens": o.max_tokens,
                      "temperature": o.temperature}
        if self.token_ids:
            body["return_token_ids"] = True
        if o.api == "completions":
            try:
                body["prompt"] = self.renderer.prompt_ids(history)
            except RowError:
                raise
            except Exception as exc:  # the tokenizer's own error on this row's text
                raise RowError("render_error", f"{type(exc).__name__}: {exc}") from exc
            return "/v1/completions", body
        body["messages"] = [{"role": m["role"], "content": m["content"]} for m in history]
        return "/v1/chat/completions", body

    def read(self, out: dict) -> Turn:
        if out.get("model") not in (None, self.model):
            raise ModelMismatch(f"the server answered as model {out.get('model')!r}, not "
                                f"{self.model!r}",
                                hint="point --endpoint at servers of the target only")
        # Every field is checked: an answer that cannot be used is a failed request (retried,
        # then counted), never an exception that stops the run.
        try:
            choice = out["choices"][0]
        except (KeyError, IndexError, TypeError) as exc:
            raise RequestFailed("bad_response", "no choices in the answer", True) from exc
        if not isinstance(choice, dict):
            raise RequestFailed("bad_response", "choices[0] is not an object", True)
        if self.opts.api == "completions":
            text, reasoning = choice.get("text"), None
        else:
            msg = choice.get("message")
            if not isinstance(msg, dict):
                raise RequestFailed("bad_response", "choices[0].message is not an object", True)
            text = msg.get("content")
            reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if not isinstance(text, str):
            raise RequestFailed("bad_response", "the answer holds no text", True)
        if reasoning is not None and not isinstance(reasoning, str):
            raise RequestFailed("bad_response", "the answer's reasoning is not text", True)
        if reasoning is None:
            text, reasoning = split_thinking(text)
        for what, value in (("text", text), ("reasoning", reasoning or "")):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestFailed("bad_response", f"the answer's {what} holds a lone "
                                    "surrogate", True) from None
        ids = choice.get("token_ids")
        if ids is not None and not (isinstance(ids, list) and all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids)):
            raise RequestFailed("bad_response", "token_ids is not a list of token ids", True)
        ids = list(ids) if ids else None
        usage = out.get("usage")
        usage = usage if isinstance(usage, dict) else {}

        def count(key: str, default: int) -> int:
            v = usage.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else default

        finish = choice.get("finish_reason")
        return Turn(text, reasoning, ids, finish if isinstance(finish, str) else None,
                    count("prompt_tokens", 0), count("completion_tokens", len(ids or ())))
