"""Helpers shared by the tests: a tiny prompt dataset, a reward, configs sized for 2 CPU cores, model variants,
and the server chores (restore its start-up weights, kill and restart it mid-training)."""

import signal
import threading
from pathlib import Path
from typing import Optional

from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from open_r1_ext import RemoteGRPOConfig
from open_r1_ext.launch.local_server import BuiltinServer
from open_r1_ext.protocol import DEFAULT_WEIGHT_VERSION
from open_r1_ext.sglang_client import SGLangClient
from tools.bench_common import arithmetic_prompts


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


def restore_default_weights(url: str, model: Path) -> None:
    """Put the server (slot) at `url` back on `model`'s weights, reporting its start-up weight version."""
    assert SGLangClient(url).update_weights_from_disk(str(model), weight_version=DEFAULT_WEIGHT_VERSION)["success"]


class KillServerAt(TrainerCallback):
    """Kill `server` (SIGKILL) after optimizer step `step`; with `restart_after` seconds, start it again on the same
    port that much later (in `self.restarted`; stop it with `stop()`)."""

    def __init__(self, server: BuiltinServer, step: int, restart_after: Optional[float] = None):
        self.server, self.step, self.restart_after = server, step, restart_after
        self.restarted: Optional[BuiltinServer] = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != self.step:
            return
        self.server.stop(signal.SIGKILL)
        if self.restart_after is not None:
            self.restarted = BuiltinServer(self.server.model_path, port=self.server.port)
            threading.Timer(self.restart_after, self.restarted.start).start()

    def stop(self) -> None:
        self.server.stop()
        if self.restarted is not None:
            self.restarted.stop()
