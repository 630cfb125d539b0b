"""Writing a checkpoint atomically, and loading one.

A checkpoint folder's files: layout.py. The folder is assembled by ``begin_save`` (hidden
folder, the small files), the writers (``write_plans``: here, or in writer processes,
async_writer.py and writer_loop.py; each returns its files' checksums) and ``finish_save``
(checksums.json, fsync, rename, prune). Everything is written to a hidden
``.tmp-step-<N>-<pid>`` folder, fsynced, then renamed into place, so a crash at any moment leaves
only complete ``step-*`` folders (the folders themselves: folders.py). ``load_checkpoint``
verifies a folder first (checksums.py).
"""

from __future__ import annotations

import errno as errno_mod
import json
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors import torch as st

from dflash_core.checkpoint import safetensors_io, state_tree
from dflash_core.checkpoint.folders import clean_hidden, prune, remove_folder, set_aside
# Still read from here by eval/drafters.py and bench/training/recipe.py; the rest import it
# from folders.py.
from dflash_core.checkpoint.folders import latest_checkpoint  # noqa: F401
from dflash_core.checkpoint.layout import (
    CHECKPOINTS, CHECKSUMS, FORMAT_VERSION, LEGACY_STATE, MASTER, SERVED, STATE_DIR, STATE_PATH,
    CheckpointError, state_json,
)
from dflash_core.checkpoint.checksums import (
    check_safetensors, file_sum, verify, write_checksums, write_json,
)

try:
    import numpy as np
except ImportError:  # numpy is optional for the engine; its RNG is then simply not captured
    np = None


@dataclass
class LoadedCheckpoint:
    step: int
    drafter_state: dict[str, torch.Tensor]
    drafter_config: dict
    optimizer_state: dict
    scheduler_state: dict
    trainer_state: dict
    path: Path | None = None
    format: int = FORMAT_VERSION
    note: str = ""  # what could not be checked (a folder written before checksums); "" verified


# --------------------------------------------------------------------------------------------
# RNG state as plain tensors and primitives, so it survives torch.load(weights_only=True)
# --------------------------------------------------------------------------------------------

