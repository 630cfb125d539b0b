"""The drafters an evaluation compares: this engine's checkpoints (DFlash, DSpark or DFlash2) and
published drafters in the public DFlash, DSpark and DFlash2 folder formats.

A path may be a checkpoint folder (``<run>/checkpoints/step-N``), a run folder (its newest
checkpoint), or a model folder (``config.json`` + ``model.safetensors``). The kind is read from
``config.json``'s ``architectures``:

- ``DFlashDraftModel``: this engine writes ``block_size``, ``mask_token_id`` and
  ``target_layer_ids`` under ``dflash_config``; the public reference's released folders keep
  ``block_size`` (and may keep the others) at the top level. Both are read.
- ``Qwen3DSparkModel``: the served DSpark folder (models/dspark/format.py), its frozen embedding and
  lm_head copies left unread (the target's own are borrowed).
- ``DFlash2DraftModel``: the served DFlash2 folder (models/dflash2/format.py); decoded along its
  selector's walk. Its vocabulary must be the target's (it always is checked below).

Every family's folder is read as vLLM reads it (models/served_keys.py): a key that changes what
vLLM computes is honoured (``is_causal: true``: the block attends causally) or refused in one
line naming it (a sliding window, attention sinks, interleaved rotary pairs, ...), never
decoded another way than it is served.

Every drafter is checked against the target before anything is decoded: its hidden size and
vocabulary must be the target's, the target depth it was trained for (``num_target_layers``) the
target's, and its feature layers must exist in the target. A drafter for another target is
refused in one line naming the difference.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dflash_core.eval.drafter_fields import HINT, check_fields
from dflash_core.eval.errors import EvalInputError
from dflash_core.models.dflash.drafter import ARCHITECTURE as DFLASH_ARCHITECTURE
from dflash_core.models.dflash.drafter import DFlashDrafter
from dflash_core.models.dspark.drafter import ARCHITECTURE as DSPARK_ARCHITECTURE
from dflash_core.models.dflash2.drafter import ARCHITECTURE as DFLASH2_ARCHITECTURE
from dflash_core.models.dflash2.drafter import DFlash2Drafter
from dflash_core.models.dspark.drafter import DSparkDrafter
from dflash_core.models.served_keys import ServedKeyRefused
from dflash_core.models.target.shape import text_config
from dflash_core.observe.device_hours import Figure
from dflash_core.persist.hours_ledger import read_checkpoint_figure

_DFLASH_KEYS = ("block_size", "mask_token_id", "target_layer_ids")
SERVED_HINT = ("this engine decodes a drafter as vLLM serves it, and cannot compute that one: "
               "evaluate it with vLLM, or a drafter trained without it")
_FROZEN = ("embed_tokens.weight", "lm_head.weight")  # served copies of the target's own


@dataclass(frozen=True)
class TargetShape:
    """What a drafter must agree with: the target's width, vocabulary and depth."""

    hidden_size: int
    vocab_size: int
    num_layers: int

    @classmethod
    def of(cls, config) -> "TargetShape":
        tc = text_config(config)
        get = (tc.get if isinstance(tc, dict) else lambda k: getattr(tc, k, None))
        return cls(int(get("hidden_size")), int(get("vocab_size")),
                   int(get("num_hidden_layers")))


@dataclass
class DrafterSpec:
    """A drafter folder read and checked, its weights not loaded yet."""

    path: Path  # the folder holding config.json and model.safetensors
    given: str  # the path as the user gave it
    label: str  # its column in the tables
    objective: str  # "dflash" | "dspark" | "dflash2"
    config: object  # the drafter's Qwen3Config
    fingerprint: str  # what a results file is continued with
    run_folder: Path | None = None  # the run that wrote it, when it is a run's checkpoint
    hours: Figure | None = None  # the device time to it (a run's checkpoint that recorded it)

    @property
    def block_size(self) -> int:
        return int(self.config.dflash_config["block_size"])

    @property
    def target_layer_ids(self) -> list[int]:
        return [int(i) for i in self.config.dflash_config["target_layer_ids"]]


