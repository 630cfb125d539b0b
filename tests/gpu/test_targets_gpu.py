"""Hybrid (Gated DeltaNet) targets in several threads of one process on a GPU: their
flash-linear-attention kernels are tuned by Triton's autotuner at first use."""

import threading

import pytest
import torch

from dflash_core.models.compile_guard import serialize_triton_autotuning


def _hybrid(seed: int):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    # Head sizes no other test uses, so the kernels' autotuning is cold in this process.
    cfg = Qwen3_5TextConfig(vocab_size=512, hidden_size=96, intermediate_size=192,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=32, linear_key_head_dim=32, linear_value_head_dim=64,
                            linear_num_key_heads=2, linear_num_value_heads=4,
                            tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Qwen3_5ForCausalLM(cfg).cuda().eval()


def test_two_threads_run_hybrid_targets_at_once_on_first_use():
    """Two target threads' first forwards at the same moment (the shipped layout has two
    targets; the evaluation also runs target 0 beside its thread): with the engine's autotuning
    guard both finish and give what each model gives alone."""
    pytest.importorskip("triton")
    assert serialize_triton_autotuning()
    models = [_hybrid(s) for s in (0, 1)]
    ids = torch.randint(0, 500, (2, 300), device="cuda")
    meet, out, errors = threading.Barrier(2), {}, []

    def forward(k):
        torch.cuda.set_device(0)
        meet.wait()
        try:
            with torch.inference_mode():
                out[k] = models[k](input_ids=ids).logits.float()
        except Exception as exc:  # noqa: BLE001 - collected for the assert
            errors.append(exc)
    threads = [threading.Thread(target=forward, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    for k in (0, 1):
        with torch.inference_mode():
            alone = models[k](input_ids=ids).logits.float()
        assert torch.allclose(out[k], alone, atol=1e-3, rtol=1e-3)