def capture_rng_state() -> dict:
    """Python, numpy (legacy global) and torch CPU/CUDA generator states."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                   "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)),
                          "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    torch.set_rng_state(state["torch"].cpu())
    if np is not None and "numpy" in state:
        s = state["numpy"]
        np.random.set_state((s["name"], s["keys"].numpy().astype(np.uint32), s["pos"],
                             s["has_gauss"], s["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        # A resume on fewer GPUs restores the ones that exist.
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.cpu(), i)


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------

def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # works for files and, on POSIX, directories
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _io_error(exc: BaseException, root: Path) -> CheckpointError | None:
    """Map an I/O failure (OSError, or safetensors' own error wrapping one) to CheckpointError."""
    code = getattr(exc, "errno", None) if isinstance(exc, OSError) else None
    if not isinstance(exc, OSError):
        # safetensors reports I/O as SafetensorError("... I/O error: ... (os error 28) ...").
        m = re.search(r"os error (\d+)", str(exc))
        if not (m or "I/O error" in str(exc)):
            return None
        code = int(m.group(1)) if m else None
    if code in (errno_mod.ENOSPC, errno_mod.EDQUOT):
        hint = f"free disk space in {root}, or set run.output_dir to a disk with room"
    elif code in (errno_mod.EACCES, errno_mod.EPERM, errno_mod.EROFS):
        hint = f"make {root} writable, or set run.output_dir to a writable folder"
    else:
        hint = f"check the disk holding {root} (free space, permissions), or change run.output_dir"
    return CheckpointError(f"checkpoint write failed in {root}: {exc}", hint=hint, errno=code)


@dataclass
class FilePlan:
    """One safetensors file of a checkpoint: its path relative to the step folder (a shard's is
    in STATE_DIR) and its (name in the file, name of the source tensor, dtype to store or None
    to keep it) in file order."""

    name: str
    entries: list[tuple[str, str, torch.dtype | None]]


def shard_name(k: int, n: int) -> str:
    return f"training_state-{k + 1:05d}-of-{n:05d}.safetensors"


def plan_files(tensors: dict[str, torch.Tensor], drafter_keys: list[str],
               served_dtype: torch.dtype | None, writers: int,
               served_keys: list[str] = ()) -> list[list[FilePlan]]:
    """Split a checkpoint's tensors over ``writers``: writer 0 writes model.safetensors (the
    master weights, then the ``served/<key>`` tensors of ``served_keys``, cast to
    ``served_dtype``) and every writer one shard of the training state, the largest tensors
    first to the writer with the fewest bytes so far, so all finish together. ``tensors`` maps
    source names (``master/<key>``, ``optimizer/...``, ``served/<key>``) to tensors (or anything
    with numel, shape and dtype). Returns each writer's files."""
    def nbytes(t, dtype=None):
        return t.numel() * (dtype or t.dtype).itemsize
    sources = [(k, f"{MASTER}/{k}") for k in drafter_keys] + [(k, f"{SERVED}/{k}")
                                                              for k in served_keys]
    model = [(k, src, served_dtype if tensors[src].dtype.is_floating_point else None)
             for k, src in sources]
    load = [0] * writers
    load[0] = sum(nbytes(tensors[src], dt) for _, src, dt in model)
    shards: list[list[str]] = [[] for _ in range(writers)]
    served_only = {f"{SERVED}/{k}" for k in served_keys}
    for name in sorted((n for n in tensors if n not in served_only),
                       key=lambda n: -nbytes(tensors[n])):
        w = min(range(writers), key=lambda i: load[i])
        shards[w].append(name)
        load[w] += nbytes(tensors[name])
    plans = [[FilePlan(f"{STATE_DIR}/{shard_name(w, writers)}",
                       [(n, n, None) for n in sorted(shards[w])])]
             for w in range(writers)]
    plans[0].insert(0, FilePlan("model.safetensors", model))
    return plans


@dataclass
class SaveJob:
    """What one checkpoint writes: the small files (written by begin_save) and each writer's
    safetensors files, whose tensors are named in ``tensors``."""

    step: int
    drafter_config: dict
    state: dict  # training_state.json
    tensors: dict[str, torch.Tensor]
    plans: list[list[FilePlan]]
    sums: dict[str, dict] = field(default_factory=dict)  # of the files written so far (file_sum)
    # Tensors that never change in a run (the served-only frozen copies): staged once.
    static: frozenset = frozenset()

    @property
    def bytes_total(self) -> int:
        return sum(_plan_bytes(f, self.tensors) for files in self.plans for f in files)


def _plan_bytes(f: FilePlan, tensors) -> int:
    return sum(tensors[src].numel() * (dt or tensors[src].dtype).itemsize
               for _, src, dt in f.entries)


def make_job(step: int, *, drafter_state: dict[str, torch.Tensor], drafter_config: dict,
             optimizer_state: dict, scheduler_state: dict, trainer_state: dict,
             served_dtype: torch.dtype | None = None, writers: int = 1,
             served_extra: dict[str, torch.Tensor] | None = None) -> SaveJob:
    """Take a checkpoint's state apart into JSON and named tensors (references, not copies).
    ``served_extra``: tensors written into model.safetensors only (cast to ``served_dtype``),
    never into the training state: DSpark's frozen copies (models/dspark/format.frozen_tensors).
    Raises TypeError, before anything is written, on state a checkpoint cannot hold."""
    tensors: dict[str, torch.Tensor] = {}
    served_extra = served_extra or {}
    for k, v in drafter_state.items():
        if not torch.is_tensor(v):
            raise TypeError(f"drafter_state[{k!r}]: {type(v).__name__} is not a tensor")
        tensors[f"{MASTER}/{k}"] = v.detach()
    for k, v in served_extra.items():
        if k in drafter_state:
            raise TypeError(f"served_extra[{k!r}] is also a trained weight")
        if not torch.is_tensor(v):
            raise TypeError(f"served_extra[{k!r}]: {type(v).__name__} is not a tensor")
        tensors[f"{SERVED}/{k}"] = v.detach()
    state = {"format": FORMAT_VERSION, "step": int(step),
             "served_dtype": str(served_dtype).removeprefix("torch.") if served_dtype else "",
             "optimizer": state_tree.flatten(optimizer_state, "optimizer", tensors),
             "scheduler": state_tree.flatten(scheduler_state, "scheduler", tensors),
             "trainer": state_tree.flatten(trainer_state, "trainer", tensors)}
    for name, t in tensors.items():
        if t.dtype not in safetensors_io.DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} cannot be stored in safetensors here")
    plans = plan_files(tensors, list(drafter_state), served_dtype, writers, list(served_extra))
    # Named relative to training_state.json's own folder (STATE_DIR).
    state["shards"] = [Path(f.name).name for files in plans for f in files
                       if f.name != "model.safetensors"]
    return SaveJob(int(step), drafter_config, state, tensors, plans,
                   static=frozenset(f"{SERVED}/{k}" for k in served_extra))