def resolve_folder(given: str) -> tuple[Path, Path | None]:
    """(model folder, run folder or None) of a --drafter path."""
    from dflash_core.checkpoint.folders import latest_checkpoint
    from dflash_core.checkpoint.layout import CHECKPOINTS

    path = Path(given).expanduser()
    if not path.exists():
        raise EvalInputError(f"--drafter {given}: no such folder",
                             hint="pass a checkpoint folder (RUN/checkpoints/step-N), a run "
                                  "folder, or a drafter model folder")
    if path.is_dir() and not (path / "config.json").is_file() and (path / CHECKPOINTS).is_dir():
        newest = latest_checkpoint(path)
        if newest is None:
            raise EvalInputError(f"--drafter {given}: the run has no complete checkpoint",
                                 hint="pass a checkpoint folder, or let the run save one")
        return newest, path
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise EvalInputError(f"--drafter {given}: not a drafter folder (config.json and "
                             "model.safetensors expected)",
                             hint="pass a checkpoint folder (RUN/checkpoints/step-N), a run "
                                  "folder, or a drafter model folder")
    run = path.parent.parent if path.parent.name == CHECKPOINTS else None
    return path, run


def _label(folder: Path, run: Path | None) -> str:
    return f"{run.name}/{folder.name}" if run is not None else folder.name


def _dflash_config(d: dict, where: str):
    """This engine's DFlash config.json, or the public reference's (keys at the top level)."""
    dc = d.get("dflash_config") or {}
    if not isinstance(dc, dict):
        raise EvalInputError(f"{where}: config.json's dflash_config is {dc!r}: an object "
                             "expected", hint=HINT)
    dc = dict(dc)
    for k in _DFLASH_KEYS:
        if k not in dc and k in d:
            dc[k] = d[k]
    missing = [k for k in _DFLASH_KEYS if k not in dc]
    if missing:
        raise EvalInputError(f"{where}: the DFlash config.json lacks {', '.join(missing)}",
                             hint="a DFlash drafter folder names its block size, mask token and "
                                  "target layers (dflash_config)")
    check_fields({**d, **dc}, "dflash", where)
    # the top-level keys moved into dflash_config (served_keys.read takes them from there too)
    rest = {k: v for k, v in d.items() if k not in _DFLASH_KEYS + ("auto_map",)}
    rest["dflash_config"] = dc
    try:
        return DFlashDrafter.config_from_dict(rest)
    except ServedKeyRefused as exc:
        raise EvalInputError(f"{where}: {exc}", hint=SERVED_HINT) from exc
    except (ValueError, TypeError) as exc:  # a field transformers' config refuses
        raise EvalInputError(f"{where}: config.json cannot be a drafter's config "
                             f"({type(exc).__name__}: {exc})", hint=HINT) from exc


def fingerprint(folder: Path, config_text: str | None = None) -> str:
    """The config's text (read from the folder unless given), and the weights by their recorded
    checksum (this engine's checkpoints) or their size and modification time: a changed drafter
    is not continued as the old one."""
    if config_text is None:
        config_text = (folder / "config.json").read_text(encoding="utf-8")
    from dflash_core.checkpoint.layout import CHECKSUMS

    h = hashlib.sha256(config_text.encode())
    sums = folder / CHECKSUMS
    try:
        weights = json.loads(sums.read_text())["files"]["model.safetensors"]
        h.update(json.dumps(weights, sort_keys=True).encode())
    except (OSError, ValueError, KeyError, TypeError):
        st = (folder / "model.safetensors").stat()
        h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]



def _config_of(cls, d: dict, where: str, not_family: type[Exception]):
    """A family's drafter config from a folder's config.json: the family's own refusal
    (``not_family``) or a field transformers' config refuses, each one EvalInputError line."""
    try:
        return cls.config_from_dict(d)
    except (not_family, ServedKeyRefused) as exc:
        raise EvalInputError(f"{where}: {exc}") from exc
    except (ValueError, TypeError) as exc:
        raise EvalInputError(f"{where}: config.json cannot be a drafter's config "
                             f"({type(exc).__name__}: {exc})", hint=HINT) from exc

