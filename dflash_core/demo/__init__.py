"""The embedded demo: a tiny target LM trained on the spot, and training data it generates.

``builtin:tiny`` is a byte-level Qwen3 trained for about two minutes on one CPU core on the text of
Python's own help topics (``pydoc_data.topics``, shipped with every Python). A target with random
weights would not do: its greedy output is noise that no drafter can learn (tau stays ~1.1). This
one writes repetitive English-like text ("the sequence types and the contained to the ..."), which
a 2-layer drafter learns in a few hundred steps.

Its vocabulary is the built-in byte vocabulary (``dflash_core.data.byte_vocab``): the bytes of
UTF-8 text, ``<|endoftext|>`` (``EOS_ID``, separates help topics in the training text) and
``<|MASK|>`` (``MASK_ID``, the drafter's mask token).

``builtin:demo`` is data made by that target: prompts are random slices of a held-out part of the
text (the last ``HELDOUT_FRACTION`` of it, never seen in the target's training), responses are the
target's own greedy continuation (DFlash trains on target-generated responses), with a loss mask on
the response only.

Both are built once into the build cache (build_cache.py) under a key that names the recipe
version, the corpus and the parameters, so a changed recipe builds anew; ``dflash_demo.json`` is
written last and marks a finished build.

The package, one job a module: recipe.py (the constants, DEMO_VERSION), corpus.py (the text),
tiny_target.py (training the target), target_cache.py (the cached target, its copy in a run
folder), demo_data.py (the data set), run_config.py (the demo's config), torch_env.py (thread
count, quiet progress bars); chat.py and server.py are the data verbs' demo conversations and
server. What callers use is re-exported here (``demo.install_target(...)``).
"""

from __future__ import annotations

from dflash_core.data.byte_vocab import EOS_ID, MASK_ID, VOCAB_SIZE, encode
from dflash_core.demo import recipe
from dflash_core.demo.corpus import corpus_digest, corpus_ids, split_corpus
from dflash_core.demo.demo_data import (
    demo_prompts, ensure_demo_data, greedy_continue, load_lm, make_demo_data,
)
from dflash_core.demo.recipe import (
    BUILD_THREADS, DATA_PROMPT_LEN, DATA_RESPONSE_LEN, DATA_SAMPLES, DEMO_VERSION, GEN_BATCH,
    HELDOUT_FRACTION, META_NAME, PROBE_TEXT, TINY_ARCH, TRAIN_BATCH, TRAIN_LR, TRAIN_SEQ,
    TRAIN_STEPS, TRAIN_WARMUP,
)
from dflash_core.demo.run_config import DEMO_LAYER_IDS, demo_config, demo_layout
from dflash_core.demo.target_cache import ensure_tiny_target, install_target, tiny_target_key
from dflash_core.demo.tiny_target import build_tiny_target, read_meta
from dflash_core.demo.torch_env import quiet_hf, torch_threads

__all__ = [
    "BUILD_THREADS", "DATA_PROMPT_LEN", "DATA_RESPONSE_LEN", "DATA_SAMPLES", "DEMO_LAYER_IDS",
    "DEMO_VERSION", "EOS_ID", "GEN_BATCH", "HELDOUT_FRACTION", "MASK_ID", "META_NAME",
    "PROBE_TEXT", "TINY_ARCH", "TRAIN_BATCH", "TRAIN_LR", "TRAIN_SEQ", "TRAIN_STEPS",
    "TRAIN_WARMUP", "VOCAB_SIZE", "build_tiny_target", "corpus_digest", "corpus_ids",
    "demo_config", "demo_layout", "demo_prompts", "encode", "ensure_demo_data",
    "ensure_tiny_target", "greedy_continue", "install_target", "load_lm", "make_demo_data",
    "quiet_hf", "read_meta", "recipe", "split_corpus", "tiny_target_key", "torch_threads",
]