def tmp_folder(run_dir: str | os.PathLike, step: int) -> Path:
    """Where step ``step`` is assembled; named after this process, which renames it."""
    return Path(run_dir) / CHECKPOINTS / f".tmp-step-{step}-{os.getpid()}"


def _fail(exc: BaseException, root: Path, tmp: Path | None):
    if tmp is not None:
        remove_folder(tmp)
    if isinstance(exc, CheckpointError):
        raise exc
    err = _io_error(exc, root) if isinstance(exc, Exception) else None
    if err is not None:
        raise err from exc
    raise exc


def begin_save(run_dir: str | os.PathLike, job: SaveJob) -> Path:
    """Make the hidden folder of ``job`` with its small files (config.json, and
    training_state.json in its subfolder STATE_DIR, where the shards go too; their checksums kept
    in ``job.sums`` by relative path); returns it. Raises CheckpointError when the disk
    refuses (nothing left behind)."""
    root = Path(run_dir) / CHECKPOINTS
    tmp = tmp_folder(run_dir, job.step)
    try:
        root.mkdir(parents=True, exist_ok=True)
        clean_hidden(root)
        remove_folder(tmp)
        tmp.mkdir()
        (tmp / STATE_DIR).mkdir()
        for name, obj in (("config.json", job.drafter_config), (STATE_PATH, job.state)):
            job.sums[name] = file_sum(*write_json(tmp / name, obj, 1 if name == STATE_PATH
                                                  else 2))
    except BaseException as exc:
        _fail(exc, root, tmp)
    return tmp


def write_plans(folder: Path, files: list[FilePlan], tensors: dict[str, torch.Tensor],
                progress: Callable[[int], None] | None = None,
                cancelled: Callable[[], bool] | None = None) -> tuple[int, dict[str, dict]]:
    """One writer's files into ``folder`` (each fsynced); returns the data bytes written and
    each file's checksum entry (file_sum), computed as it was written. Errors are raised as they
    come (the caller maps them: CheckpointError or a writer's report)."""
    done, sums = 0, {}
    for f in files:
        entries = [(name, tensors[src], dt) for name, src, dt in f.entries]
        out = safetensors_io.write_file(folder / f.name, entries, progress, cancelled)
        done += out.data_bytes
        sums[f.name] = file_sum(out.size, out.crc32)
    return done, sums


