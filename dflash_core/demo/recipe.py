"""The demo's recipe: the tiny target's shape and training, and the demo data set's size. The
build cache's keys name DEMO_VERSION, so a change here must bump it (everything then rebuilds)."""

from __future__ import annotations

# Bump when anything below changes: the cache key changes and everything rebuilds.
# tiny-v2: the target's folder names its architecture and holds the byte tokenizer (servable).
DEMO_VERSION = "tiny-v2"

# The target: 4 layers trained for 600 steps beat 6 layers at the same wall-clock time on 2 cores
# (measured: train loss ~1.3 vs ~1.6, readable words vs "the the the").
TINY_ARCH = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6,
    tie_word_embeddings=True,  # 258 x 128: the byte embedding doubles as the output layer
)
TRAIN_STEPS = 600
TRAIN_BATCH = 16  # windows per step
TRAIN_SEQ = 128  # bytes per window (the demo's prompt + response fit in it)
TRAIN_LR = 5e-3
TRAIN_WARMUP = 30
# One intra-op thread, fixed: CPU results depend on the thread count (a fixed count keeps the build
# reproducible), and for matrices this small a second OpenMP thread gains little on an idle machine
# but makes every op 3-10x slower on a busy one (its threads spin at barriers; measured here).
BUILD_THREADS = 1
HELDOUT_FRACTION = 0.08

# The demo data set.
DATA_SAMPLES = 1024
DATA_PROMPT_LEN = 64
DATA_RESPONSE_LEN = 64
GEN_BATCH = 64

META_NAME = "dflash_demo.json"
PROBE_TEXT = "The value of "
