"""A small OpenAI-compatible server that generates with the demo target, for tests and benchmarks.

It listens on 127.0.0.1 only, on a free port, and only while a test or benchmark holds it
(``with DemoServer(target_folder) as srv: srv.url``). It answers ``GET /v1/models``,
``POST /v1/completions`` (prompt as text or token ids) and ``POST /v1/chat/completions`` (the
demo chat template), by greedy decoding (or sampling at ``temperature > 0``) of the tiny target
with a KV cache, stopping at ``<|endoftext|>`` or ``max_tokens``. With ``return_token_ids`` it
returns the ids as vLLM does (``choices[0].token_ids``, ``prompt_token_ids``).

Faults for tests: ``fail_first`` requests answered 500, ``hang_first`` requests held
``hang_s`` seconds before answering, ``trickle_first`` requests answered a byte every
``trickle_s`` seconds, ``answer_as`` another model name in every answer.
Generation runs one request at a time (a lock): the model is small and the machine has few cores.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from dflash_core import demo
from dflash_core.data.byte_vocab import EOS_ID, byte_tokenizer, decode


class DemoServer:
    def __init__(self, target_folder: str | Path, *, name: str = "dflash-demo",
                 fail_first: int = 0, hang_first: int = 0, hang_s: float = 0.0,
                 trickle_first: int = 0, trickle_s: float = 0.0,
                 answer_as: str | None = None, threads: int = 1):
        self.model = demo.load_lm(Path(target_folder))
        self.tok = byte_tokenizer()
        self.name, self.answer_as = name, answer_as
        self.fail_left, self.hang_left, self.hang_s = fail_first, hang_first, hang_s
        self.trickle_left, self.trickle_s = trickle_first, trickle_s
        self.threads = threads
        self.requests = 0
        self._gen_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._closing = False

    # -- generation -----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt: list[int], max_tokens: int, temperature: float) -> tuple[list, str]:
        prompt = prompt[-(demo.TINY_ARCH["max_position_embeddings"] - max_tokens):]
        with self._gen_lock, demo.torch_threads(self.threads):
            out = self.model(input_ids=torch.tensor([prompt or [EOS_ID]]), use_cache=True)
            new: list[int] = []
            for _ in range(max_tokens):
                if self._closing:
                    break
                logits = out.logits[0, -1]
                if temperature > 0:
                    tok = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1))
                else:
                    tok = int(logits.argmax())
                new.append(tok)
                if tok == EOS_ID:
                    return new, "stop"
                out = self.model(input_ids=torch.tensor([[tok]]),
                                 past_key_values=out.past_key_values, use_cache=True)
        return new, "length"

    def answer(self, path: str, body: dict) -> dict:
        chat = path.endswith("/chat/completions")
        if chat:
            text = self.tok.apply_chat_template(body["messages"], tokenize=False)
            prompt = self.tok(text, add_special_tokens=False)["input_ids"]
        else:
            p = body.get("prompt")
            prompt = (list(p) if isinstance(p, list)
                      else self.tok(p, add_special_tokens=False)["input_ids"])
        ids, finish = self.generate(prompt, int(body.get("max_tokens") or 16),
                                    float(body.get("temperature") or 0.0))
        text = decode([t for t in ids if t != EOS_ID])
        choice: dict = {"index": 0, "finish_reason": finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        out = {"id": f"cmpl-{uuid.uuid4().hex[:12]}",
               "object": "chat.completion" if chat else "text_completion",
               "created": int(time.time()), "model": self.answer_as or body.get("model"),
               "choices": [choice],
               "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                         "total_tokens": len(prompt) + len(ids)}}
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
            out["prompt_token_ids"] = prompt
        return out

    # -- HTTP -------------------------------------------------------------------------------------
    def _handler(self):
        srv = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as real servers

            def log_message(self, *a):  # no access log on the test output
                pass

            def _send(self, code: int, obj: dict, trickle: bool = False) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not trickle:
                    return self.wfile.write(data)
                for i in range(len(data)):  # each read waits little; the whole answer, long
                    self.wfile.write(data[i:i + 1])
                    self.wfile.flush()
                    time.sleep(srv.trickle_s)

            def do_GET(self):
                if self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": srv.name,
                                                                 "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                with srv._count_lock:
                    srv.requests += 1
                    fail = srv.fail_left > 0
                    srv.fail_left -= fail
                    hang = not fail and srv.hang_left > 0
                    srv.hang_left -= hang
                    trickle = not (fail or hang) and srv.trickle_left > 0
                    srv.trickle_left -= trickle
                if fail:
                    return self._send(500, {"error": {"message": "injected failure"}})
                if hang:
                    time.sleep(srv.hang_s)
                if body.get("model") != srv.name:
                    return self._send(404, {"error": {"message":
                                                      f"model {body.get('model')!r} not served"}})
                try:
                    self._send(200, srv.answer(self.path, body), trickle)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (its timeout): nothing to answer

        return Handler

    def __enter__(self) -> "DemoServer":
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True,
                         name="demo-server").start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __exit__(self, *exc) -> None:
        self._closing = True  # a generation still running (for a client gone) ends now
        self._httpd.shutdown()
        self._httpd.server_close()
        with self._gen_lock:  # ... and torch is left idle before the interpreter exits
            pass
