"""The frozen target: load it with visible progress, and compute the features the drafter needs.

``TargetModel.features`` returns the outputs of the chosen decoder layers only. It never computes
lm_head logits, never keeps the full tuple of hidden states, and stops the forward right after the
last chosen layer (docs/architecture.md, Memory plan): for a 248k vocab the logits alone were
~30 GiB per batch.

The decoder stack and its final norm are found through the model's own accessor
(``get_decoder()``), so a mixture of experts, a DeepSeek-style model or the language model inside a
multimodal wrapper (Gemma 3's ``...ForConditionalGeneration``) are read the same way.

Loading goes through transformers' own ``from_pretrained`` (local files, safetensors only, no
pickle; a quantized checkpoint as transformers loads it). Code shipped in the target's folder
(config.json ``auto_map``) runs only with ``trust_remote_code``, passed explicitly so transformers
never asks on the terminal. Before loading, the shards are read once in order: that pulls them
into the page cache, which is the slow part of a cold load, so the byte and shard counts reported
along the way measure real work, and ``from_pretrained`` then maps them from memory. Measured on
an H200 host with a cold 16 GB 8B-shaped checkpoint: 18-20 s in all against 17 s for
``from_pretrained`` alone; the read took 10 s of it, the rest (``from_pretrained`` from the page
cache) about 3 s.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

_PATH_HINT = ("set target.path in config.yaml to a local folder holding config.json and "
              "model.safetensors (or model.safetensors.index.json and its shards)")
_READ_CHUNK = 16 << 20  # bytes per read while pre-reading shards
_REPORT_EVERY_S = 0.25  # progress inside one shard at most this often


class TargetLoadError(RuntimeError):
    """The target cannot be loaded as configured. ``hint`` says what to change in config.yaml."""

    def __init__(self, message: str, hint: str = _PATH_HINT, error_kind: str = "config"):
        super().__init__(message)
        self.hint = hint
        self.error_kind = error_kind


class LoadAborted(Exception):
    """The stop event was set while the target was loading."""


class ForwardInterrupted(Exception):
    """The stop event was set during a forward; the remaining layers were skipped."""


def default_layer_ids(num_layers: int, k: int = 5) -> list[int]:
    """k layer ids spread evenly from 1 to num_layers-3 (0-based), as the reference dflash does."""
    if k < 1 or num_layers < 1:
        raise ValueError(f"need k >= 1 and num_layers >= 1, got k={k}, num_layers={num_layers}")
    if k == 1:
        return [num_layers // 2]
    if num_layers < 4:
        raise ValueError(f"a target with {num_layers} layers is too shallow for the default spread "
                         "from layer 1 to N-3; set target.layer_ids explicitly")
    span = num_layers - 4
    return [int(round(1 + i * span / (k - 1))) for i in range(k)]


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

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


REMOTE_CODE_HINT = ("set target.trust_remote_code: true in config.yaml if you trust the *.py "
                    "files in that folder (they run in this process), or point target.path at a "
                    "model transformers supports (docs/targets.md)")


def causal_lm_class(hf_config: dict):
    """The class transformers' AutoModelForCausalLM builds for a config.json of a model type it
    knows (a multimodal wrapper for some: Gemma 3), else None (unknown, or only remote code)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(hf_config.get("model_type")))
    return getattr(transformers, name, None) if name else None


def needs_remote_code(hf_config: dict) -> bool:
    """The folder's config.json maps the model to Python files of its own (``auto_map``) for a
    model transformers cannot build itself. A known model type with an auto_map (DeepSeek-V3's
    config.json has one) is built from transformers' own code and needs none."""
    auto_map = hf_config.get("auto_map")
    return bool(auto_map) and causal_lm_class(hf_config) is None


def remote_code_refusal(hf_config: dict, folder: Path) -> str:
    """The one line saying that the target needs its own code, and why."""
    import transformers

    names = sorted(hf_config.get("auto_map") or {})
    return (f"the target {folder} needs its own code: its config.json maps {', '.join(names)} "
            f"to Python files in the folder (auto_map), and transformers "
            f"{transformers.__version__} cannot build model type "
            f"{hf_config.get('model_type')!r} itself; target.trust_remote_code is off")


def _read_config_json(folder: Path) -> dict:
    try:
        data = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TargetLoadError(f"cannot read the target config {folder / CONFIG_NAME}: {exc}"
                              ) from exc
    if not isinstance(data, dict):
        raise TargetLoadError(f"{folder / CONFIG_NAME} holds no JSON object")
    return data


