"""The chain's stages in order, each cached under the one folder (``--dir``); a stage finds the
ones before it there, or says which to run first."""

from __future__ import annotations

import time
from pathlib import Path

from bench.lab.errors import LabError
from bench.lab.scales import Scale


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def _built_target(root: Path) -> dict:
    from bench.lab.target import META_NAME, read_record

    if not (root / "target" / META_NAME).is_file():
        raise LabError(f"{root / 'target'} holds no built target",
                       hint="run --stage target first (same --dir and --scale)")
    return read_record(root / "target")


def _built_data(root: Path) -> None:
    from bench.lab.data_stage import META_NAME

    if not (root / "data" / META_NAME).is_file():
        raise LabError(f"{root / 'data'} holds no finished data stage",
                       hint="run --stage data first (same --dir and --scale)")


def run_stages(root: Path, scale: Scale, stages: tuple[str, ...], *, device: str, seed: int,
               stop_after_min: float = 0.0) -> bool:
    """Run ``stages``; False when the train stage stopped early (``stop_after_min``)."""
    from bench.lab.target import resolve_device

    device = resolve_device(device)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    corpus = None
    record = None
    if "target" in stages or "data" in stages:
        from bench.lab.corpus import collect_for

        corpus = collect_for(scale)
        s = corpus.summary()
        _log(f"corpus {s['digest']}: {s['files']} files, {s['chars']} characters"
             + (f"; not installed: {', '.join(s['missing'])}" if s["missing"] else ""))
    if "target" in stages:
        from bench.lab.target import ensure_target

        _, record = ensure_target(root, scale, corpus, seed, device, _log)
    if "data" in stages:
        from bench.lab.data_stage import ensure_data
        from bench.lab.target import target_key

        record = _built_target(root)
        if record.get("key") != target_key(scale, corpus.digest, seed):
            raise LabError(f"{root / 'target'} was built under other settings than this "
                           "command's (scale, seed or the installed packages)",
                           hint="run --stage target with the same --scale and --seed")
        ensure_data(root, scale, corpus, root / "target", record["key"], seed, device, _log)
    if "train" in stages:
        from bench.lab.recipe import ensure_train

        _built_target(root)
        _built_data(root)
        left = stop_after_min * 60 - (time.monotonic() - t0) if stop_after_min > 0 else 0.0
        if stop_after_min > 0 and left <= 0:
            return False
        if not ensure_train(root, scale, device, left, _log):
            return False
    if "eval" in stages:
        from bench.lab.evaluation import ensure_eval

        record = _built_target(root)
        _built_data(root)
        ensure_eval(root, scale, device, record, _log)
    _log(f"stages {', '.join(stages)} done in {time.monotonic() - t0:.0f} s")
    return True
