"""The embedded demo: its target is a real (if tiny) language model, its data is that model's own
greedy output, and a 2-layer drafter learns it quickly enough for a CPU demo."""

import json
import math
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_core import demo
from dflash_core.demo import target_cache
from dflash_core.config import ConfigError, config_from_dict
from dflash_core.data import BatchStream, ShardedDataset, split_eval
from dflash_core.data.byte_vocab import decode, encode
from dflash_core.models.dflash.drafter import DFlashDrafter, build_drafter_config
from dflash_core.eval.evaluate import evaluate_tau, hf_target_fn, plain_greedy, target_fn_for
from dflash_core.models.target.load import load_target
from dflash_core.planning.target_checks import resolve_target
from dflash_core.models.training.trainer import make_replicas, reduce_and_step


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # These matrices are tiny: a second OpenMP thread gains little, and on a busy machine it makes
    # every op several times slower (threads spin at barriers).
    with demo.torch_threads(1):
        yield


def _printable_share(text: str) -> float:
    ok = sum(1 for c in text if c.isascii() and (c.isprintable() or c in "\n\t"))
    return ok / max(1, len(text))


# --------------------------------------------------------------------------------------------
# The target
# --------------------------------------------------------------------------------------------

def test_target_is_an_ordinary_hf_folder(demo_target):
    """Reloads with plain transformers and gives the logits the trained model gave."""
    meta = demo.read_meta(demo_target)
    assert (demo_target / "config.json").is_file() and (demo_target / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(demo_target, dtype=torch.float32).eval()
    assert model.config.vocab_size == demo.VOCAB_SIZE == meta["vocab_size"]
    assert meta["mask_token_id"] == demo.MASK_ID == demo.VOCAB_SIZE - 1
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([demo.encode(meta["probe_text"])])).logits
    assert torch.allclose(logits[0, -1, :16], torch.tensor(meta["probe_logits"]), atol=1e-4)
    # The engine's loader takes it too (tied embeddings count as present, not missing).
    target = load_target(demo_target, dtype="float32")
    assert target.num_layers == demo.TINY_ARCH["num_hidden_layers"]
    # below the last layer, which serving reads before the final norm and training after it
    assert max(demo.DEMO_LAYER_IDS) < target.num_layers - 1


def test_target_is_a_folder_a_server_loads_as_it_is(demo_target):
    """config.json names the causal LM (else vLLM starts Qwen3Model, a pooling runner), and the
    byte tokenizer is saved beside the weights: AutoTokenizer loads it offline with its end and
    mask tokens and the demo's chat template, giving the built-in tokenizer's ids."""
    from transformers import AutoTokenizer

    from dflash_core.data.byte_vocab import byte_tokenizer
    from dflash_core.data.chat_render import fingerprints
    from dflash_core.models.target.servable import serving_gaps

    assert json.loads((demo_target / "config.json").read_text())["architectures"] == [
        "Qwen3ForCausalLM"]
    assert serving_gaps(demo_target) == []
    tok = AutoTokenizer.from_pretrained(str(demo_target), local_files_only=True)
    assert (tok.eos_token_id, tok.pad_token_id, tok.mask_token_id) == (demo.EOS_ID, demo.EOS_ID,
                                                                       demo.MASK_ID)
    assert len(tok) == demo.VOCAB_SIZE
    builtin = byte_tokenizer()
    chat = [{"role": "user", "content": "The value of é"}, {"role": "assistant", "content": "x"}]
    for render in (lambda t: t.apply_chat_template(chat, tokenize=False),
                   lambda t: t.apply_chat_template(chat[:1], add_generation_prompt=True,
                                                   tokenize=False)):
        text = render(tok)
        assert text == render(builtin)
        assert tok(text, add_special_tokens=False)["input_ids"] == builtin(
            text, add_special_tokens=False)["input_ids"]
    assert tok.decode([72, 105, demo.EOS_ID]) == "Hi<|endoftext|>"
    # the data's and eval's fingerprints: data made with builtin:tiny matches the folder's
    assert fingerprints(tok) == fingerprints(builtin)


def test_a_folder_without_architectures_or_tokenizer_is_said_not_servable(tmp_path):
    from dflash_core.models.target.servable import add_architecture, serving_gaps

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    gaps = serving_gaps(tmp_path)
    assert len(gaps) == 2 and "architectures" in gaps[0] and "tokenizer" in gaps[1]
    assert add_architecture(tmp_path, "Qwen3ForCausalLM")
    assert not add_architecture(tmp_path, "Other")  # one already named is kept
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [
        "Qwen3ForCausalLM"]
    assert serving_gaps(tmp_path) == [gaps[1]]


