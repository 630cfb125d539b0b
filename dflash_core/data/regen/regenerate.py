"""``data regenerate``: every assistant turn rewritten by the target, through OpenAI-compatible
servers (vLLM, SGLang, ``transformers serve``, or anything that speaks ``/v1/chat/completions`` or
``/v1/completions``).

Turn by turn: each assistant turn is asked for with the history so far, whose earlier assistant
turns are the target's own answers. Two ways to ask:

- ``api="chat"``: ``/v1/chat/completions`` with the messages; the server applies its template.
- ``api="completions"``: the prompt rendered here with the target's tokenizer and chat template and
  sent as token ids to ``/v1/completions`` (the server sees exactly the ids the drafter will).

Both ask for ``"return_token_ids": true``: vLLM then returns the answer's ids as
``choices[0].token_ids``; other servers ignore the field or refuse it. The ids are kept on the
turn (``token_ids``) and ``prepare`` trains on them. Reasoning comes back as
``message.reasoning_content`` (vLLM and SGLang with a reasoning parser) or inline ``<think>``.

One probe request goes first (``job.Job.probe``): it finds out what the server takes (token ids,
else text: a server that refuses ``return_token_ids`` is asked for text), says so in one line,
and stops the command with the server's own words and the fix when it refuses the request as
made (``--api completions`` on a server that takes text prompts only). When only text comes
back, the line says what a text round trip may change, and with the target at hand
(``target``) measures it on the probe's answer (``round_trip``).

Work is spread over the endpoints, ``concurrency`` requests in flight on each. A failed request
(timeout, HTTP 429 / 5xx, an unreadable answer) is retried with exponential backoff; a sample whose
retries run out is counted by error and left for the next run. A run of identical refusals (4xx)
stops the command with the fix instead of sending the rest. An endpoint that stops answering
(connection refused) is waited for, with backoff, up to ``down_wait_s``, without spending retries:
its samples go back to the queue, the progress line says it waits. Results are appended, one JSON
line per finished sample, to a file per endpoint under ``parts/`` (flushed and fsynced), so a
re-run of the same command skips the ids already there; a line damaged anywhere in a part is set
aside (``DAMAGED``) and its sample asked again. When every sample is done, the parts are merged in
source order into ``conversations.jsonl`` and ``dflash_regen.json`` is written last, with where the
answers came from (``provenance``: text or token ids over every merged row, the server, the round
trip the probe measured), which prepare carries on. A server that answers with another model's name
stops the run: that data would not be the target's. The output folder is never an input nor a
folder of other files, and has one writer at a time (``output``, ``lock``); its settings bind it
once a sample was written there.

Here the command's checks and set-up; the options: options.py; one turn's request and
answer: turn.py; the probe, the workers and the summary: job.py; the output folder's
parts, state and merge: parts.py; what stops a run: errors.py; one server: endpoint.py.
"""

from __future__ import annotations

import time
from pathlib import Path

from dflash_core.data.conversations import source_files, source_fingerprint
from dflash_core.data.regen.endpoint import Endpoint
from dflash_core.data.lock import OutputLock
from dflash_core.data.output import OWNER, check_apart, check_out, mark_owner
from dflash_core.data.regen.errors import ModelMismatch
from dflash_core.data.regen.job import Job, note
from dflash_core.data.regen.options import RegenOptions, check_options
from dflash_core.data.regen.parts import check_state, has_samples
from dflash_core.data.shards import DataError


def regenerate(opts: RegenOptions) -> dict:
    """Run (or continue) a regeneration. Returns the summary; ``summary["finished"]`` is False
    when some samples failed (a re-run retries them). Raises DataError for bad input (and for a
    server that refuses the requests as made: ``ServerRefuses``, with the fix), ServerFailing
    for a server that cannot answer."""
    t0 = time.monotonic()
    check_options(opts)
    if not opts.endpoints:
        raise DataError("no endpoint given", hint="pass --endpoint http://HOST:PORT")
    _, files = source_files(opts.source)
    out = Path(opts.out).expanduser().resolve()  # a link: the folder it names
    check_apart(out, [("conversations source", opts.source), ("tokenizer folder",
                      opts.tokenizer), ("chat template", opts.chat_template)])
    check_out(out, "regenerate", overwrite=False)  # before asking any server
    renderer = None
    if opts.api == "completions" or opts.target is not None:
        if not opts.tokenizer:
            raise DataError("--api completions renders the prompt here: it needs --tokenizer"
                            if opts.api == "completions" else "measuring a text round trip "
                            "with --target renders the answers here: it needs --tokenizer",
                            hint="pass --tokenizer TARGET_FOLDER" + (
                                " (or use --api chat)" if opts.api == "completions" else ""))
        from dflash_core.data.chat_render import ChatRenderer, load_tokenizer
        renderer = ChatRenderer(load_tokenizer(opts.tokenizer, opts.chat_template,
                                               opts.trust_remote_code),
                                opts.thinking)
    endpoints = [Endpoint(u, opts.timeout_s, opts.api_key) for u in opts.endpoints]
    if len({e.name for e in endpoints}) != len(endpoints):
        raise DataError("the same endpoint is given twice", hint="list each server once")
    model = opts.model
    for e in endpoints:
        served = e.models()
        if model is None:
            if not served:
                raise DataError(f"endpoint {e.url} lists no model", hint="pass --model NAME")
            model = served[0]
        if model not in served:
            raise ModelMismatch(f"endpoint {e.url} serves {served}, not {model!r}",
                                hint="point every --endpoint at a server of the target "
                                     "(or pass --model with the name it is served under)")
    with OutputLock(out, "regenerate", note):
        check_out(out, "regenerate", overwrite=False)
        out.mkdir(parents=True, exist_ok=True)
        if not (out / OWNER).exists():
            mark_owner(out, "regenerate")
        replaced = check_state(out, {
            "source_fingerprint": source_fingerprint(files), "model": model, "api": opts.api,
            "thinking": opts.thinking, "max_tokens": opts.max_tokens,
            "temperature": opts.temperature, "limit": opts.limit}, has_samples(out))
        if replaced:
            note(replaced)
        return Job(opts, out, endpoints, model, renderer).run(t0)
