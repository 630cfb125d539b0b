"""A real fast tokenizer trained here (byte-level BPE) and a Qwen-style chat template written here,
for the tests of rendering and prepare."""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# Qwen-style: <|im_start|>role\n...<|im_end|>\n; reasoning shown only for assistant turns after
# the last user turn (as Qwen3 does), so history renders differently from the turn being written.
QWEN_STYLE = r"""
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{{- '<|im_start|>assistant\n' -}}
{%- if m.reasoning_content is defined and m.reasoning_content and loop.index0 > ns.last_user -%}
{{- '<think>\n' + m.reasoning_content + '\n</think>\n\n' -}}
{%- endif -%}
{{- m.content + '<|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A drafter proposes a block of tokens and the target checks them in one pass.",
    "Hello! How can I help you today? Tell me about the weather in Paris.",
    "Speculative decoding keeps the output of the target exactly, only faster.",
    "What is two plus two? Two plus two is four. Let me think about it step by step.",
] * 20

# Indented code: GPT-2's pre-tokenizer keeps a newline with the spaces after it, so the BPE learns
# tokens such as "\n   " that merge a template's newline with an answer's indentation.
CODE_CORPUS = [
    "def f(x):\n    return x + 1\n",
    "class A:\n    def run(self):\n        if self.ok:\n            return 1\n",
    "    if self.ok:\n        pass\n",
] * 30


def train_bpe(folder: Path, template: str | None = QWEN_STYLE, corpus=CORPUS) -> Path:
    """Train a small byte-level BPE and save it as an HF tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tk.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    if template is not None:
        tok.chat_template = template
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(folder))
    return folder
