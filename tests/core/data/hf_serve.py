"""A tiny Qwen3 chat model made here (a GPT-2-style byte-level BPE with a ChatML template, weights
trained for a few seconds to answer with indented code) and `transformers serve` running it on
127.0.0.1: a real third-party OpenAI-compatible server, for the end-to-end test of the data
verbs."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from tests.core.data.chat_fixtures import CODE_CORPUS, train_bpe

CHATML = ("{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + "
          "'<|im_end|>\\n' -}}{%- endfor -%}"
          "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
# What the model learns to write: leading spaces (which a server may strip) and a newline
# followed by indentation (which the BPE merges across)
ANSWER = "    if self.ok:\n        return 1"


def make_chat_model(folder: Path, steps: int = 60) -> Path:
    """Tokenizer and trained tiny Qwen3 saved in ``folder`` (safetensors)."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    train_bpe(folder, CHATML, CODE_CORPUS)
    tok = AutoTokenizer.from_pretrained(str(folder))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=256, eos_token_id=end,
                      pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    # the prompt and the answer tokenized apart, the answer trained: what the model meets
    # when a server tokenizes the prompt and the model writes after it
    answer = tok(ANSWER + "<|im_end|>\n", add_special_tokens=False)["input_ids"]
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": f"task {k}"}],
                                           tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"] for k in range(8)]
    width = max(map(len, prompts)) + len(answer)
    pad = width - len(answer)
    x = torch.tensor([[tok.pad_token_id] * (pad - len(p)) + p + answer for p in prompts])
    labels = torch.tensor([[-100] * pad + answer for p in prompts])
    mask = torch.tensor([[0] * (pad - len(p)) + [1] * (len(p) + len(answer))
                         for p in prompts])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=x, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.generation_config.eos_token_id = end
    model.save_pretrained(str(folder))
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def transformers_serve(model: Path, log: Path, port: int = 0, start_s: float = 120.0):
    """``transformers serve`` of ``model`` on 127.0.0.1 (CPU; ``port``, or a free one), its URL
    while held; stopped after (its output in ``log``)."""
    port = port or free_port()
    cmd = [sys.executable, "-c", "import sys; from transformers.cli.transformers import main; "
           "sys.argv[0] = 'transformers'; sys.exit(main())", "serve", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                    if json.loads(r.read()).get("data"):
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() - t0 > start_s:
                raise RuntimeError(f"transformers serve did not start: {log.read_text()[-2000:]}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