def test_target_writes_text_not_noise(demo_target):
    meta = demo.read_meta(demo_target)
    # ln(258) = 5.55 for a uniform guess; the demo target sits far below it, on unseen text too.
    assert meta["final_train_loss"] < 2.0 < math.log(demo.VOCAB_SIZE)
    assert meta["heldout_loss"] < 2.2
    model = AutoModelForCausalLM.from_pretrained(demo_target, dtype=torch.float32).eval()
    fn = hf_target_fn(model, [0])
    with torch.no_grad():
        out = decode(plain_greedy(fn, demo.encode("The value of the "), 80))
    assert _printable_share(out) > 0.95, out
    assert sum(c.isalpha() for c in out) > 40, out  # words, not punctuation runs
    assert " " in out


def test_build_is_deterministic_for_a_seed(tmp_path):
    """Two builds with the same seed give the same bytes; another seed gives other weights."""
    a = demo.build_tiny_target(tmp_path / "a", seed=3, steps=2)
    b = demo.build_tiny_target(tmp_path / "b", seed=3, steps=2)
    c = demo.build_tiny_target(tmp_path / "c", seed=4, steps=2)
    weights = lambda p: (p / "model.safetensors").read_bytes()  # noqa: E731
    assert weights(a) == weights(b)
    assert weights(a) != weights(c)
    assert (a / "config.json").read_text() == (b / "config.json").read_text()
    ma, mb = demo.read_meta(a), demo.read_meta(b)
    for m in (ma, mb):
        m.pop("build_seconds")
    assert ma == mb and ma["seed"] == 3 and ma["steps"] == 2


def test_a_build_on_a_rank_other_than_0_writes_the_weights(tmp_path, monkeypatch):
    """Several nodes: whichever node holds the build lock builds the target. transformers'
    save_pretrained writes nothing on a rank other than 0 once torch.distributed is set up, and
    the other nodes then found a folder without config.json (a failure by chance)."""
    import transformers.distributed.mixin as mixin
    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)
    folder = demo.build_tiny_target(tmp_path / "t", seed=3, steps=2)
    model = AutoModelForCausalLM.from_pretrained(folder)
    probe = demo.read_meta(folder)["probe_logits"]
    with torch.no_grad():
        got = model(input_ids=torch.tensor([encode(demo.read_meta(folder)["probe_text"])]))
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.allclose(got.logits[0, -1, :16], torch.tensor(probe), atol=1e-5)


def test_progress_is_reported_in_order(tmp_path):
    seen = []
    demo.build_tiny_target(tmp_path / "t", progress=lambda f, msg: seen.append((f, msg)), steps=10)
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions) and fractions[0] == 0.0 and fractions[-1] == 1.0
    assert all(isinstance(m, str) and m for _, m in seen)
    assert len(seen) >= 3


# --------------------------------------------------------------------------------------------
# The cached target
# --------------------------------------------------------------------------------------------

def test_cached_target_is_reused_and_keyed_by_version(demo_target, dflash_cache, monkeypatch):
    t = time.monotonic()
    assert demo.ensure_tiny_target(dflash_cache) == demo_target
    assert time.monotonic() - t < 2.0  # no rebuild
    assert demo.DEMO_VERSION in demo_target.name
    monkeypatch.setattr(demo.recipe, "DEMO_VERSION", "tiny-v0-test")
    assert demo.tiny_target_key() != demo_target.name


def test_install_target_copies_into_the_run_folder(demo_target, dflash_cache, tmp_path):
    run_dir = tmp_path / "runs" / "demo"
    dst = demo.install_target(run_dir, dflash_cache)
    assert dst == run_dir / "target"
    weights = lambda p: (p / "model.safetensors").read_bytes()  # noqa: E731
    assert weights(dst) == weights(demo_target)
    assert demo.read_meta(dst) == demo.read_meta(demo_target)
    assert demo.install_target(run_dir, dflash_cache) == dst  # idempotent
    assert sorted(p.name for p in run_dir.iterdir()) == ["target"]


# --------------------------------------------------------------------------------------------
# The data
# --------------------------------------------------------------------------------------------