def finish_save(run_dir: str | os.PathLike, step: int, tmp: Path, keep: int,
                sums: dict[str, dict], note: Callable[[str], None] | None = None) -> Path:
    """Write checksums.json (``sums``: every file's entry), make the hidden folder step-<step>
    (fsync, rename) and prune to ``keep``. A step-<step> already there is replaced when it is
    intact; a damaged or incomplete one is set aside first (kept), and ``note`` told so."""
    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step-{step}"
    try:
        write_checksums(tmp, sums)
        _fsync_path(tmp)
        aside = None
        if final.exists():
            wrong = verify(final, read=False).problems  # sizes only: no second read of GBs
            if wrong:
                moved = set_aside(final)
                if note is not None:
                    note(f"checkpoint {final} is damaged ({'; '.join(wrong)}): moved it to "
                         f"{moved} (kept, not deleted) before writing step {step} again")
            else:
                # A directory cannot be renamed over a non-empty one: move the old aside first
                # (readers still find it as step N until the new one is in place).
                aside = root / f".old-step-{step}-{os.getpid()}"
                os.rename(final, aside)
        os.rename(tmp, final)
        _fsync_path(root)
        if aside is not None:
            remove_folder(aside)
    except BaseException as exc:
        _fail(exc, root, tmp)
    try:
        left = prune(root, keep, protect=final)
    except OSError as exc:  # the new checkpoint is safe; pruning is retried by the next save
        left = [f"{root} ({exc.strerror or exc})"]
    if left and note is not None:
        note(f"checkpoint.keep {keep}: could not delete {'; '.join(left)}: it stays in "
             f"{root} under its name and its space is not freed; the new checkpoint step-{step} "
             "is written. Make it writable and the next checkpoint deletes it, or remove it by "
             "hand")
    return final


def abandon_save(tmp: Path) -> None:
    """A save that failed or whose writer died: its hidden folder goes, the previous stands."""
    remove_folder(tmp)


