"""Helpers shared by the tests: a tiny prompt dataset, a reward, configs sized for 2 CPU cores, model variants,
the server chores (restore its start-up weights, start another of its kind, say which engine answers, kill and restart
it mid-training), a stand-in HTTP server in a thread, and `open_r1_ext.train` as a real process (its recipe, its step
lines, its children)."""

import copy
import json
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator, Optional

import torch
import yaml
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from open_r1_ext import RemoteGRPOConfig
from open_r1_ext.launch.local_server import LocalServer, SharedMemoryFiles, free_port
from open_r1_ext.protocol import DEFAULT_WEIGHT_VERSION
from open_r1_ext.sglang_client import SGLangClient
from tools.bench_common import arithmetic_prompts

REPO = Path(__file__).resolve().parents[1]
# Every shipped recipe: the GPU ones and the tiny CPU one
SHIPPED_RECIPES = sorted(REPO.glob("recipes/*/grpo/*.yaml")) + [REPO / "recipes/tiny/grpo.yaml"]
# The tiny model's weights are float32; SGLang's `--dtype auto` serves a float32 model in float16 (model_config.py
# ~2317, "the common practice"), whose log-probs were up to 2.2e-3 from a float32 forward of trained weights
SGLANG_FLOAT32 = ("--dtype", "float32")
LORA_FLAGS = ("--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", "all")  # a server for the tests' rank-4 adapters


def tiny_recipe(tmp_path: Path, tiny_model: Path, **trainer) -> Path:
    raw = yaml.safe_load((REPO / "recipes/tiny/grpo.yaml").read_text())
    raw["model"]["name_or_path"] = str(tiny_model)
    raw["data"]["dataset"] = str(REPO / raw["data"]["dataset"])
    raw["trainer"].update(output_dir=str(tmp_path / "run"), save_strategy="no", **trainer)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def start_training(recipe: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "open_r1_ext.train", "--config", str(recipe), *overrides],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def step_lines(process: subprocess.Popen, until_step: int) -> list[int]:
    """The steps the trainer prints (`step   3/30  reward ...`), read until `until_step` (or its end)."""
    steps = []
    for line in process.stdout:
        if line.startswith("step "):
            steps.append(int(line.split()[1].split("/")[0]))
            if steps[-1] >= until_step:
                break
    return steps


def children(pid: int, name: str) -> list[int]:
    """The child processes of `pid` whose command line holds `name`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat, cmdline = (entry / "stat").read_text(), (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and name.encode() in cmdline:
            found.append(int(entry.name))
    return found


def group_gone(pgid: int, within_s: float = 20.0) -> bool:
    """Whether every process of process group `pgid` has gone (zombies aside) within `within_s`: a server started in a
    session of its own and whatever it started (SGLang's scheduler and detokenizer)."""
    deadline = time.monotonic() + within_s
    while True:
        members = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(stat.parent.name))
        if not members or time.monotonic() > deadline:
            return not members
        time.sleep(0.2)


def gone(pid: int, within_s: float = 20.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.2)
    return False