def test_demo_data_is_the_targets_greedy_output(demo_target, demo_data):
    ds = ShardedDataset.open(demo_data)
    assert len(ds) == demo.DATA_SAMPLES and ds.has_loss_mask
    P, R = demo.DATA_PROMPT_LEN, demo.DATA_RESPONSE_LEN
    assert set(ds.lengths.tolist()) == {P + R}
    _, heldout = demo.split_corpus()
    held = heldout.tobytes()  # int64 windows: a prompt is a contiguous run of 8-byte items
    for i in (0, 1, len(ds) - 1):
        ids, mask = ds.get(i)
        assert mask.tolist() == [0] * P + [1] * R  # the loss covers the response only
        assert ids[:P].astype(np.int64).tobytes() in held  # prompts come from held-out text
    model = AutoModelForCausalLM.from_pretrained(demo_target, dtype=torch.float32).eval()
    fn = hf_target_fn(model, [0])
    ids, _ = ds.get(0)
    ref = plain_greedy(fn, ids[:P].tolist(), R)
    agree = np.mean(np.array(ref) == ids[P:])
    assert agree > 0.9  # equal up to rare near-ties (cached vs full forward)
    text = decode(ids[P:])
    assert _printable_share(text) > 0.9, text


def test_demo_data_generation_is_fast_and_cached(demo_target, tmp_path):
    t = time.monotonic()
    out = demo.ensure_demo_data(demo_target, tmp_path, n_samples=64, seed=5)
    seconds = time.monotonic() - t
    assert seconds < 30
    assert len(ShardedDataset.open(out)) == 64
    assert demo.ensure_demo_data(demo_target, tmp_path, n_samples=64, seed=5) == out
    assert demo.ensure_demo_data(demo_target, tmp_path, n_samples=64, seed=6) != out


def test_demo_config(demo_target, tmp_path):
    cfg = demo.demo_config(output_dir=str(tmp_path / "runs"), name="d")
    assert config_from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()  # valid, strict
    assert cfg.target.path == "builtin:tiny" and cfg.data.path == "builtin:demo"
    assert cfg.layout.device == "cpu" and cfg.target.dtype == "float32"
    assert cfg.drafter.mask_token_id == demo.read_meta(demo_target)["mask_token_id"]
    assert cfg.data.max_length >= demo.DATA_PROMPT_LEN + demo.DATA_RESPONSE_LEN


def test_the_demo_preflight_says_nothing_about_the_last_layer(demo_target, tmp_path):
    """The demo's features stay below its target's last layer, so its preflight (what a demo run
    prints before loading) has no warning to give; the same target with the last layer among the
    features gets the one line."""
    cfg = demo.demo_config(output_dir=str(tmp_path / "runs"), name="d")
    said = []
    _, _, layer_ids, _ = resolve_target(cfg, cfg.run_dir, lambda what: None, say=said.append)
    assert layer_ids == demo.DEMO_LAYER_IDS and said == []
    cfg.target.layer_ids = [1, 2, 3]
    resolve_target(cfg, cfg.run_dir, lambda what: None, say=said.append)
    (line,) = said
    assert "includes layer 3, the target's last" in line


# --------------------------------------------------------------------------------------------
# The point of it all: a drafter learns this target fast
# --------------------------------------------------------------------------------------------

TRAIN_STEPS = 200
EVAL_PROMPTS = 16


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_drafter_learns_the_demo_target(demo_target, demo_data):
    """A 2-layer drafter trained with the demo config's recipe: the loss falls and exact tau on
    held-out prompts climbs from ~1 to well above 2."""
    cfg = demo.demo_config()
    target = load_target(demo_target, dtype="float32")
    layers = cfg.target.layer_ids
    ds = ShardedDataset.open(demo_data)
    _, held = split_eval(len(ds), EVAL_PROMPTS, cfg.run.seed)
    stream = BatchStream.from_config(ds, cfg.data, seed=cfg.run.seed, epochs=cfg.optim.epochs,
                                     exclude=held)
    d = cfg.drafter
    dcfg = build_drafter_config(target.model.config, num_layers=d.num_layers,
                                target_layer_ids=layers, block_size=d.block_size,
                                mask_token_id=d.mask_token_id)
    torch.manual_seed(cfg.run.seed)
    (rep,) = make_replicas(DFlashDrafter(dcfg), [torch.device("cpu")], cfg.drafter, cfg.optim,
                           target.embed_tokens, target.lm_head)
    prompts = [ds.get(int(i))[0][: cfg.eval.prompt_tokens].tolist() for i in held]
    fn = target_fn_for(target, layers)

    def tau():
        rep.drafter.eval()
        try:
            return evaluate_tau(fn, rep.drafter, prompts, cfg.eval.max_new_tokens, layers)
        finally:
            rep.drafter.train()

    before = tau()
    losses = []
    t0 = time.monotonic()
    batches = stream.iter_batches()
    for step in range(TRAIN_STEPS):
        batch = next(batches)
        rep.accumulate(batch, target.features(batch.input_ids, batch.attention_mask, layers),
                       cfg.run.seed)
        losses.append(reduce_and_step([rep], step, TRAIN_STEPS).loss)
    train_s = time.monotonic() - t0
    after = tau()
    print(f"\ndemo drafter: loss first-10 {np.mean(losses[:10]):.3f} -> last-50 "
          f"{np.mean(losses[-50:]):.3f}; tau {before.tau:.2f} -> {after.tau:.2f} "
          f"(hist {after.acceptance}); {TRAIN_STEPS} steps in {train_s:.0f} s")
    assert before.tau < 1.2  # an untrained drafter guesses nothing
    assert all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-50:]) < 0.7 * np.mean(losses[:10])
    assert np.mean(losses[-50:]) < 1.5
    assert after.tau >= 2.0
    assert after.tokens == before.tokens == EVAL_PROMPTS * cfg.eval.max_new_tokens


