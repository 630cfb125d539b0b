"""Loading the frozen target from a local folder, with visible progress.

Loading goes through transformers' own ``from_pretrained`` (local files, safetensors only, no
pickle; a quantized checkpoint as transformers loads it). Before loading, the shards are read once
in order: that pulls them into the page cache, which is the slow part of a cold load, so the byte
and shard counts reported along the way measure real work, and ``from_pretrained`` then maps them
from memory. Measured on an H200 host with a cold 16 GB 8B-shaped checkpoint: 18-20 s in all
against 17 s for ``from_pretrained`` alone; the read took 10 s of it, the rest
(``from_pretrained`` from the page cache) about 3 s.

An FP8 block-wise checkpoint stays FP8 on a GPU that can hold it so, and is dequantized as it
loads elsewhere, said in one line with the memory that costs (target/fp8.py); which matmul runs the
kept weights is decided on the loaded model and said too.

The config checks made before any weight is read are in target/config.py; the loaded model and its
features in target.py.
"""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from dflash_core.models.target import fp8 as fp8_weights
from dflash_core.models.target.model import TargetModel
from dflash_core.models.target.config import (
    CONFIG_NAME, TargetLoadError, load_target_config, path_hint,
)
from dflash_core.models.target.shape import model_shape
from dflash_core.units import size_text

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

_READ_CHUNK = 16 << 20  # bytes per read while pre-reading shards
_REPORT_EVERY_S = 0.25  # progress inside one shard at most this often


class LoadAborted(Exception):
    """The stop event was set while the target was loading."""


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files transformers will read: the index's shards, or model.safetensors."""
    index = folder / WEIGHTS_INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise TargetLoadError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise TargetLoadError(f"{index} lists shards that are not in {folder}: {missing}")
        return files
    single = folder / WEIGHTS_NAME
    if single.is_file():
        return [single]
    found = sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
    raise TargetLoadError(
        f"no safetensors weights in target folder {folder}: expected {WEIGHTS_NAME} or "
        f"{WEIGHTS_INDEX_NAME}" + (f" (found {found})" if found else ""))


def _can_load_onto_device() -> bool:
    # transformers places weights straight on a GPU only through a device_map, which it allows
    # only with accelerate installed; without it we load on the CPU and move the model once.
    return importlib.util.find_spec("accelerate") is not None