def load_target_config(folder: Path, trust_remote_code: bool = False):
    """The target's transformers config, refused in one line when it needs code it may not run
    (never the terminal prompt) or has no causal-LM class."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    raw = _read_config_json(folder)
    # Before transformers sees it: with trust_remote_code unset it would ask on the terminal.
    if needs_remote_code(raw) and not trust_remote_code:
        raise TargetLoadError(remote_code_refusal(raw, folder), hint=REMOTE_CODE_HINT)
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True,
                                            trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise TargetLoadError(
            f"cannot read the target config {folder / CONFIG_NAME}: {exc}") from exc
    # Checked before reading gigabytes of weights: the model type must have a causal-LM class.
    own = trust_remote_code and "AutoModelForCausalLM" in (raw.get("auto_map") or {})
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not own:
        raise TargetLoadError(
            f"target {folder}: model type {config.model_type!r} has no causal-LM class in "
            "transformers",
            hint="point target.path at a causal language model (docs/targets.md lists those "
                 "that are supported)")
    return config


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
        raise TargetLoadError(f"unknown dtype {dtype!r}", hint="set target.dtype to bfloat16, "
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
) -> "TargetModel":
    """Load a frozen causal LM from a local folder, reporting progress shard by shard.

    ``progress(**fields)``: called with the fields of a LoadProgress event (observe/events.py)
    but its worker and device: bytes_loaded, bytes_total, shards_loaded, shards_total, seconds
    (since this call), done, and memory_after (bytes on the device once loaded, 0 until done).

    ``trust_remote_code``: run the folder's own model code (target.trust_remote_code); off, a
    model that needs it is refused before anything is read. Raises TargetLoadError for a bad
    folder or config, LoadAborted when ``stop`` is set.
    """
    t0 = time.monotonic()  # before the import: the first one takes seconds and is part of loading
    from transformers import AutoModelForCausalLM

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise TargetLoadError(f"target folder {folder} does not exist")
    if not (folder / CONFIG_NAME).is_file():
        raise TargetLoadError(f"target folder {folder} has no {CONFIG_NAME}")
    files = _weight_files(folder)
    config = load_target_config(folder, trust_remote_code)
    dtype = _as_dtype(dtype)
    device = torch.device(device)

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

    direct = device.type != "cpu" and _can_load_onto_device()
    try:
        with HF_BUILD_LOCK:
            model, info = AutoModelForCausalLM.from_pretrained(
                folder, config=config, dtype=dtype, attn_implementation=attn_implementation,
                device_map={"": device} if direct else None, local_files_only=True,
                use_safetensors=True, output_loading_info=True,
                trust_remote_code=trust_remote_code)
    except (ValueError, ImportError) as exc:  # e.g. an attention implementation not installed
        raise TargetLoadError(
            f"transformers could not build the target from {folder}: {exc}",
            hint="check target.path and target.attn_implementation in config.yaml") from exc
    except Exception as exc:  # a truncated or garbled weights file (SafetensorError, ...)
        if type(exc).__name__ != "SafetensorError" and "safetensors" not in str(exc).lower():
            raise
        raise TargetLoadError(
            f"the target's weights in {folder} cannot be read: {type(exc).__name__}: {exc}",
            hint="a *.safetensors file is truncated or damaged: download the model again, or "
                 "set target.path to an intact copy") from exc
    # A weight missing from the checkpoint would be silently random: refuse it.
    if info.get("missing_keys"):
        raise TargetLoadError(
            f"target checkpoint {folder} lacks weights the model needs: "
            f"{sorted(info['missing_keys'])[:8]}", hint="the folder's weights do not match its "
            "config.json; " + _PATH_HINT)
    if stop is not None and stop.is_set():
        del model
        raise LoadAborted("target loading stopped")
    if device.type != "cpu" and not direct:
        model.to(device)

    target = TargetModel(model)
    report(loaded, len(files), done=True, memory=target.memory_bytes())
    return target


# --------------------------------------------------------------------------------------------
# The model and its features
# --------------------------------------------------------------------------------------------

class _StopForward(Exception):
    """Raised by the last chosen layer's hook so the layers after it never run."""


LAST_HIDDEN = -1  # key of the final norm's output among captured layer outputs
_LAYER_NAMES = ("layers", "h", "blocks")  # the decoder stack, by the names transformers uses
_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_norm")


