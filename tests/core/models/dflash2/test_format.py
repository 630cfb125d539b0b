"""The saved DFlash2 folder as vLLM reads it: config.json's keys, the tensor names and shapes of
the specification's list (codebooks without ``.weight``, no embedding nor lm_head), read back by
a loader written here from the specification alone (not the engine's classes), which must give
the drafter's logits and its drafts."""

import json
import math

import pytest
import torch
from safetensors import safe_open

from dflash_core.models.dflash2.drafter import DFlash2Drafter
from dflash_core.models.registry import ObjectiveMismatch, load_drafter, objective_of

from .tiny import B, H, K, LAYER_IDS, R, SETTINGS, V, dflash2, head

L = 2  # drafter layers
T, G = SETTINGS.conv_kernel_size, SETTINGS.conv_group_size
M = H // G
HEADS, KV, HD, INTER = 4, 2, 16, 128


def spec_shapes() -> dict[str, tuple]:
    """The specification's tensor list for these sizes (DFLASH2.md section 1.2)."""
    out = {"fc.weight": (H, len(LAYER_IDS) * H), "hidden_norm.weight": (H,), "norm.weight": (H,),
           "candidate_selector.hidden_projection.weight": (R, H),
           "candidate_selector.predecessor_codebook": (V, R),
           "candidate_selector.successor_codebook": (V, R)}
    for i in range(L):
        p = f"layers.{i}."
        out |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                p + "self_attn.q_proj.weight": (HEADS * HD, H),
                p + "self_attn.k_proj.weight": (KV * HD, H),
                p + "self_attn.v_proj.weight": (KV * HD, H),
                p + "self_attn.o_proj.weight": (H, HEADS * HD),
                p + "self_attn.q_norm.weight": (HD,), p + "self_attn.k_norm.weight": (HD,),
                p + "mlp.gate_proj.weight": (INTER, H), p + "mlp.up_proj.weight": (INTER, H),
                p + "mlp.down_proj.weight": (H, INTER)}
        for conv in ("attention_conv", "mlp_conv"):
            out |= {p + f"{conv}.base_kernel": (2, T, H),
                    p + f"{conv}.kernel_projection.weight": (2 * T * M, H)}
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dflash2")
    m = dflash2(seed=5, std=0.25)
    m.attach_target_head(*head())
    m.save(folder)
    return m, folder


def test_config_json_is_what_vllm_reads(saved):
    m, folder = saved
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["is_causal"] is False and cfg["tie_word_embeddings"] is False
    assert cfg["vocab_size"] == V and cfg["num_hidden_layers"] == L
    # the serving keys stated as this engine computes them (models/served_keys.py)
    assert cfg["is_neox_style"] is True
    assert cfg["dflash_config"] == {
        "target_layer_ids": LAYER_IDS, "block_size": B, "mask_token_id": V - 1,
        "conv_kernel_size": T, "conv_group_size": G, "selector_rank": R, "selector_top_k": K,
        "causal": False, "use_swa": False, "attention_sink_bias": False}
    assert objective_of(cfg) == "dflash2"


def test_tensor_names_and_shapes_are_the_specifications(saved):
    _, folder = saved
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert found == spec_shapes()


def test_round_trip_and_other_families_refused(saved):
    m, folder = saved
    back = DFlash2Drafter.load(folder)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in m.state_dict().items())
    with pytest.raises(ObjectiveMismatch, match="holds a DFlash2 drafter"):
        load_drafter(folder, "dspark")


# -- an independent reader, written from the specification ----------------------------------

def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + half * sin


def conv_by_spec(x, y, beta, W, side, taps, group):
    """Conv_s(x)[p,c] = sum_t [p>=t] (beta[s,t,c] + Delta[p,s,t,c//G]) x[p-t,c], Delta = y W^T
    read at row s*T*M + t*M + m; one block of positions 0..P."""
    P, Hd = x.shape
    m = Hd // group
    delta = y @ W.T
    out = torch.zeros_like(x)
    for p in range(P):
        for t in range(taps):
            if p >= t:
                d = delta[p, side * taps * m + t * m: side * taps * m + (t + 1) * m]
                out[p] += (beta[side, t] + d.repeat_interleave(group)) * x[p - t]
    return out