def save_checkpoint(
    run_dir: str | os.PathLike, step: int, *, drafter_state: dict[str, torch.Tensor],
    drafter_config: dict, optimizer_state: dict, scheduler_state: dict, trainer_state: dict,
    keep: int, served_dtype: torch.dtype | None = None, note: Callable[[str], None] | None = None,
    served_extra: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``run_dir/checkpoints/step-<step>/`` atomically, in this thread, and prune to the
    newest ``keep``. ``served_dtype``: the dtype of model.safetensors (None: as given).
    ``note``: told when a damaged step-<step> already there is set aside. ``served_extra``:
    tensors for model.safetensors only (make_job).

    Raises CheckpointError (an OSError, error_kind "io", with a hint) when the disk refuses; no
    partial folder is left either way. Put ``capture_rng_state()`` into ``trainer_state`` to make
    a resume reproducible. The training loop writes in the background instead (async_writer.py).
    """
    job = make_job(step, drafter_state={k: v.detach().cpu() for k, v in drafter_state.items()},
                   drafter_config=drafter_config, optimizer_state=optimizer_state,
                   scheduler_state=scheduler_state, trainer_state=trainer_state,
                   served_dtype=served_dtype, served_extra=served_extra)
    tensors = {k: v.cpu() for k, v in job.tensors.items()}
    tmp = begin_save(run_dir, job)
    try:
        for files in job.plans:
            job.sums.update(write_plans(tmp, files, tensors)[1])
    except BaseException as exc:
        _fail(exc, Path(run_dir) / CHECKPOINTS, tmp)
    return finish_save(run_dir, step, tmp, keep, job.sums, note)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The files of a checkpoint folder of format 2 to 4 (for sizes and progress)."""
    path = Path(path)
    sj = state_json(path)
    state = json.loads(sj.read_text(encoding="utf-8"))
    extra = (CHECKSUMS,) if (path / CHECKSUMS).is_file() else ()
    return [path / "config.json", path / "model.safetensors", sj,
            *(sj.parent / n for n in state["shards"]), *(path / n for n in extra)]


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu",
                    progress: Callable[[int, int, int, int], None] | None = None
                    ) -> LoadedCheckpoint:
    """Verify a checkpoint folder (``verify``: every file against checksums.json, read whole),
    then read it without pickle (safetensors, JSON; format 1's training_state.pt with
    weights_only=True). The drafter state is the float32 master weights where the folder holds
    them. Raises CheckpointError naming every file that is missing, truncated or changed.
    ``progress(bytes_read, bytes_total, files_read, files_total)`` is called as the files are
    verified (then they are read again from the page cache), or, in a folder without checksums,
    as the training-state shards are read."""
    path = Path(path)
    checked = verify(path, progress=progress)
    if checked.problems:
        missing = checked.kind == "incomplete"
        raise CheckpointError(
            f"checkpoint {path} is {checked.kind}: {'; '.join(checked.problems)}",
            hint="resume from an older checkpoint (a resume sets this one aside and falls back "
                 "to the newest intact one), or restore this one from a backup",
            errno=errno_mod.ENOENT if missing else errno_mod.EIO)
    if checked.format >= 3:
        progress = None  # verify read every byte and said so
    legacy = checked.format == 1
    device = str(map_location)
    name = "config.json"
    try:  # a truncated or garbled file is the checkpoint's fault: name it, not "a bug"
        with open(path / name, encoding="utf-8") as f:
            drafter_config = json.load(f)
        name = "model.safetensors"
        check_safetensors(path / name)
        if legacy:
            drafter_state = st.load_file(str(path / name), device=device)
            name = LEGACY_STATE
            state = torch.load(path / name, map_location=map_location, weights_only=True)
            name = f"{LEGACY_STATE} (its entries)"
            state = {k: state[k] for k in ("step", "optimizer", "scheduler", "trainer")}
        else:
            sj = state_json(path)
            name = sj.relative_to(path).as_posix()
            with open(sj, encoding="utf-8") as f:
                skeleton = json.load(f)
            shards = [sj.parent / n for n in skeleton["shards"]]
            sizes = [p.stat().st_size for p in shards]
            total = sum(sizes)
            tensors: dict[str, torch.Tensor] = {}
            read = 0
            for i, (shard, size) in enumerate(zip(shards, sizes)):
                name = shard.relative_to(path).as_posix()
                check_safetensors(shard)
                in_shard = 0
                with safe_open(str(shard), framework="pt", device=device) as f:
                    for key in f.keys():
                        t = tensors[key] = f.get_tensor(key)
                        in_shard += t.numel() * t.element_size()  # its header is not counted
                        if progress is not None:
                            progress(read + min(in_shard, size), total, i, len(shards))
                read += size  # so the last report is total of total
                if progress is not None:
                    progress(read, total, i + 1, len(shards))
            name = f"{sj.relative_to(path).as_posix()} (its entries)"
            prefix = f"{MASTER}/"
            drafter_state = {k[len(prefix):]: v for k, v in tensors.items()
                             if k.startswith(prefix)}
            if not drafter_state:  # no master copy: the served weights are the state
                drafter_state = st.load_file(str(path / "model.safetensors"), device=device)
            state = {k: state_tree.unflatten(skeleton[k], tensors)
                     for k in ("step", "optimizer", "scheduler", "trainer")}
    except Exception as exc:  # SafetensorError, JSONDecodeError, UnpicklingError, KeyError, ...
        raise CheckpointError(
            f"checkpoint {path} is damaged: {name} cannot be read ({type(exc).__name__}: {exc})",
            hint="resume from an older checkpoint (a resume falls back to the newest intact "
                 "one), or restore this one from a backup", errno=errno_mod.EIO) from exc
    return LoadedCheckpoint(
        step=int(state["step"]), drafter_state=drafter_state, drafter_config=drafter_config,
        optimizer_state=state["optimizer"], scheduler_state=state["scheduler"],
        trainer_state=state["trainer"], path=path, format=checked.format, note=checked.note,
    )
