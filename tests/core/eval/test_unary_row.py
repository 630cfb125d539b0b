"""`dflash-tui eval` of a DFlash2 folder: the row "tau unary argmax" beside its tau, as the
run's evaluation has it (EvalResult.tau_unary): the same prompts decoded again with each slot's
unary argmax in place of the selector's walk; "-" for the other families."""

import json

import pytest
import torch

from dflash_core.eval import EvalOptions, Evaluation
from dflash_core.eval.evaluate import evaluate_tau, target_fn_for
from dflash_core.eval.table import set_table
from dflash_core.families.dflash2 import DFlash2Settings
from dflash_core.models.dflash2.drafter import DFlash2Drafter
from dflash_core.models.target.load import load_target
from tests.core.eval.conftest import DEMO_LAYERS, save_dflash

NEW = 12
SPACE, NEVER = 32, 0  # a token the demo target's text is full of, and one it never writes


def _telling_paths(original):
    """draft_batch of a drafter whose two paths can be told apart by tau: the unary path drafts
    spaces (accepted where the target writes one), the selector's walk a token never accepted.
    Random drafters accept nothing either way, which would hide a path mixed up."""
    from dflash_core.models.proposal import Proposal

    def draft_batch(self, context, lengths, last, temperature=0.0, gens=None, *, path=None):
        got = original(self, context, lengths, last, temperature, gens, path=path)
        tok = SPACE if (path or self.path) == "unary" else NEVER
        return Proposal(torch.full_like(got.tokens, tok), None)

    return draft_batch


def save_dflash2(folder, target_config, seed: int, block: int = 4):
    from dflash_core.data.byte_vocab import MASK_ID

    cfg = DFlash2Drafter.new_config(
        target_config, num_layers=1, target_layer_ids=DEMO_LAYERS, block_size=block,
        mask_token_id=MASK_ID, settings=DFlash2Settings(
            block_size=block, conv_kernel_size=2, conv_group_size=16, selector_rank=8,
            selector_top_k=4))
    torch.manual_seed(seed)
    DFlash2Drafter(cfg).save(folder)
    return folder


@pytest.fixture(scope="module")
def measured(demo_eval, demo_hf_config, tmp_path_factory, module_thread):
    root = tmp_path_factory.mktemp("unary")
    drafters = [save_dflash2(root / "d2", demo_hf_config, 3), save_dflash(root / "d1",
                                                                          demo_hf_config, 1)]
    opts = EvalOptions(target=str(demo_eval["target"]), drafters=[str(d) for d in drafters],
                       prompts=[f"plain={demo_eval['sets']['plain']}"], max_new_tokens=NEW,
                       batch=2, limit=3, out=str(root / "out"), device="cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DFlash2Drafter, "draft_batch", _telling_paths(DFlash2Drafter.draft_batch))
        ev = Evaluation(opts, lambda m: None)
        rep = ev.run()
        target = load_target(demo_eval["target"], dtype="float32")
        drafter = ev.decoders[1].drafter
        prompts = [list(p) for p in ev.rendered["plain"].ids]
        fn = target_fn_for(target, DEMO_LAYERS)
        with drafter.unary_path():  # the engine's own exact tau along each path
            unary = evaluate_tau(fn, drafter, prompts, NEW, DEMO_LAYERS)
        walk = evaluate_tau(fn, drafter, prompts, NEW, DEMO_LAYERS)
    return rep, root / "out", unary, walk


def test_the_dflash2_column_has_its_unary_tau_and_the_table_shows_it(measured):
    rep, out, want, walk = measured
    (s,) = rep.sets
    d2, d1 = s.drafters["d2"], s.drafters["d1"]
    assert d1.tau_unary is None
    assert want.tau > 1.0 == walk.tau  # the two paths told apart
    assert d2.tau_unary == pytest.approx(want.tau) and d2.tau == pytest.approx(walk.tau)
    table = set_table(s.name, s.prompts, s.plain, s.drafters, rep.per_round, True)
    (row,) = [r for r in table.splitlines() if r.startswith("tau unary argmax")]
    assert row.split()[3:] == ["-", f"{want.tau:.2f}", "-"]
    saved = json.loads((out / "results.json").read_text())["sets"]["plain"]["drafters"]
    assert saved["d2"]["tau_unary"] == pytest.approx(want.tau) and saved["d1"]["tau_unary"] is None


def test_a_results_file_without_unary_lines_shows_none(measured):
    from dflash_core.eval.summary import unary_tau

    assert unary_tau([{"unary_acceptance": [1, 0]}, {"acceptance": [2]}]) is None
    assert unary_tau([{"unary_acceptance": [1, 0]}, {"unary_acceptance": [3]}]) == \
        pytest.approx((2 + 1 + 4) / 3)
