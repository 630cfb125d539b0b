"""The training tau (d) an evaluation publishes, and when the over-fitting rule may use it: a
step's tau is taken before its update, so in the first epoch it is a held-out measure itself."""

from dflash_core.config import EvalConfig
from dflash_core import acceptance
from dflash_core.pipeline.evaluation import Evaluator


def evaluator() -> Evaluator:
    return Evaluator(EvalConfig(), lambda ev: None, dataset=None, eval_indices=[],
                     layer_ids=[1], max_length=64, loss_chunk=4096, seed=0)


def test_no_steps_no_training_tau():
    assert evaluator().train_tau() == (acceptance.MISSING, acceptance.MISSING)


def test_the_first_epoch_is_published_but_never_called_over_fitting():
    # the healthy demo at step 30 (seed 0): 2.94 in training, 1.23 on 8 held-out samples
    ev = evaluator()
    for tau in (2.5, 3.38):
        ev.stepped(tau, epoch=0)
    train, rule = ev.train_tau()
    assert train == 2.94 and rule == acceptance.MISSING
    found = acceptance.findings(30, 1.27, 1.27, 1.23, rule, 1.0, EvalConfig())
    assert [f.kind for f in found] == []


def test_once_a_sample_comes_again_the_rule_compares():
    ev = evaluator()
    ev.stepped(2.5, epoch=0)
    ev.stepped(3.38, epoch=1)
    train, rule = ev.train_tau()
    assert train == rule == 2.94
    found = acceptance.findings(30, 1.27, 1.27, 1.23, rule, 1.0, EvalConfig())
    assert [f.kind for f in found] == ["overfit"]
