"""Token choice at a temperature, and the standard speculative-sampling acceptance rule
(Leviathan et al. 2023; Chen et al. 2023), with a random generator per prompt.

Drafted token ``x_j`` was drawn from the drafter's distribution ``q_j``; the target's is ``p_j``
at the same position (both softmax(logits / T)). Draft j is accepted with probability
``min(1, p_j(x_j) / q_j(x_j))``; at the first rejection the token is drawn from the residual
``max(0, p_j - q_j)`` normalised, and when every draft is accepted the bonus token from the
target's next distribution. The tokens produced are then distributed exactly as the target's own
sampling at T, whatever the drafter proposes; the drafter only changes how many come per round.

Each prompt has its own generator, seeded from (seed, prompt index), and its draws are made in a
fixed order (drafts, then acceptance, then the residual or bonus): a prompt's tokens do not
depend on which other prompts share its batch, and two runs with one seed give the same tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from dflash_core.models.proposal import probabilities  # the drafters' too


def prompt_generator(seed: int, index: int, device) -> torch.Generator:
    """The generator of prompt ``index`` under ``seed`` (on the device its draws are made)."""
    state = int(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(index)]).generate_state(1)[0])
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(state)
    return gen


def draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One token from a distribution [V]."""
    return int(torch.multinomial(probs, 1, generator=gen))


def choose(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> int:
    """The target's token after ``logits`` [V]: argmax at T = 0, else a draw at T."""
    if temperature <= 0:
        return int(logits.argmax(-1))
    return draw(probabilities(logits, temperature), gen)


def accept_sampled(drafts: list[int], q: torch.Tensor | None, target_logits: torch.Tensor,
                   temperature: float, gen: torch.Generator) -> tuple[int, int]:
    """(drafts accepted, the token after them) by the speculative-sampling rule.
    ``q`` [d, V]: the distribution each draft was drawn from; ``target_logits`` [d + 1, V]: the
    target's at each draft's position and after the last."""
    p = probabilities(target_logits, temperature)
    for j, x in enumerate(drafts):
        u = torch.rand((), generator=gen, device=p.device)
        if bool(u * q[j, x] < p[j, x]):
            continue
        residual = (p[j] - q[j]).clamp_min(0)
        total = residual.sum()
        # p == q at every token leaves nothing; then the rejection itself had probability 0,
        # and p is the right distribution (only reached through float rounding).
        return j, draw(residual / total if float(total) > 0 else p[j], gen)
    return len(drafts), draw(p[len(drafts)], gen)