@pytest.mark.parametrize("device, gpus, want", [
    ("auto", 0, ("cpu", [0], [0])),
    ("auto", 1, ("cuda", [0], [0])),  # one GPU: both roles on it
    ("auto", 2, ("cuda", [0], [1])),  # two: target and drafter each on their own
    ("auto", 8, ("cuda", [0], [1])),
    ("cpu", 2, ("cpu", [0], [0])),  # --demo --device cpu keeps the CPU on a GPU node
])
def test_demo_uses_the_gpus_when_there_are_any(device, gpus, want):
    lay = demo.demo_config(device=device, gpus=gpus).layout
    assert (lay.device, lay.targets, lay.drafters) == want


def test_demo_on_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ConfigError) as info:
        demo.demo_config(device="cuda", gpus=0)
    assert "--device cpu" in info.value.hint


def test_nodes_installing_the_target_at_once_all_get_one_complete_copy(tmp_path, monkeypatch):
    """Two nodes on one shared run folder copy at the same moment (both copies made before
    either renames): the loser of the rename keeps the winner's copy, with nothing left over.
    An out-of-date copy is replaced the same way."""
    import shutil
    import threading

    src = tmp_path / "cache" / "target"
    src.mkdir(parents=True)
    (src / "model.safetensors").write_bytes(b"w" * 1000)
    (src / demo.META_NAME).write_text('{"version": "new"}')
    monkeypatch.setattr(target_cache, "ensure_tiny_target", lambda cache_dir, progress: src)
    both_copied = threading.Barrier(2, timeout=10)
    real_copytree = shutil.copytree

    def copytree(a, b):
        real_copytree(a, b)
        both_copied.wait()
    monkeypatch.setattr(target_cache.shutil, "copytree", copytree)
    run_dir = tmp_path / "runs" / "mn"
    for old in (None, '{"version": "old"}'):
        if old:  # an earlier demo version's copy is in place
            (run_dir / "target" / demo.META_NAME).write_text(old)
        got, errors = [], []

        def node():
            try:
                got.append(demo.install_target(run_dir))
            except Exception as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)
        threads = [threading.Thread(target=node) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert not errors and got == [run_dir / "target"] * 2, errors
        assert demo.read_meta(run_dir / "target") == {"version": "new"}
        assert (run_dir / "target" / "model.safetensors").read_bytes() == b"w" * 1000
        assert sorted(p.name for p in run_dir.iterdir()) == ["target"]  # no .tmp- or .old-


def test_a_copy_renamed_aside_while_it_is_read_counts_as_not_current(tmp_path, monkeypatch):
    """Another node renames the out-of-date copy aside between this node's two reads of it: the
    read finds no file, which means "not current" (it failed the install, by chance, in CI)."""
    src = tmp_path / "cache" / "target"
    src.mkdir(parents=True)
    (src / "model.safetensors").write_bytes(b"w" * 10)
    (src / demo.META_NAME).write_text('{"version": "new"}')
    monkeypatch.setattr(target_cache, "ensure_tiny_target", lambda cache_dir, progress: src)
    run_dir = tmp_path / "runs" / "mn"
    (run_dir / "target").mkdir(parents=True)
    (run_dir / "target" / demo.META_NAME).write_text('{"version": "old"}')
    real_read, vanished = target_cache.read_meta, []

    def read_meta(folder):
        if folder == run_dir / "target" and not vanished:
            vanished.append(1)
            raise FileNotFoundError(2, "No such file or directory")  # renamed aside just now
        return real_read(folder)
    monkeypatch.setattr(target_cache, "read_meta", read_meta)
    assert demo.install_target(run_dir) == run_dir / "target" and vanished
    assert real_read(run_dir / "target") == {"version": "new"}