def decoder_parts(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, nn.Module]:
    """(language model, its decoder layers, its final norm) of a causal LM, through the model's
    own ``get_decoder()``: the base model of a ``...ForCausalLM``, the text model inside a
    multimodal ``...ForConditionalGeneration``. ``.model`` and ``.model.language_model`` are
    tried after it for a model whose accessor says otherwise."""
    base = getattr(model, "model", None)
    try:
        own = model.get_decoder() if hasattr(model, "get_decoder") else None
    except (AttributeError, NotImplementedError, ValueError):  # a model without the rule
        own = None
    candidates = [own, base, getattr(base, "language_model", None)]
    for decoder in candidates:
        layers = next((getattr(decoder, n) for n in _LAYER_NAMES
                       if isinstance(getattr(decoder, n, None), nn.ModuleList)), None)
        norm = next((getattr(decoder, n) for n in _NORM_NAMES
                     if isinstance(getattr(decoder, n, None), nn.Module)), None)
        if layers is not None and norm is not None:
            return decoder, layers, norm
    found = type(candidates[0]).__name__ if candidates[0] is not None else "nothing"
    raise TargetLoadError(
        f"{type(model).__name__}: its decoder (get_decoder() gives {found}) has no stack of "
        f"layers ({' / '.join('.' + n for n in _LAYER_NAMES)}) with a final norm "
        f"({' / '.join('.' + n for n in _NORM_NAMES)}) to read features from",
        hint="point target.path at a decoder-only causal LM (docs/targets.md lists those that "
             "are supported)")