def _check_stop(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise LoadAborted("target loading stopped")


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise TargetLoadError(f"unknown dtype {dtype!r}", hint=lambda w: f"{w.dtype} bfloat16, "
                              "float16 or float32")
    return value


# transformers builds a model inside context managers that patch process-wide functions
# (PreTrainedModel.tie_weights, torch.linspace, ...) and put back what they found. Two threads
# building at once can put back each other's patch: weight tying then stays off in the process,
# and a tied lm_head (the drafter borrows it) is left untied. One build at a time; the shards are
# still read in parallel before (load_target's progress pass), so this costs little.
HF_BUILD_LOCK = threading.Lock()


def load_target(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    attn_implementation: str = "sdpa",
    progress: Callable[..., None] | None = None,
    stop: threading.Event | None = None,
    trust_remote_code: bool = False,
    say: Callable[[str], None] | None = None,
    fp8_matmul: str = "auto",
    distributed: dict | None = None,
) -> "TargetModel":
    """Load a frozen causal LM from a local folder, reporting progress shard by shard.

    ``progress(**fields)``: called with the fields of a LoadProgress event (observe/events.py)
    but its worker and device: bytes_loaded, bytes_total, shards_loaded, shards_total, seconds
    (since this call), done, and memory_after (bytes on the device once loaded, 0 until done).

    ``trust_remote_code``: run the folder's own model code (target.trust_remote_code); off, a
    model that needs it is refused before anything is read. Raises TargetLoadError for a bad
    folder or config, LoadAborted when ``stop`` is set.

    An FP8 block-wise checkpoint: ``say(line)`` is told how its weights are held (dequantized, and
    why, with the memory; or kept FP8 and what multiplies them), once, also kept on the result as
    ``quantized`` (fp8.QuantizedNote). ``fp8_matmul`` (fp8.MATMULS): "auto" runs the kept weights on
    transformers' kernels where they run, else on BlockFP8Linear; "engine" and "transformers"
    choose one (benchmarks compare them).

    ``distributed``: this process is one rank of a target group (target_group/rank.py), its
    process group made; the fields of transformers' ``DistributedConfig`` that split the model
    between the ranks (target_group/split.py). transformers then places this rank's share.
    """
    t0 = time.monotonic()  # before the import: the first one takes seconds and is part of loading
    import transformers  # noqa: F401

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise TargetLoadError(f"target folder {folder} does not exist")
    if not (folder / CONFIG_NAME).is_file():
        raise TargetLoadError(f"target folder {folder} has no {CONFIG_NAME}")
    files = _weight_files(folder)
    config = load_target_config(folder, trust_remote_code)
    dtype = _as_dtype(dtype)
    device = torch.device(device)
    if fp8_matmul not in fp8_weights.MATMULS:
        raise ValueError(f"fp8_matmul {fp8_matmul!r}: choose one of {fp8_weights.MATMULS}")
    raw = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))  # checked just above
    fp8 = fp8_weights.fp8_quantization(raw)

    total = sum(f.stat().st_size for f in files)

    def report(loaded: int, shards: int, done: bool = False, memory: int = 0) -> None:
        if progress is not None:
            progress(bytes_loaded=loaded, bytes_total=total, shards_loaded=shards,
                     shards_total=len(files), seconds=time.monotonic() - t0, done=done,
                     memory_after=memory)

    report(0, 0)
    loaded = 0
    buf = memoryview(bytearray(_READ_CHUNK))
    for shard, file in enumerate(files):
        _check_stop(stop)
        last = time.monotonic()
        with open(file, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                loaded += n
                _check_stop(stop)  # a big shard is also a place to stop, not only its end
                if time.monotonic() - last >= _REPORT_EVERY_S:
                    report(loaded, shard)
                    last = time.monotonic()
        report(loaded, shard + 1)
    _check_stop(stop)

    notes: list[fp8_weights.QuantizedNote] = []

    def note(line: str, kept: bool, planned: bool) -> None:
        # how the weights are held: said as soon as it is known (one line: a load again says
        # only its own)
        notes.append(fp8_weights.QuantizedNote(line, kept, planned))
        if say is not None:
            say(line)

    why_dequantized = None
    if fp8 is not None:
        # a group's ranks run FP8 routed experts without transformers' kernels too (fp8_group)
        why_dequantized = fp8_weights.fp8_dequantize_reason(
            [device], model_shape(raw).experts > 0 and not distributed)
        if why_dequantized:
            note(_dequantized_note(files, dtype, why_dequantized), kept=False, planned=True)
            fp8_weights.dequantize_as_loaded(config)
    model = _build(folder, config, device, dtype, attn_implementation, trust_remote_code, stop,
                   distributed)
    if fp8 is not None and not why_dequantized:
        if distributed:
            from dflash_core.models.target import fp8_group
            matmul = fp8_group.settle_matmul(model, fp8_matmul, dtype, device)
        else:
            matmul = _settle_fp8_matmul(model, fp8_matmul, dtype)
        if isinstance(matmul, str):
            note(_kept_note(files, device, dtype, matmul, distributed), kept=True,
                 planned=False)
        else:  # FP8 routed experts nothing here runs: load again, dequantized
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
            why, left = matmul
            note(_dequantized_note(files, dtype, f"{why} and {left} have no other matmul"),
                 kept=False, planned=False)
            fp8_weights.dequantize_as_loaded(config)
            model = _build(folder, config, device, dtype, attn_implementation,
                           trust_remote_code, stop, distributed)

    target = TargetModel(model)
    target.quantized = notes[-1] if notes else None
    report(loaded, len(files), done=True, memory=target.memory_bytes())
    return target


def _build(folder: Path, config, device: torch.device, dtype: torch.dtype,
           attn_implementation: str, trust_remote_code: bool,
           stop: threading.Event | None, distributed: dict | None = None):
    """transformers' model from the folder (read once already), on ``device``; with
    ``distributed``, this rank's share of it (transformers places it)."""
    from transformers import AutoModelForCausalLM

    direct = device.type != "cpu" and _can_load_onto_device() and not distributed
    placement: dict = {"device_map": {"": device} if direct else None}
    if distributed:
        from transformers.distributed import DistributedConfig
        placement = {"distributed_config": DistributedConfig(**distributed)}
    try:
        with HF_BUILD_LOCK:
            model, info = AutoModelForCausalLM.from_pretrained(
                folder, config=config, dtype=dtype, attn_implementation=attn_implementation,
                local_files_only=True, use_safetensors=True, output_loading_info=True,
                trust_remote_code=trust_remote_code, **placement)
    except (ValueError, ImportError) as exc:  # e.g. an attention implementation not installed
        raise TargetLoadError(
            f"transformers could not build the target from {folder}: {exc}",
            hint=lambda w: w.attention) from exc
    except Exception as exc:  # a truncated or garbled weights file (SafetensorError, ...)
        if type(exc).__name__ != "SafetensorError" and "safetensors" not in str(exc).lower():
            raise
        raise TargetLoadError(
            f"the target's weights in {folder} cannot be read: {type(exc).__name__}: {exc}",
            hint=lambda w: "a *.safetensors file is truncated or damaged: download the model "
                           f"again, or {w.point} an intact copy") from exc
    # A weight missing from the checkpoint would be silently random: refuse it.
    if info.get("missing_keys"):
        raise TargetLoadError(
            f"target checkpoint {folder} lacks weights the model needs: "
            f"{sorted(info['missing_keys'])[:8]}", hint=lambda w: "the folder's weights do not "
            "match its config.json; " + path_hint(w))
    if stop is not None and stop.is_set():
        del model
        raise LoadAborted("target loading stopped")
    if device.type != "cpu" and not direct and not distributed:
        model.to(device)
    return model


def _settle_fp8_matmul(model, choice: str, dtype: torch.dtype) -> str | tuple[str, str]:
    """What multiplies the kept FP8 weights (a name for the note), after swapping transformers'
    FP8 linear layers for BlockFP8Linear where its kernels do not run (or "engine" asks); or
    (why, the FP8 tensors nothing else runs) when some are left."""
    if choice == "transformers":
        return fp8_weights.TRANSFORMERS_MATMUL
    fails = None if choice == "engine" else fp8_weights.transformers_matmul_fails(model, dtype)
    if choice == "auto" and fails is None:
        return fp8_weights.TRANSFORMERS_MATMUL
    fp8_weights.use_engine_matmul(model)
    why = ("fp8_matmul engine was asked for" if fails is None
           else f"transformers' FP8 kernels do not run here ({fails})")
    left = fp8_weights.fp8_left(model)
    if left:
        return why, f"{len(left)} FP8 tensors such as {left[0]}"
    return fp8_weights.ENGINE_MATMUL if fails is None else f"{fp8_weights.ENGINE_MATMUL}: {why}"


def _dequantized_note(files: list[Path], dtype: torch.dtype, why: str) -> str:
    stored, plain = fp8_weights.checkpoint_bytes(files, dtype)
    return (f"target: FP8 block-wise weights dequantized to {_dtype_name(dtype)} as they load "
            f"({why}): {size_text(plain)} instead of {size_text(stored)} kept FP8")


def _kept_note(files: list[Path], device: torch.device, dtype: torch.dtype, matmul: str,
               distributed: dict | None = None) -> str:
    stored, plain = fp8_weights.checkpoint_bytes(files, dtype)
    where = str(device)
    if distributed:  # a rank of a target group: the copy's bytes, split over its ranks
        import torch.distributed as dist
        ranks = dist.get_world_size() if dist.is_initialized() else 1
        where = f"the group's {ranks} ranks"
    return (f"target: FP8 block-wise weights stay FP8 on {where}: {size_text(stored)} "
            f"({size_text(plain)} in {_dtype_name(dtype)}), run by {matmul}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