@contextmanager
def http_server(handler) -> Iterator[str]:
    """A real HTTP server on a free port answering with `handler` (a `BaseHTTPRequestHandler` class), in a thread:
    yields its URL."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}"
    finally:
        httpd.shutdown()


class JsonHandler(BaseHTTPRequestHandler):
    """A handler for `http_server` that answers JSON (`answer(status, body)`) and logs nothing."""

    def answer(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def tiny_dataset(n: int = 16) -> Dataset:
    return arithmetic_prompts(n)


def reward_len(completions, **kwargs):
    return [float(len(c[0]["content"])) / 10 for c in completions]


def tiny_settings(output_dir, **overrides) -> dict:
    """Float32 (bf16 off: TRL's default bf16 autocast would make its local log-probs differ), 4 prompts x 4."""
    settings = dict(output_dir=str(output_dir), per_device_train_batch_size=4, num_generations=4,
                    max_completion_length=8, max_steps=3, logging_steps=1, beta=0.1, seed=42, report_to=[],
                    use_cpu=True, save_strategy="no", learning_rate=1e-3, bf16=False, disable_tqdm=True)
    settings.update(overrides)
    return settings


def tiny_config(output_dir, **overrides) -> RemoteGRPOConfig:
    return RemoteGRPOConfig(**tiny_settings(output_dir, **overrides))


def model_variant(base: Path, out: Path, **config_changes) -> Path:
    """A random model like `base` but with `config_changes` (e.g. another vocab size), and `base`'s tokenizer."""
    config = AutoConfig.from_pretrained(base)
    for key, value in config_changes.items():
        setattr(config, key, value)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def restore_default_weights(url: str, model: Path, **keys: str) -> None:
    """Put the server (slot) at `url` back on `model`'s weights, reporting its start-up weight version (`keys`: the
    client's `api_key` and `admin_api_key`, for a server that wants them)."""
    client = SGLangClient(url, **keys)
    assert client.update_weights_from_disk(str(model), weight_version=DEFAULT_WEIGHT_VERSION)["success"]


def loaded_adapters(client: SGLangClient) -> list[str]:
    """The names of the LoRA adapters the server lists in `/v1/models` (after the model, as both servers list)."""
    return [card["id"] for card in client.get_json("/v1/models")["data"][1:]]


def unload_adapters(url: str) -> None:
    """Unload every LoRA adapter the server at `url` holds."""
    client = SGLangClient(url)
    for name in loaded_adapters(client):
        client.unload_lora_adapter(name)


def server_like(server: LocalServer, port: Optional[int] = None, log_path: Optional[Path] = None) -> LocalServer:
    """Another server of `server`'s kind (a built-in server or SGLang, with its interpreter and flags) on the same
    model, on `port` (default: a free one), logging to `log_path`; not started."""
    other = copy.copy(server)  # its class, command and settings; a process of its own, its own /dev/shm files
    other.port, other.log_path, other.process = port or free_port(server.host), log_path, None
    other.shared_memory = SharedMemoryFiles()
    return other


def engine_at(url: str) -> str:
    """Which engine answers at `url`, from its `/server_info`: `builtin` (it says so), `sglang` (real SGLang reports
    its server arguments, e.g. `attention_backend`) or `unknown` (e.g. `tests/fake_sglang.py`)."""
    info = SGLangClient(url).server_info()
    if info.get("engine") == "builtin":
        return "builtin"
    return "sglang" if "attention_backend" in info else "unknown"


class KillServerAt(TrainerCallback):
    """Kill `server` (SIGKILL, its process group) after optimizer step `step` and, with `restart_after` seconds or
    `restart_at` (a later step), start it again: the same server (built-in or SGLang) on the same port, that much
    later on a timer, or at the end of step `restart_at`, answering before the step ends (in `self.restarted`; stop
    it with `stop()`)."""

    def __init__(self, server: LocalServer, step: int, restart_after: Optional[float] = None,
                 restart_at: Optional[int] = None):
        self.server, self.step, self.restart_after, self.restart_at = server, step, restart_after, restart_at
        self.restarted: Optional[LocalServer] = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.server.stop(signal.SIGKILL)
            if self.restart_after is not None:
                threading.Timer(self.restart_after, self._again().start).start()
        elif state.global_step == self.restart_at:
            self._again().start()

    def _again(self) -> LocalServer:
        self.restarted = server_like(self.server, port=self.server.port, log_path=self.server.log_path)
        return self.restarted

    def stop(self) -> None:
        self.server.stop()
        if self.restarted is not None:
            self.restarted.stop()


class WaitAt(TrainerCallback):
    """After optimizer step `step`, wait until `until()` holds (`what` it waits for); after 120 s the run fails."""

    def __init__(self, step: int, until, what: str):
        self.step, self.until, self.what = step, until, what

    def on_step_end(self, args, state, control, **kwargs):
        deadline = time.monotonic() + 120
        while state.global_step == self.step and not self.until():
            assert time.monotonic() < deadline, f"after step {self.step}: waited 120 s for {self.what}"
            time.sleep(0.2)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def synced(output_dir: Path, role: str = "generation") -> dict[int, list[str]]:
    """The syncs of `role` in `weight_sync.jsonl`: step -> the replicas that confirmed it (a pool's)."""
    return {e["step"]: sorted(e.get("replicas", [])) for e in read_jsonl(output_dir / "weight_sync.jsonl")
            if e["role"] == role}


def served(output_dir: Path) -> list[list[str]]:
    """Each batch of `rollouts.jsonl`: the replica of each of its prompts."""
    return [e["replicas"] for e in read_jsonl(output_dir / "rollouts.jsonl")]


def forward_logprobs(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """What a server's reference log-probs of `sequences` should be: each token's log-prob after its prefix, from a
    local float32 forward of `model` (a directory, or a loaded model)."""
    if not isinstance(model, torch.nn.Module):
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for ids in sequences:
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0])
    return out
