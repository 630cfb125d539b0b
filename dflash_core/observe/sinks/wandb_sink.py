"""Weights & Biases, optional and never in the way.

wandb is imported only when enabled, uses its public API only, and runs in offline mode unless the
config says otherwise. ``validate_wandb_settings`` runs at preflight so a stale settings key fails
before any weights load (it happened: wandb >= 0.19 rejects the old private ``_stats_*`` keys).
The sink starts wandb in its own bus thread on the first event, so training never waits on it; any
wandb failure becomes one non-fatal Error event and the sink switches itself off.
"""

from __future__ import annotations

import difflib
import inspect
import os
import threading
from pathlib import Path
from typing import Any, Callable

from dflash_core.config import ConfigError, WandbConfig
from dflash_core.acceptance import (
    ACCEPTED, AGREEMENT, MEASURES, MISSING, accepted_at, calibration_wandb, serving_of,
    serving_wandb, set_wandb,
)
from dflash_core.context_buckets import context_wandb
from dflash_core.models.dspark.calibration import Calibration
from dflash_core.observe.device_hours import wandb_data
from dflash_core.observe.sinks.textlog import LOSS_TERMS
from dflash_core.observe.errors import error_from_exception
from dflash_core.observe.events import (
    DeviceHours, Error, EvalResult, Event, Log, RunEnded, SinkStatus, StepMetrics,
)

# Old private settings keys and their public replacements (None: removed, drop the key). Read off
# the installed wandb's sdk/wandb_settings.py; other "_name" keys map to "x_name" when that exists.
RENAMED_SETTINGS: dict[str, tuple[str | None, str]] = {
    "_stats_sample_rate_seconds": ("x_stats_sampling_interval", "seconds between system samples"),
    "_stats_samples_to_average": (None, "wandb no longer averages system samples"),
}

SOURCE = "sink:wandb"
# run.finish() waits this long at most (online with no network it retries for minutes); after
# FINISH_NOTICE_S the log says what it waits for.
FINISH_TIMEOUT_S = 30.0
FINISH_NOTICE_S = 2.0


def _import_wandb():
    try:
        import wandb
    except ImportError as exc:
        raise ConfigError("wandb.enabled", f"wandb is enabled but cannot be imported ({exc})",
                          hint="install wandb into the venv, or set wandb.enabled: false") from exc
    return wandb


def _replacement_hint(key: str, fields: list[str]) -> tuple[str, str]:
    """(message suffix, hint) for an unknown settings key."""
    path = f"wandb.settings.{key}"
    if key in RENAMED_SETTINGS:
        new, why = RENAMED_SETTINGS[key]
        if new is None:
            return f"; it was removed from wandb ({why})", f"delete '{path}' from config.yaml"
        if new in fields:
            return (f"; its public replacement is '{new}' ({why})",
                    f"rename '{path}' to 'wandb.settings.{new}' in config.yaml")
    if key.startswith("_") and f"x{key}" in fields:
        new = f"x{key}"
        return (f"; its public replacement is '{new}'",
                f"rename '{path}' to 'wandb.settings.{new}' in config.yaml")
    close = difflib.get_close_matches(key.lstrip("_"), fields, n=1)
    if close:
        return f"; did you mean '{close[0]}'?", f"rename or delete '{path}' in config.yaml"
    return "", f"delete '{path}' from config.yaml"


def _first_error(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)  # pydantic ValidationError
    if callable(errors):
        try:
            return errors()[0]["msg"]
        except Exception:
            pass
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def validate_wandb_settings(settings: dict, *, wandb_module: Any = None) -> None:
    """Check ``wandb.settings`` keys and values against the INSTALLED wandb; raise ConfigError."""
    wandb = wandb_module or _import_wandb()
    fields = sorted(wandb.Settings.model_fields)
    version = getattr(wandb, "__version__", "?")
    for key, value in settings.items():
        key = str(key)
        path = f"wandb.settings.{key}"
        if key.startswith("_") or key not in fields:
            suffix, hint = _replacement_hint(key, fields)
            kind = "private" if key.startswith("_") else "unknown"
            raise ConfigError(path, f"{kind} setting, not accepted by the installed wandb "
                                    f"{version}{suffix}", hint=hint)
        try:  # one key at a time, so a bad value is pinned to its key
            wandb.Settings(**{key: value})
        except Exception as exc:  # pydantic ValidationError, or wandb's UsageError from validators
            raise ConfigError(path, f"bad value {value!r}: {_first_error(exc)}",
                              hint=f"fix '{path}' in config.yaml") from exc
    try:  # then together, for checks that involve several keys
        wandb.Settings(**settings)
    except Exception as exc:
        raise ConfigError("wandb.settings", f"rejected by wandb {version}: {_first_error(exc)}",
                          hint="fix wandb.settings in config.yaml") from exc


