"""The check's samples: prompts taken from the user's data, responses written by the target.

The response must be the target's own greedy continuation: exact decoding verifies against that
text, so a drafter that memorised it can be accepted in full. The data's own response is not used
(it may have been written by another model, or sampled).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_core.data import DataError, ShardedDataset
from dflash_core.eval.evaluate import TargetFn, plain_greedy


@dataclass
class CheckSample:
    index: int  # the sample's index in the data set
    prompt: list[int]
    response: list[int]  # the target's greedy continuation of the prompt

    @property
    def input_ids(self) -> list[int]:
        return self.prompt + self.response

    @property
    def loss_mask(self) -> list[int]:
        return [0] * len(self.prompt) + [1] * len(self.response)


def prompt_of(ids, mask) -> list[int]:
    """The tokens before the first response token (the loss mask's first 1); [] without one."""
    first = next((j for j, m in enumerate(mask) if m), None)
    return [int(t) for t in ids[:first]] if first else []


def pick_prompts(dataset: ShardedDataset, n: int, max_prompt: int) -> list[tuple[int, list[int]]]:
    """The first ``n`` samples (in data order) that have a prompt of at most ``max_prompt``
    tokens, as (index, prompt). A sample is read only until ``n`` are found."""
    found: list[tuple[int, list[int]]] = []
    for i in range(len(dataset)):
        ids, mask = dataset.get(i)
        prompt = prompt_of(ids, mask)
        if prompt and len(prompt) <= max_prompt:
            found.append((i, prompt))
            if len(found) == n:
                return found
    if not found:
        raise DataError(
            f"no sample has a prompt (tokens before the loss mask's first 1) of 1 to {max_prompt} "
            "tokens", file=dataset.path,
            hint="the check needs samples whose loss mask starts after the prompt; lower "
                 "--response-tokens or raise data.max_length so prompt + response fit")
    return found


def write_responses(target_fn: TargetFn, prompts: list[tuple[int, list[int]]], tokens: int, *,
                    eos_token_id: int | None, device) -> list[CheckSample]:
    """Each prompt with the target's greedy continuation of ``tokens`` tokens (shorter when the
    target ends it with ``eos_token_id``)."""
    return [CheckSample(i, p, plain_greedy(target_fn, p, tokens, eos_token_id=eos_token_id,
                                           device=device))
            for i, p in prompts]
