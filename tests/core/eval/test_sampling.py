"""The speculative-sampling rule gives the target's distribution, whatever the drafter's."""

import torch

from dflash_core.eval.sampling import accept_sampled, prompt_generator


def test_tokens_follow_the_targets_distribution_whatever_the_drafts():
    T = 1.0
    target = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5], [0.0, 0.0, 3.0, 0.0, 0.0]])
    p0 = torch.softmax(target[0], -1)
    q = torch.tensor([0.05, 0.05, 0.6, 0.2, 0.1])  # far from p: many rejections
    gen = prompt_generator(0, 0, "cpu")
    n = 20000
    counts = torch.zeros(5)
    accepted = 0
    for _ in range(n):
        x = int(torch.multinomial(q, 1, generator=gen))
        k, nxt = accept_sampled([x], q[None], target, T, gen)
        first = x if k == 1 else nxt
        counts[first] += 1
        accepted += k
    freq = counts / n
    assert float((freq - p0).abs().sum()) / 2 < 0.015  # total variation: sampling noise only
    # accepted with probability sum_x min(p(x), q(x))
    want = float(torch.minimum(p0, q).sum())
    assert abs(accepted / n - want) < 0.015


def test_a_drafter_equal_to_the_target_is_always_accepted():
    target = torch.tensor([[1.0, 2.0, 0.5], [0.3, 0.2, 0.1], [0.0, 1.0, 0.0]])
    q = torch.softmax(target[:2], -1)
    gen = prompt_generator(3, 1, "cpu")
    for _ in range(200):
        drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
        k, _ = accept_sampled(drafts, q, target, 1.0, gen)
        assert k == 2


def test_generators_are_per_seed_and_prompt():
    a = torch.rand(4, generator=prompt_generator(1, 5, "cpu"))
    assert torch.equal(a, torch.rand(4, generator=prompt_generator(1, 5, "cpu")))
    assert not torch.equal(a, torch.rand(4, generator=prompt_generator(1, 6, "cpu")))
    assert not torch.equal(a, torch.rand(4, generator=prompt_generator(2, 5, "cpu")))
