"""Nested training state (optimizer, scheduler, trainer) as a JSON skeleton plus named tensors.

A checkpoint stores no pickle: every tensor of the tree goes to a safetensors file under a name
made from its path (``optimizer/state/3/exp_avg``), and the skeleton that holds the rest (numbers,
strings, lists, dicts) refers to it by that name. Tuples and dicts with non-string keys (an
optimizer's ``state`` is keyed by parameter index) are tagged so they come back as they were.
Anything else is refused before a byte is written.
"""

from __future__ import annotations

from typing import Any

import torch

TENSOR, TUPLE, ITEMS = "__tensor__", "__tuple__", "__items__"


def flatten(tree: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """The JSON skeleton of ``tree``; its tensors are added to ``tensors`` (by name)."""
    if isinstance(tree, torch.Tensor):
        name = prefix
        tensors[name] = tree.detach()
        return {TENSOR: name}
    if isinstance(tree, (str, bool, type(None), int, float)):
        return tree
    if isinstance(tree, torch.Size):
        return {TUPLE: [int(x) for x in tree]}
    if isinstance(tree, dict):
        if all(isinstance(k, str) and k not in (TENSOR, TUPLE, ITEMS) for k in tree):
            return {k: flatten(v, f"{prefix}/{k}", tensors) for k, v in tree.items()}
        items = []
        for k, v in tree.items():
            if not isinstance(k, (str, int, float, bool, type(None))):
                raise TypeError(f"{prefix}: key {k!r} of type {type(k).__name__} cannot be stored "
                                "in a checkpoint; use str, int, float or bool keys")
            items.append([k, flatten(v, f"{prefix}/{k}", tensors)])
        return {ITEMS: items}
    if isinstance(tree, (list, tuple)):
        out = [flatten(v, f"{prefix}/{i}", tensors) for i, v in enumerate(tree)]
        return {TUPLE: out} if isinstance(tree, tuple) else out
    raise TypeError(f"{prefix}: {type(tree).__name__} cannot be stored in a checkpoint (JSON and "
                    "safetensors only, no pickle); store tensors, numbers, strings, lists or dicts")


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The tree ``flatten`` took apart (KeyError: a tensor it names is missing)."""
    if isinstance(skeleton, dict):
        if TENSOR in skeleton and len(skeleton) == 1:
            return tensors[skeleton[TENSOR]]
        if TUPLE in skeleton and len(skeleton) == 1:
            return tuple(unflatten(v, tensors) for v in skeleton[TUPLE])
        if ITEMS in skeleton and len(skeleton) == 1:
            return {k: unflatten(v, tensors) for k, v in skeleton[ITEMS]}
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    return skeleton