class TargetModel:
    """A frozen HF causal LM with the accessors the drafter and the evaluator need."""

    def __init__(self, model: nn.Module):
        model.requires_grad_(False)
        model.eval()
        self.model = model
        self.text_config = model.config.get_text_config()
        # The language model (embeddings -> decoder layers -> final norm), without the lm_head.
        self.decoder, self.layers, self.final_norm = decoder_parts(model)
        self.embed_tokens: nn.Embedding = model.get_input_embeddings()
        self.lm_head: nn.Linear = model.get_output_embeddings()
        if not isinstance(getattr(self.lm_head, "weight", None), torch.Tensor):
            # The drafter borrows it (DSpark also scores the target's distribution with it).
            raise TargetLoadError(
                f"{type(model).__name__} has no lm_head the engine can find "
                "(get_output_embeddings() gives "
                f"{type(self.lm_head).__name__ if self.lm_head is not None else 'None'})",
                hint="point target.path at a causal LM with its output head "
                     "(docs/targets.md lists those that are supported)")
        self.num_layers = len(self.layers)
        self.hidden_size = self.text_config.hidden_size
        self.vocab_size = self.text_config.vocab_size

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def memory_bytes(self) -> int:
        """Bytes allocated on the target's device (CUDA), else the bytes of its parameters."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def _layer_ids(self, layer_ids) -> list[int]:
        ids = list(layer_ids) if layer_ids is not None else default_layer_ids(self.num_layers)
        if not ids or any(not 0 <= i < self.num_layers for i in ids):
            raise ValueError(f"layer ids {ids} must be non-empty and within "
                             f"0..{self.num_layers - 1} (target.layer_ids in config.yaml)")
        return ids

    def _hooks(self, ids: list[int], outputs: dict, stop_after_last: bool,
               stop: threading.Event | None = None, last_hidden: bool = False) -> list:
        # Hooks live on the shared layer modules, so they fire in every thread's forward: the
        # evaluation (a drafter thread) runs this model while its target thread extracts
        # features. Each hook acts only in the thread that registered it, or the two would
        # capture each other's activations and cut each other's forwards short.
        owner = threading.get_ident()
        last = max(ids)
        handles = []
        if stop is not None:
            # A 27B forward of a 64K-token batch takes ~7 s: checked before every layer, an abort
            # or restart waits for one layer, not for the whole forward.
            def check(module, args):
                if stop.is_set() and threading.get_ident() == owner:
                    raise ForwardInterrupted
            handles = [layer.register_forward_pre_hook(check) for layer in self.layers]

        def make_hook(i: int):
            def hook(module, args, output):
                if threading.get_ident() != owner:
                    return
                outputs[i] = output[0] if isinstance(output, tuple) else output
                if stop_after_last and i == last:
                    raise _StopForward
            return hook

        handles += [self.layers[i].register_forward_hook(make_hook(i)) for i in sorted(set(ids))]
        if last_hidden:
            def norm_hook(module, args, output):
                if threading.get_ident() == owner:
                    outputs[LAST_HIDDEN] = output[0] if isinstance(output, tuple) else output
            handles.append(self.final_norm.register_forward_hook(norm_hook))
        return handles

    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 layer_ids: list[int] | None = None,
                 stop: threading.Event | None = None,
                 with_last_hidden: bool = False) -> torch.Tensor:
        """Outputs of ``layer_ids`` (default: ``default_layer_ids``), concatenated: [b, S, k*H].

        Layer i's output is HF's ``hidden_states[i+1]``; for the last layer that is after the
        final norm, as the reference and the serving stacks read it. Right padding with ``attention_mask``
        leaves the valid positions as they would be for each sequence alone. With ``stop``, raises
        ForwardInterrupted at the next layer once it is set.

        ``with_last_hidden`` (DSpark): the forward runs through every layer and the final norm,
        and the target's last hidden state after that norm (HF's ``last_hidden_state``, whose
        lm_head product is the logits) is appended as the last H channels: [b, S, (k+1)*H].
        Without it the forward stops after the last chosen layer. The lm_head is never run.
        """
        ids = self._layer_ids(layer_ids)
        with self._capture(ids, stop_after_last=not with_last_hidden, stop=stop,
                           last_hidden=with_last_hidden) as outputs:
            try:
                # The base model, not the CausalLM: the lm_head is never reached.
                self.decoder(**self._inputs(input_ids, attention_mask), use_cache=False)
            except _StopForward:
                pass
        if with_last_hidden and LAST_HIDDEN not in outputs:
            raise TargetLoadError(
                f"{type(self.model).__name__}: its final norm ({type(self.final_norm).__name__})"
                " did not run in the forward, so the post-norm last hidden state DSpark trains "
                "against cannot be read", hint="use drafter.objective: dflash with this target, "
                "or a target whose decoder ends with its final norm (docs/targets.md)")
        self._as_hidden_states(outputs)
        parts = [outputs[i] for i in ids] + ([outputs[LAST_HIDDEN]] if with_last_hidden else [])
        # Concatenated outside inference mode: the result is an ordinary tensor, which autograd
        # may save for backward in the drafter's fc (an inference tensor could not be).
        return torch.cat(parts, dim=-1)

    def _as_hidden_states(self, outputs: dict[int, torch.Tensor]) -> None:
        """HF's hidden_states[N] is the last layer's output after the final norm: a drafter
        trained on the raw output would see other features when served (the reference reads
        hidden_states[i+1])."""
        last = self.num_layers - 1
        if last in outputs:
            with torch.inference_mode():
                outputs[last] = self.final_norm(outputs[last])

    def logits_and_features(self, input_ids: torch.Tensor, layer_ids: list[int] | None = None,
                            attention_mask: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """One full forward for evaluation: the target's logits [b, S, V] and the features."""
        out, feats = self._whole_forward(layer_ids, **self._inputs(input_ids, attention_mask),
                                         use_cache=False)
        return out.logits, feats

    def decode_step(self, input_ids: torch.Tensor, layer_ids: list[int] | None, cache,
                    logits_to_keep: int = 0) -> tuple[torch.Tensor, torch.Tensor, object]:
        """A forward of new tokens after those in ``cache`` (None: the first, which makes it):
        the logits of the last ``logits_to_keep`` of them (0: all), the features of all of them,
        and the cache, which now holds them too (target_decoding.CachedDecoding drives this)."""
        name = self._cache_name()
        out, feats = self._whole_forward(layer_ids, input_ids=input_ids.to(self.device),
                                         use_cache=True, logits_to_keep=logits_to_keep,
                                         **{name: cache})
        return out.logits, feats, getattr(out, name)

    def _whole_forward(self, layer_ids: list[int] | None, **inputs):
        """The CausalLM's output for ``inputs`` (every layer and the lm_head), and the features
        of ``layer_ids``."""
        ids = self._layer_ids(layer_ids)
        with self._capture(ids, stop_after_last=False) as outputs:
            out = self.model(**inputs)
        self._as_hidden_states(outputs)
        return out, torch.cat([outputs[i] for i in ids], dim=-1)

    def _cache_name(self) -> str:
        """The forward's cache argument: ``cache`` from transformers 5.2x on (which warns at
        ``past_key_values``), ``past_key_values`` before."""
        if not hasattr(self, "_cache_arg"):
            params = inspect.signature(self.model.forward).parameters
            self._cache_arg = "cache" if "cache" in params else "past_key_values"
        return self._cache_arg

    def _inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> dict:
        mask = attention_mask.to(self.device) if attention_mask is not None else None
        return {"input_ids": input_ids.to(self.device), "attention_mask": mask}

    @contextlib.contextmanager
    def _capture(self, ids: list[int], stop_after_last: bool,
                 stop: threading.Event | None = None,
                 last_hidden: bool = False) -> Iterator[dict]:
        """Inference mode with the chosen layers hooked; yields {layer: output} (and, with
        ``last_hidden``, the final norm's output under LAST_HIDDEN)."""
        outputs: dict[int, torch.Tensor] = {}
        handles = self._hooks(ids, outputs, stop_after_last, stop, last_hidden)
        try:
            with torch.inference_mode():
                yield outputs
        finally:
            for h in handles:
                h.remove()
