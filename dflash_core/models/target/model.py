"""The frozen target's model: the features the drafter needs, and the forwards evaluation runs.

``TargetModel.features`` returns the outputs of the chosen decoder layers only. It never computes
lm_head logits, never keeps the full tuple of hidden states, and stops the forward right after the
last chosen layer (docs/architecture.md, Memory plan): for a 248k vocab the logits alone were
~30 GiB per batch.

The decoder stack and its final norm are found through the model's own accessor
(``get_decoder()``), so a mixture of experts, a DeepSeek-style model or the language model inside a
multimodal wrapper (Gemma 3's ``...ForConditionalGeneration``) are read the same way.

Loading it from a folder is target/load.py; the checks of its config.json, target/config.py.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Iterator

import torch
from torch import nn

from dflash_core.models.target.config import TargetLoadError, default_layer_ids


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


class ForwardInterrupted(Exception):
    """The stop event was set during a forward; the remaining layers were skipped."""


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
        hint=lambda w: f"{w.point} a decoder-only causal LM (docs/targets.md lists those that "
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
                hint=lambda w: f"{w.point} a causal LM with its output head "
                               "(docs/targets.md lists those that are supported)")
        self.num_layers = len(self.layers)
        self.hidden_size = self.text_config.hidden_size
        self.vocab_size = self.text_config.vocab_size
        # How a quantized checkpoint's weights are held (load.py's fp8.QuantizedNote); None for
        # weights in a plain dtype
        self.quantized = None
        # FSDP2 (a target group's sharded mode) cannot run under inference mode ("Inference
        # tensors do not track version counter"); its forwards use no_grad instead.
        self.inference_mode_ok = True

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
        # a rank of a target group holds its local share of each split (DTensor) parameter
        return sum(_local(p).numel() * p.element_size() for p in self.model.parameters())

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
        final norm, as the reference reads it (vLLM and SGLang capture it before the norm, hence
        preflight's warning and no default naming it). Right padding with ``attention_mask``
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
                "against cannot be read", hint=lambda w: f"{w.dflash}, or a target whose decoder "
                "ends with its final norm (docs/targets.md)")
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
            with self._no_autograd():
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

    def _no_autograd(self):
        return torch.inference_mode() if self.inference_mode_ok else torch.no_grad()

    @contextlib.contextmanager
    def _capture(self, ids: list[int], stop_after_last: bool,
                 stop: threading.Event | None = None,
                 last_hidden: bool = False) -> Iterator[dict]:
        """Inference mode with the chosen layers hooked; yields {layer: output} (and, with
        ``last_hidden``, the final norm's output under LAST_HIDDEN)."""
        outputs: dict[int, torch.Tensor] = {}
        handles = self._hooks(ids, outputs, stop_after_last, stop, last_hidden)
        try:
            with self._no_autograd():
                yield outputs
        finally:
            for h in handles:
                h.remove()