def reader(folder, features, anchor_token, anchor_pos, embed, lm_head):
    """Hidden states, unary logits and the greedy walk of one block [anchor, MASK x (B-1)] at
    positions anchor_pos.. with context features [S, k*H] of positions 0..S-1."""
    cfg = json.loads((folder / "config.json").read_text())
    dc = cfg["dflash_config"]
    w = {}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for k in f.keys():
            w[k] = f.get_tensor(k).float()
    eps, hd = cfg["rms_norm_eps"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg["rope_theta"]
    Bk, taps, group = dc["block_size"], dc["conv_kernel_size"], dc["conv_group_size"]
    ids = torch.tensor([anchor_token] + [dc["mask_token_id"]] * (Bk - 1))
    x = embed[ids]
    S = features.shape[0]
    ctx = rms(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    qpos, kpos = torch.arange(anchor_pos, anchor_pos + Bk), torch.arange(S)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        ab, aW = w[p + "attention_conv.base_kernel"], w[p + "attention_conv.kernel_projection.weight"]
        y = rms(x, w[p + "input_layernorm.weight"], eps)
        a = conv_by_spec(y, y, ab, aW, 0, taps, group)

        def heads(t, n):
            return t.view(t.shape[0], n, hd).transpose(0, 1)
        q = rotate(rms(heads(a @ w[p + "self_attn.q_proj.weight"].T, nh),
                       w[p + "self_attn.q_norm.weight"], eps), qpos, theta)
        k_blk = rotate(rms(heads(a @ w[p + "self_attn.k_proj.weight"].T, nkv),
                           w[p + "self_attn.k_norm.weight"], eps), qpos, theta)
        k_ctx = rotate(rms(heads(ctx @ w[p + "self_attn.k_proj.weight"].T, nkv),
                           w[p + "self_attn.k_norm.weight"], eps), kpos, theta)
        v_blk = heads(a @ w[p + "self_attn.v_proj.weight"].T, nkv)
        v_ctx = heads(ctx @ w[p + "self_attn.v_proj.weight"].T, nkv)
        k = torch.cat([k_ctx, k_blk], 1).repeat_interleave(nh // nkv, 0)
        v = torch.cat([v_ctx, v_blk], 1).repeat_interleave(nh // nkv, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd), -1)  # non-causal block
        o = (att @ v).transpose(0, 1).reshape(Bk, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        x = x + conv_by_spec(o, y, ab, aW, 1, taps, group)
        mb, mW = w[p + "mlp_conv.base_kernel"], w[p + "mlp_conv.kernel_projection.weight"]
        z = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        b = conv_by_spec(z, z, mb, mW, 0, taps, group)
        mlp = (torch.nn.functional.silu(b @ w[p + "mlp.gate_proj.weight"].T)
               * (b @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        x = x + conv_by_spec(mlp, z, mb, mW, 1, taps, group)
    h = rms(x, w["norm.weight"], eps)[1:]
    u = (h @ lm_head.T) * dc.get("output_multiplier", 1.0)
    gate = h @ w["candidate_selector.hidden_projection.weight"].T
    A, Bc = (w["candidate_selector.predecessor_codebook"],
             w["candidate_selector.successor_codebook"])
    prev, path = anchor_token, []
    for p in range(Bk - 1):
        cand = u[p].topk(dc["selector_top_k"]).indices
        score = u[p, cand] + (Bc[cand] * (A[prev] * gate[p])).sum(-1)
        prev = int(cand[score.argmax()])
        path.append(prev)
    return u, path


@pytest.mark.parametrize("S", [3, 14])
def test_an_independent_reader_gives_the_drafters_logits_and_drafts(saved, S):
    m, folder = saved
    torch.manual_seed(S)
    feats = torch.randn(1, S, len(LAYER_IDS) * H)
    last = 42
    want_u, want_path = reader(folder, feats[0], last, S, m.embed_tokens.weight.detach(),
                               m.lm_head.weight.detach())
    with torch.no_grad():
        from dflash_core.models.proposal import block_states

        got_u = m.unary_logits(block_states(m, feats, [S], [last])[0, 1:])
        got = m.draft_batch(feats, [S], [last]).tokens[0].tolist()
    assert (got_u - want_u).abs().max().item() <= 1e-4 * want_u.abs().max().item()
    assert got == want_path


@pytest.mark.parametrize("change, says", [
    (lambda c: c["dflash_config"].pop("conv_group_size"), "lacks dflash_config.conv_group_size"),
    (lambda c: c["dflash_config"].update(sample_from_anchor=True), "sample_from_anchor"),
    (lambda c: c["dflash_config"].update(input_embedding_scale=2.0), "input_embedding_scale"),
    (lambda c: c.update(layer_types=["sliding_attention"] * L), "sliding_attention"),
    (lambda c: c.update(architectures=["DFlashDraftModel"]), "not a DFlash2 drafter"),
])
def test_what_this_engine_cannot_load_is_refused_in_one_line(saved, change, says):
    from dflash_core.models.dflash2.format import NotDFlash2

    _, folder = saved
    cfg = json.loads((folder / "config.json").read_text())
    change(cfg)
    with pytest.raises(NotDFlash2) as exc:
        DFlash2Drafter.config_from_dict(cfg)
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_codebooks_under_weight_names_and_a_top_k_beyond_the_vocabulary_are_named(saved, tmp_path):
    """Robustness round six: a folder whose codebooks carry '.weight' (as an nn.Embedding's would)
    or whose selector_top_k exceeds its vocabulary is refused in one line naming it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dflash_core.models.dflash2.format import NotDFlash2

    _, folder = saved
    renamed = tmp_path / "renamed"
    shutil.copytree(folder, renamed)
    state = load_file(str(renamed / "model.safetensors"))
    save_file({(k + ".weight" if k.endswith("_codebook") else k): v for k, v in state.items()},
              str(renamed / "model.safetensors"))
    with pytest.raises(NotDFlash2) as exc:
        DFlash2Drafter.load(renamed)
    assert "candidate_selector.predecessor_codebook.weight" in str(exc.value)
    assert "\n" not in str(exc.value)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dflash_config"]["selector_top_k"] = cfg["vocab_size"] + 1
    with pytest.raises(NotDFlash2, match="selector_top_k .*K must be 1.."):
        DFlash2Drafter.config_from_dict(cfg)


def test_a_dflash2_folder_where_another_family_is_expected_and_init_from_dspark(saved, tmp_path):
    """A DFlash2 folder given to a DFlash run is named as DFlash2; drafter.init_from a DSpark
    folder in a DFlash2 run is refused naming it (its backbone is not DFlash's)."""
    _, folder = saved
    with pytest.raises(ObjectiveMismatch, match="holds a DFlash2 drafter, but drafter.objective "
                                                "is dflash"):
        load_drafter(folder, "dflash")
    dspark = tmp_path / "dspark"
    (dspark).mkdir()
    (dspark / "config.json").write_text(json.dumps({"architectures": ["Qwen3DSparkModel"]}))
    with pytest.raises(ObjectiveMismatch, match="holds a DSpark drafter, but "
                                                "drafter.objective is dflash2"):
        load_drafter(dspark, "dflash2")


def test_an_init_from_refused_when_the_drafter_is_built_is_the_configs_fault(saved, tmp_path):
    """A drafter.init_from folder that passed preflight and changed since is refused when the
    drafter is built as a ConfigError naming the key (a [config] line, exit 2), with advice for
    starting from a folder, not resuming one (was: NotDFlash2, "[internal] ... a bug in
    dflash"). Preflight's own check (registry.check_folder) reads the header only."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dflash_core.config import ConfigError, DrafterConfig, OptimConfig
    from dflash_core.models.registry import check_folder
    from dflash_core.models.training.trainer import build_replicas

    _, folder = saved
    renamed = tmp_path / "renamed"
    shutil.copytree(folder, renamed)
    state = load_file(str(renamed / "model.safetensors"))
    save_file({(k + ".weight" if k.endswith("_codebook") else k): v for k, v in state.items()},
              str(renamed / "model.safetensors"))
    with pytest.raises(ValueError, match="names the selector's codebooks"):
        check_folder(renamed, "dflash2")
    dspark = tmp_path / "dspark"
    dspark.mkdir()
    (dspark / "config.json").write_text(json.dumps({"architectures": ["Qwen3DSparkModel"]}))

    def build(init_from, objective="dflash2"):
        with pytest.raises(ConfigError) as exc:  # refused before the target is touched
            build_replicas(DrafterConfig(objective=objective, init_from=str(init_from)),
                           OptimConfig(), None, [torch.device("cpu")], seed=0,
                           layer_ids=LAYER_IDS, mask_id=V - 1)
        assert exc.value.key == "drafter.init_from" and exc.value.error_kind == "config"
        return exc.value

    assert "names the selector's codebooks" in build(renamed).message
    err = build(dspark)
    assert err.message == f"{dspark} holds a DSpark drafter, but drafter.objective is dflash2"
    assert err.hint.endswith("or set drafter.objective: dspark to train from this one")
    err = build(folder, "dflash")
    assert err.hint == ("point drafter.init_from at the folder of a DFlash drafter, or set "
                        "drafter.objective: dflash2 to train from this one")