def read_drafter(given: str) -> DrafterSpec:
    """The drafter folder's kind and config, its model.safetensors judged by its header (no
    weights read)."""
    folder, run = resolve_folder(given)
    where = f"--drafter {given}"
    try:
        text = (folder / "config.json").read_bytes().decode("utf-8")
    except OSError as exc:
        raise EvalInputError(f"{where}: cannot read {folder / 'config.json'} "
                             f"({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise EvalInputError(f"{where}: {folder / 'config.json'} is not UTF-8 text (byte "
                             f"{exc.start}): not a drafter's config.json", hint=HINT) from exc
    try:
        d = json.loads(text)
    except ValueError as exc:
        raise EvalInputError(f"{where}: config.json is not JSON ({exc})", hint=HINT) from exc
    if not isinstance(d, dict):
        raise EvalInputError(f"{where}: config.json holds a {type(d).__name__}, not a JSON "
                             "object", hint=HINT)
    arch = d.get("architectures") or []
    if arch == [DSPARK_ARCHITECTURE]:
        from dflash_core.models.dspark.format import NotDSpark

        check_fields(d, "dspark", where)
        cfg, objective = _config_of(DSparkDrafter, d, where, NotDSpark), "dspark"
    elif arch == [DFLASH2_ARCHITECTURE]:
        from dflash_core.models.dflash2.format import NotDFlash2

        dc = d.get("dflash_config")
        check_fields({**d, **(dc if isinstance(dc, dict) else {})}, "dflash2", where)
        cfg, objective = _config_of(DFlash2Drafter, d, where, NotDFlash2), "dflash2"
    elif arch == [DFLASH_ARCHITECTURE] or (not arch and "dflash_config" in d):
        cfg, objective = _dflash_config(d, where), "dflash"
    else:
        raise EvalInputError(f"{where}: config.json has architectures {arch}: none of "
                             f"{DFLASH_ARCHITECTURE}, {DSPARK_ARCHITECTURE}, "
                             f"{DFLASH2_ARCHITECTURE}",
                             hint="pass a DFlash, DSpark or DFlash2 drafter folder")
    try:
        from dflash_core.models.registry import drafter_class

        drafter_class(objective).check_folder_files(folder)
    except ServedKeyRefused as exc:
        raise EvalInputError(f"{where}: {exc}", hint=SERVED_HINT) from exc
    _check_weights(folder, objective, cfg, given)
    return DrafterSpec(folder, given, _label(folder, run), objective, cfg,
                       fingerprint(folder, text), run,
                       run_hours(folder, run) if run is not None else None)


_DAMAGED = "the file is damaged or incomplete: copy it again"


def _misfit(given: str, what: str) -> EvalInputError:
    return EvalInputError(f"--drafter {given}: model.safetensors does not fit its config.json "
                          f"({what})", hint="the folder's weights and config.json belong to "
                                            "different drafters")


def _check_names(objective: str, names, where: str) -> None:
    """The family's own rule on its tensor names (DFlash2: codebooks without '.weight')."""
    from dflash_core.models.registry import drafter_class

    try:
        drafter_class(objective).check_names(names)
    except ValueError as exc:
        raise EvalInputError(f"{where}: {exc}", hint="publish the drafter again from its "
                             "checkpoint (dflash-tui publish), or rename those tensors") from exc


def _check_weights(folder: Path, objective: str, config, given: str) -> None:
    """model.safetensors judged from its header alone, before the target loads and before any
    results file is written: as long as its header says, the family's tensor names, and each
    tensor the drafter's config.json needs there in its shape (what load_weights would find)."""
    from dflash_core.checkpoint.checksums import check_safetensors
    from dflash_core.models.registry import drafter_class

    where = f"--drafter {given}"
    try:
        header = check_safetensors(folder / "model.safetensors")
    except OSError as exc:
        raise EvalInputError(f"{where}: cannot read {folder / 'model.safetensors'} "
                             f"({exc.strerror or exc})") from exc
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise EvalInputError(f"{where}: model.safetensors cannot be read ({exc})",
                             hint=_DAMAGED) from exc
    _check_names(objective, header, where)
    with torch.device("meta"):  # the drafter's tensor shapes without allocating them
        want = {k: list(v.shape) for k, v in drafter_class(objective)(config).state_dict().items()}
    have = {k: list(v.get("shape") or []) if isinstance(v, dict) else None
            for k, v in header.items() if k not in _FROZEN}
    missing, unexpected = [k for k in want if k not in have], [k for k in have if k not in want]
    if missing or unexpected:
        raise _misfit(given, _keys_text(missing, unexpected))
    other = [k for k in want if have[k] != want[k]]
    if other:
        k = other[0]
        raise _misfit(given, f"{k} is {have[k]} there, {want[k]} by config.json"
                      + (f"; {len(other) - 1} more" if len(other) > 1 else ""))


def _keys_text(missing: list[str], unexpected: list[str]) -> str:
    what = [f"missing {', '.join(missing[:4])}"] if missing else []
    return "; ".join(what + ([f"unexpected {', '.join(unexpected[:4])}"] if unexpected else []))


def run_hours(folder: Path, run: Path) -> Figure | None:
    """The device time a run's checkpoint recorded (observe/device_hours.py); without a price
    recorded, the run folder's config.yaml's cost.gpu_hour_price (set after the fact) prices
    it. None: written before checkpoints recorded it."""
    fig = read_checkpoint_figure(folder)
    if fig is None or fig.price > 0:
        return fig
    import yaml

    try:
        cost = (yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8")) or {})["cost"]
        price, currency = float(cost.get("gpu_hour_price") or 0), str(cost.get("currency", ""))
    except (OSError, ValueError, TypeError, KeyError, AttributeError, yaml.YAMLError):
        return fig
    return replace(fig, price=price, currency=currency) if price > 0 else fig


def priced(spec: DrafterSpec, price: float, currency: str = "") -> DrafterSpec:
    """``spec`` with its device time at ``price`` per GPU-hour (0: as recorded)."""
    if price <= 0 or spec.hours is None:
        return spec
    return replace(spec, hours=replace(spec.hours, price=price,
                                       currency=currency or spec.hours.currency))


def check_against(spec: DrafterSpec, target: TargetShape) -> None:
    """Refuse a drafter trained for another target: one line naming what differs."""
    cfg = spec.config
    diffs = []
    if int(cfg.hidden_size) != target.hidden_size:
        diffs.append(f"hidden size {cfg.hidden_size} (the target's {target.hidden_size})")
    if int(cfg.vocab_size) != target.vocab_size:
        diffs.append(f"vocabulary {cfg.vocab_size} (the target's {target.vocab_size})")
    depth = int(getattr(cfg, "num_target_layers", 0) or 0)
    if depth and depth != target.num_layers:
        diffs.append(f"{depth} target layers (this one has {target.num_layers})")
    elif max(spec.target_layer_ids) >= target.num_layers and depth:
        # the depth it names is the target's: its feature layers cannot lie past it
        raise EvalInputError(f"--drafter {spec.given}: config.json's target_layer_ids "
                             f"{spec.target_layer_ids} name layers past its num_target_layers "
                             f"({depth}, the target's)", hint=HINT)
    elif max(spec.target_layer_ids) >= target.num_layers:
        diffs.append(f"feature layers {spec.target_layer_ids} (the target has "
                     f"{target.num_layers} layers)")
    if diffs:
        raise EvalInputError(f"--drafter {spec.given} was trained for another target: "
                             + "; ".join(diffs),
                             hint="pass the target it was trained for (--target), or a drafter "
                                  "of this target")
    mask = int(cfg.dflash_config["mask_token_id"])
    if not 0 <= mask < target.vocab_size:
        raise EvalInputError(f"--drafter {spec.given}: config.json's mask_token_id {mask} is "
                             f"outside the vocabulary of {target.vocab_size}", hint=HINT)


_READ = ("config.json", "model.safetensors")  # what an evaluation reads of a checkpoint


def check_intact(spec: DrafterSpec) -> None:
    """A checkpoint that records checksums.json (a run's) checked against it before it is
    evaluated: the files an evaluation reads, read whole (a flipped bit is found); refused in one
    line naming the file. A folder without checksums (a published drafter) is not."""
    from dflash_core.checkpoint.checksums import verify
    from dflash_core.checkpoint.layout import CHECKSUMS

    folder = spec.path
    if not (folder / CHECKSUMS).is_file():  # as drafter.init_from: what was recorded is checked
        return
    found = verify(folder, contents=_READ)
    bad = [p for p in found.problems if p.split(" ", 1)[0] in _READ + (CHECKSUMS,)]
    if bad:
        raise EvalInputError(f"--drafter {spec.given}: checkpoint {folder} is damaged: "
                             + "; ".join(bad),
                             hint="evaluate another checkpoint of the run (another step, or the "
                                  "run folder: its newest), or restore this one from a backup")


def load_weights(spec: DrafterSpec, target_model, device,
                 dtype: str = "float32") -> torch.nn.Module:
    """The drafter with its weights in ``dtype`` (drafter_dtype.py: the runner passes the served
    one) on ``device``, the target's embedding and lm_head attached, in eval mode."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from dflash_core.models.registry import drafter_class

    drafter = drafter_class(spec.objective)(spec.config)
    try:
        state = load_file(str(spec.path / "model.safetensors"), device="cpu")
    except (SafetensorError, OSError) as exc:
        raise EvalInputError(f"--drafter {spec.given}: model.safetensors cannot be read "
                             f"({type(exc).__name__}: {exc})", hint=_DAMAGED) from exc
    # read_drafter judged the header; the file may have changed since
    _check_names(spec.objective, state, f"--drafter {spec.given}")
    for k in _FROZEN:
        state.pop(k, None)
    try:
        result = drafter.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a tensor of another shape than config.json says
        raise _misfit(spec.given, str(exc).splitlines()[-1].strip()) from exc
    if result.missing_keys or result.unexpected_keys:
        raise _misfit(spec.given, _keys_text(result.missing_keys, result.unexpected_keys))
    from dflash_core.eval.drafter_dtype import cast_parameters

    drafter = cast_parameters(drafter, dtype).to(device).eval()
    drafter.attach_target_head(target_model.embed_tokens, target_model.lm_head)
    return drafter


def unique_labels(specs: list[DrafterSpec]) -> None:
    """Give two drafters of the same name distinct columns (``name``, ``name#2``)."""
    seen: dict[str, int] = {}
    for s in specs:
        n = seen.get(s.label, 0) + 1
        seen[s.label] = n
        if n > 1:
            s.label = f"{s.label}#{n}"


def file_name(label: str) -> str:
    """A results file's name for a drafter's label."""
    return "drafter-" + re.sub(r"[^A-Za-z0-9._-]+", "_", label) + ".jsonl"


def distinct_files(specs: list[DrafterSpec]) -> None:
    """Refuse two drafters whose labels give one results file (they differ only in characters a
    file name does not keep, or in case, which a case-blind disk does not tell apart)."""
    seen: dict[str, DrafterSpec] = {}
    for s in specs:
        key = file_name(s.label).casefold()
        if key in seen:
            a = seen[key]
            raise EvalInputError(
                f"--drafter {a.given} and --drafter {s.given} would share one results file "
                f"({file_name(s.label)}): their labels {a.label!r} and {s.label!r} differ only "
                "in characters a file name does not keep (or in case)",
                hint=f"label one apart: pass it through a link of another name (ln -s "
                     f"{s.path} OTHER-NAME; --drafter OTHER-NAME)")
        seen[key] = s
