"""bench/eval/dflash2_conv_precision.py on the CPU: a DFlash2 folder of the demo target evaluated
three ways, its convolutions computed in bf16 (the served rounding), in float32 inside a bf16
drafter, and in a float32 drafter, as each way says; one table row per set with the three taus."""

import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "eval"))

import dflash2_conv_precision as bench  # noqa: E402
from dflash_core.data.byte_vocab import MASK_ID  # noqa: E402
from dflash_core.families.dflash2 import DFlash2Settings  # noqa: E402
from dflash_core.models.dflash2 import conv  # noqa: E402
from dflash_core.models.dflash2.drafter import DFlash2Drafter  # noqa: E402


def test_three_ways_each_computes_its_convolution_in_its_dtype(tmp_path, demo_target,
                                                               monkeypatch, capsys):
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(demo_target)
    cfg = DFlash2Drafter.new_config(tc, num_layers=1, target_layer_ids=[1, 2, 3], block_size=4,
                                    mask_token_id=MASK_ID,
                                    settings=DFlash2Settings(block_size=4, selector_rank=8,
                                                             selector_top_k=4))
    torch.manual_seed(0)
    m = DFlash2Drafter(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "_conv." in name:
                p.add_(torch.randn_like(p) * 0.05)  # the convolutions away from identity
    m.save(tmp_path / "d2")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n"
                               for t in ("usage: run the demo", "a drafter proposes tokens")))
    seen = []
    real = conv.conv_values

    def spy(x, *a, **k):
        seen.append(x.dtype)
        return real(x, *a, **k)

    monkeypatch.setattr(conv, "conv_values", spy)
    ways = []
    real_eval = bench.evaluate

    def each(args, folder, dt, cdt):
        seen.clear()
        out = real_eval(args, folder, dt, cdt)
        ways.append((folder, set(seen)))
        return out

    monkeypatch.setattr(bench, "evaluate", each)
    bench.main(["--target", str(demo_target), "--drafter", str(tmp_path / "d2"),
                "--prompts", f"p={prompts}", "--max-new-tokens", "8", "--device", "cpu",
                "--out", str(tmp_path / "out")])
    assert ways == [("bf16", {torch.bfloat16}), ("bf16-conv-fp32", {torch.float32}),
                    ("fp32", {torch.float32})]
    row = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| p |"))
    taus = [float(t) for t in re.findall(r"\| (\d\.\d{3}) ", row)]
    assert len(taus) == 3 and all(t >= 1.0 for t in taus), row
    for folder, _ in ways:
        assert (tmp_path / "out" / folder / "results.json").exists()
