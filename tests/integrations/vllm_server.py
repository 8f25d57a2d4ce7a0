"""A real `vllm serve` process for the tests (the `vllm` command of .venv-vllm, made by
scripts/setup_vllm.sh), with the kvtier connector, on a free loopback port, and the OpenAI
requests the tests send it.

The server runs in a process group of its own (API server, engine core, worker, resource
tracker): `stop` ends the whole group by its id and checks that nothing of it is left.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from vllm_engines import VLLM_PYTHON

VLLM_CLI = VLLM_PYTHON.parent / "vllm"
START_TIMEOUT = 300.0  # seconds: three processes import vLLM and torch (20-50 s on 2 busy cores)
STOP_TIMEOUT = 30.0
REQUEST_TIMEOUT = 120.0
_METRIC = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? (?P<value>\S+)$")


def free_port() -> int:
    """A loopback TCP port nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kv_transfer_config(target: str, namespace: str) -> dict:
    """The --kv-transfer-config of docs/integrations.md ("Configure"), for a daemon at `target`,
    with the planner off: the tiny test model prefills a block in about a millisecond, so the
    planner may rightly choose to recompute what kvtier holds, and a test could not tell a
    load that should have happened from one that was declined."""
    return {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier_client.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"target": target, "namespace": namespace, "planner": False},
    }


@dataclass
class Completion:
    """One answer: the generated text, its tokens' logprobs, and what the connector did."""

    text: str
    logprobs: list[float]
    prompt_tokens: int
    cached_tokens: int  # of the prompt, from vLLM's own prefix cache and the connector together
    kvtier: dict  # kv_transfer_params["kvtier"]: loaded_tokens, cached_blocks, stored_blocks, plan, ...
    seconds: float  # request to full answer, as the client saw it


class VllmServer:
    """`vllm serve MODEL --kv-transfer-config ...` started in its own process group."""

    def __init__(self, model: Path, log_path: Path, target: str, namespace: str, *args: str) -> None:
        self.model = str(model)
        self.port = free_port()
        self.log_path = log_path
        self.command = [str(VLLM_CLI), "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port),
                        "--kv-transfer-config", json.dumps(kv_transfer_config(target, namespace)), *args]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "VLLM_"))}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                   VLLM_CPU_KVCACHE_SPACE="1")
        started = time.monotonic()
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=log_path.parent, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"`vllm serve` exited with {self.proc.returncode} before serving: "
                                     f"{' '.join(self.command)}\n--- log tail ---\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise AssertionError(f"`vllm serve` not healthy after {START_TIMEOUT}s\n--- log tail ---\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL to what is left after STOP_TIMEOUT;
        raises if anything of the group outlives that."""
        group = self.proc.pid  # start_new_session: the group's id is the server's pid
        _signal_group(group, signal.SIGTERM)
        if not _wait_group_gone(self.proc, group, STOP_TIMEOUT):
            _signal_group(group, signal.SIGKILL)
            if not _wait_group_gone(self.proc, group, STOP_TIMEOUT):
                raise AssertionError(f"processes of `vllm serve` (group {group}) outlived SIGKILL")

    def complete(self, prompt: str, max_tokens: int = 12) -> Completion:
        """POST /v1/completions, greedy."""
        reply = self._post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "logprobs": 0})
        choice = reply["choices"][0]
        return _completion(reply, choice["text"], choice["logprobs"]["token_logprobs"])

    def chat(self, messages: list[dict], max_tokens: int = 12) -> Completion:
        """POST /v1/chat/completions, greedy."""
        reply = self._post("/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens, "logprobs": True})
        choice = reply["choices"][0]
        return _completion(reply, choice["message"]["content"], [t["logprob"] for t in choice["logprobs"]["content"]])

    def _post(self, path: str, body: dict) -> dict:
        body = {"model": self.model, "temperature": 0.0, "ignore_eos": True, **body}
        request = urllib.request.Request(f"{self.url}{path}", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        started = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as reply:
                answer = json.load(reply)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path}: HTTP {exc.code}: {exc.read()[:2000]!r}") from None
        answer["seconds"] = time.monotonic() - started
        return answer

    def metrics(self) -> dict[str, float]:
        """GET /metrics: each sample's value by metric name (labels dropped; this server has one
        engine and one model, so each counter has one sample)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=REQUEST_TIMEOUT) as reply:
            text = reply.read().decode()
        return {m["name"]: float(m["value"]) for m in map(_METRIC.match, text.splitlines()) if m}


def _completion(reply: dict, text: str, logprobs: list[float]) -> Completion:
    usage = reply["usage"]
    details = usage.get("prompt_tokens_details") or {}  # with --enable-prompt-tokens-details
    return Completion(text, logprobs, usage["prompt_tokens"], details.get("cached_tokens") or 0,
                      reply["kv_transfer_params"]["kvtier"], reply["seconds"])


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


def _wait_group_gone(proc: subprocess.Popen, group: int, timeout: float) -> bool:
    """Reap the server, then wait until no process of its group is left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc.poll()
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False
