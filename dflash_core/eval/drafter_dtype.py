"""The dtype a drafter is evaluated in: its SERVED dtype by default (issue 46, "what is measured is
what is served"), in ``dflash-tui eval`` (``--drafter-dtype``), ``check`` (``--drafter-dtype``) and
the run's evaluation (``eval.drafter_dtype``).

Every serving stack runs the drafter in the dtype of its ``model.safetensors`` (bfloat16 for this
engine's checkpoints: ``drafter.dtype``); evaluating a float32 copy measures another model, whose
tau can differ. float32 stays available by name. Only the drafter's parameters are cast (the
weights a server loads); its buffers (rotary frequencies) and the target's borrowed embedding and
lm_head stay as they are, the target in its own dtype (target.dtype).
"""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path

import torch

from dflash_core.checkpoint.safetensors_io import read_header
from dflash_core.eval.errors import EvalInputError

DTYPES = ("bfloat16", "float16", "float32")
SERVED = "served"  # eval.drafter_dtype's default: the run's drafter.dtype
_SAFETENSORS = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def served_dtype_of(folder: Path, default: str = "bfloat16") -> str:
    """The dtype a server loads the drafter of ``folder`` in: the floating dtype most of the
    tensors of its model.safetensors hold (read from the file's header, no weights read);
    ``default`` when the header names none of bfloat16, float16, float32 or cannot be read."""
    try:
        _, header = read_header(Path(folder) / "model.safetensors")
    except (OSError, ValueError):
        return default
    kinds = Counter(_SAFETENSORS[v["dtype"]] for k, v in header.items()
                    if k != "__metadata__" and isinstance(v, dict)
                    and v.get("dtype") in _SAFETENSORS)
    return kinds.most_common(1)[0][0] if kinds else default


def check_dtype(name: str, device: torch.device, option: str = "--drafter-dtype") -> str:
    """``name`` when it is a dtype the drafter can be decoded in on ``device``; else
    EvalInputError, one line (an unknown name; a dtype whose matmul, softmax or norm torch
    refuses on that device), before any weight is read."""
    if name not in DTYPES:
        raise EvalInputError(f"{option} {name!r}: use {', '.join(DTYPES)}",
                             hint="the served dtype is the default (model.safetensors' own)")
    dt = getattr(torch, name)
    try:  # the ops a drafter's forward needs, in that dtype on that device
        x = torch.ones(2, 4, dtype=dt, device=device)
        y = torch.nn.functional.linear(x, torch.ones(4, 4, dtype=dt, device=device))
        y = torch.nn.functional.rms_norm(y, (4,)) if hasattr(torch.nn.functional, "rms_norm") \
            else y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        q = y[None, None]
        torch.nn.functional.scaled_dot_product_attention(q, q, q).softmax(-1).argmax(-1)
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise EvalInputError(f"{option} {name}: {device} cannot run the drafter in {name} "
                             f"({first})", hint="pass --drafter-dtype float32 (or bfloat16)"
                             ) from exc
    return name


def cast_parameters(module: torch.nn.Module, name: str) -> torch.nn.Module:
    """``module`` with its floating parameters in dtype ``name`` (in place; buffers kept)."""
    dt = getattr(torch, name)
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != dt:
            p.data = p.data.to(dt)
    return module


def served_copy(drafter: torch.nn.Module, name: str) -> torch.nn.Module:
    """A copy of ``drafter`` with its parameters in dtype ``name``, sharing the target's
    embedding and lm_head it borrows (never copied): the run's evaluation decodes it and drops it
    after. The float32 originals are never copied whole: each parameter is cast on its own, so
    the copy costs its own bytes only. Parameters already in ``name`` are shared."""
    dt = getattr(torch, name)
    memo: dict[int, object] = {}
    head = getattr(drafter, "_head", None)
    for m in head or ():  # the target's, borrowed: shared by the copy
        memo[id(m)] = m
    for p in drafter.parameters():
        if p.is_floating_point() and p.dtype != dt:
            memo[id(p)] = torch.nn.Parameter(p.detach().to(dt), requires_grad=False)
        else:
            memo[id(p)] = p
    return copy.deepcopy(drafter, memo)


def parameter_dtype(module: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the module's first floating parameter (None: none)."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