def _require_credentials(wandb) -> None:
    """Online without credentials would prompt for a key (fatal under the TUI) or hang: fail now.
    ``login(prompt=False)`` exists in newer wandb only; older ones leave it to init."""
    if getattr(wandb, "run", None) is not None:
        return  # login() is a no-op while a run is active; init will reuse its credentials
    if "prompt" not in inspect.signature(wandb.login).parameters:
        return
    if not wandb.login(prompt=False, verify=False):
        raise RuntimeError("wandb.mode is online but no wandb credentials are configured "
                           "(WANDB_API_KEY, or `wandb login` once on this machine)")


def _finish_previous(wandb) -> str | bool:
    """reinit="finish_previous" where the installed wandb knows it; True meant the same before."""
    try:
        wandb.Settings(reinit="finish_previous")
        return "finish_previous"
    except Exception:
        return True


class WandbSink:
    """Bus subscriber that mirrors metrics to wandb. ``publish`` puts events back on the bus."""

    def __init__(self, cfg: WandbConfig, run_dir: str | os.PathLike, run_name: str,
                 config_dict: dict, publish: Callable[[Event], None], *,
                 wandb_module: Any = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_name = run_name
        self.config_dict = config_dict
        self.publish = publish
        self._wandb = wandb_module  # injected in tests; imported lazily otherwise
        self._run = None
        self._state = "new"  # new | active | disabled | failed | finished
        self._step = 0  # the highest step logged: wandb drops a lower one
        self._lock = threading.Lock()  # close() comes from the engine's thread

    @property
    def state(self) -> str:
        return self._state

    def __call__(self, ev: Event) -> None:
        if isinstance(ev, (SinkStatus, Error)):
            return  # nothing to log, and our own reports come back to us through the bus
        with self._lock:
            if self._state == "new":
                self._start()
            if self._state != "active":
                return
            try:
                self._handle(ev)
            except Exception as exc:
                self._fail(exc, "wandb stopped logging; the run goes on without it and "
                                "every metric is still in events.jsonl")

    def _start(self) -> None:
        if not self.cfg.enabled or self.cfg.mode == "disabled":
            self._state = "disabled"
            self.publish(SinkStatus(sink="wandb", status="disabled",
                                    detail="wandb.enabled is false" if not self.cfg.enabled
                                    else "wandb.mode is disabled"))
            return
        try:
            wandb = self._wandb = self._wandb or _import_wandb()
            if self.cfg.mode == "online":
                _require_credentials(wandb)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # console off: its stdout capture fights the full-screen TUI. The mode is passed
            # explicitly (never a silent online->offline fallback, which can hang ~90 s).
            # silent: wandb's own coloured banner lines would land in headless output and logs.
            settings = wandb.Settings(**{"console": "off", "silent": True, **self.cfg.settings})
            self._run = wandb.init(
                project=self.cfg.project, entity=self.cfg.entity or None, name=self.run_name,
                config=self.config_dict, dir=str(self.run_dir), mode=self.cfg.mode,
                reinit=_finish_previous(wandb),  # a restart in this process replaces the old run
                settings=settings,
            )
        except Exception as exc:
            fix = ("set wandb.mode: offline (sync later with `wandb sync`)"
                   if self.cfg.mode == "online" else "check wandb.* in config.yaml")
            self._fail(exc, f"wandb could not start in {self.cfg.mode} mode; the run goes on "
                            f"without it. To fix: {fix}, or set wandb.enabled: false")
            return
        self._state = "active"
        self.publish(SinkStatus(sink="wandb", status="ok", detail=self._where()))

    def _where(self) -> str:
        url = getattr(self._run, "url", None) if self.cfg.mode == "online" else None
        if url:
            return str(url)
        # run.dir is <run_dir>/wandb/offline-run-*/files; `wandb sync` takes the folder above.
        return str(Path(self._run.dir).parent)

    def _handle(self, ev: Event) -> None:
        if isinstance(ev, DeviceHours):  # taken between steps: logged with the latest
            self._run.log(wandb_data(ev), step=max(ev.step, self._step))
            return
        self._step = max(self._step, getattr(ev, "step", 0))
        if isinstance(ev, StepMetrics):
            self._run.log({
                "train/loss": ev.loss, "train/lr": ev.lr, "train/grad_norm": ev.grad_norm,
                "train/tau_tf": ev.tau_tf, "train/epoch": ev.epoch,
                "perf/tokens_per_s": ev.tokens_per_s, "perf/samples_per_s": ev.samples_per_s,
                "perf/drafter_wait_frac": ev.drafter_wait_frac,
                "perf/target_blocked_frac": ev.target_blocked_frac,
                "perf/padding_frac": ev.padding_frac,
                # DSpark's and DFlash2's loss terms (absent, -1, for DFlash)
                **{f"train/{k}": getattr(ev, k) for _, k in LOSS_TERMS
                   if getattr(ev, k, -1.0) >= 0},
            }, step=ev.step)
        elif isinstance(ev, EvalResult) and getattr(ev, "prompt_set", ""):
            self._run.log({**set_wandb(ev),  # a set of eval.prompt_sets, its keys under its name
                           **context_wandb(getattr(ev, "context", None),
                                           f"eval/{ev.prompt_set}/")}, step=ev.step)
        elif isinstance(ev, EvalResult):
            data = {"eval/prompts": ev.prompts}
            total = sum(ev.acceptance) or 1
            data.update({f"eval/accept_{k}": n / total for k, n in enumerate(ev.acceptance)})
            # the measures of acceptance under the keys acceptance.py names (a measure not taken
            # is left out, not logged as -1)
            for m in (*MEASURES, AGREEMENT):
                if getattr(ev, m.key, MISSING) >= 0:
                    data[m.wandb] = getattr(ev, m.key)
            data.update({f"{ACCEPTED.wandb}_{k}": r
                         for k, r in enumerate(accepted_at(ev.acceptance), start=1)})
            sc = serving_of(ev)  # serving's counts (an older event has none)
            if sc is not None:
                data.update(serving_wandb(sc))
            cal = Calibration.from_dict(getattr(ev, "calibration", None))
            if cal is not None:  # a confidence head's calibration (DSpark)
                data.update(calibration_wandb(cal))
            # tau and rounds per bucket of context length (the buckets with rounds)
            data.update(context_wandb(getattr(ev, "context", None)))
            self._run.log(data, step=ev.step)
        elif isinstance(ev, RunEnded):
            run, self._run = self._run, None
            self._state = "finished"
            run.summary["status"] = ev.status
            self._finish(run, exit_code=0 if ev.status == "finished" else 1)

    def _finish(self, run, **kwargs) -> bool:
        """run.finish() with a bound: online with no network it can wait minutes to upload, and
        the run is over. Says what it waits for; False when it gave up (wandb goes on in its
        thread; its files stay under the run folder for `wandb sync`)."""
        done, failed = threading.Event(), []

        def go():
            try:
                run.finish(**kwargs)
            except Exception as exc:  # reported below, in the sink's thread
                failed.append(exc)
            finally:
                done.set()
        threading.Thread(target=go, name="wandb-finish", daemon=True).start()
        if not done.wait(FINISH_NOTICE_S):
            what = "to upload to wandb" if self.cfg.mode == "online" else "to write its files"
            self.publish(Log(level="info", source=SOURCE, message=(
                f"waiting up to {FINISH_TIMEOUT_S:.0f} s for wandb {what}")))
            if not done.wait(FINISH_TIMEOUT_S - FINISH_NOTICE_S):
                self.publish(Log(level="warning", source=SOURCE, message=(
                    f"wandb did not finish within {FINISH_TIMEOUT_S:.0f} s; going on without it "
                    f"(its files are under {self.run_dir}; `wandb sync` uploads them later)")))
                return False
        if failed:
            self.publish(error_from_exception(
                failed[0], error_kind="wandb", source=SOURCE, fatal=False,
                hint="wandb could not finish; an offline run folder can still be synced"))
        return True

    def _fail(self, exc: Exception, hint: str) -> None:
        self._state = "failed"
        self._run = None  # not finished here: a broken wandb may hang; finish_previous cleans up
        self.publish(error_from_exception(exc, error_kind="wandb", source=SOURCE, hint=hint,
                                          fatal=False))
        self.publish(SinkStatus(sink="wandb", status="failed",
                                detail=f"{type(exc).__name__}: {exc}"))

    def close(self, timeout: float = 60.0) -> None:
        """Finish the wandb run if the bus never delivered RunEnded. Never raises."""
        if not self._lock.acquire(timeout=min(timeout, FINISH_TIMEOUT_S + 5)):
            return  # the sink thread is stuck inside wandb; do not hang shutdown with it
        try:
            if self._state == "active" and self._run is not None:
                run, self._run = self._run, None
                self._state = "finished"
                self._finish(run)
        finally:
            self._lock.release()
