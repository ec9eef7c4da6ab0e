"""Helpers shared by the tests: a tiny prompt dataset, a reward, configs sized for 2 CPU cores, model variants."""

from pathlib import Path

from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from open_r1_ext import RemoteGRPOConfig


def tiny_dataset(n: int = 16) -> Dataset:
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}]} for i in range(n)])


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
