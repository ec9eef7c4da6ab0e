"""Run by test_zero3.py under `accelerate launch` (2 CPU processes): DeepSpeed ZeRO-3 with every parameter
partitioned, one training step at learning rate 0, then a weight dump; rank 0 writes what it checked."""

import json
import sys
from pathlib import Path

import deepspeed

deepspeed.init_distributed(dist_backend="gloo")  # on CPU, before transformers builds the model under zero.Init


from safetensors.torch import load_file

from open_r1_ext import RemoteGRPOTrainer
from tests.helpers import reward_len, tiny_config, tiny_dataset

model, output_dir = sys.argv[1], Path(sys.argv[2])
zero3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
         "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto"}
args = tiny_config(output_dir, max_steps=1, per_device_train_batch_size=2, deepspeed=zero3, beta=0.0, learning_rate=0.0)
trainer = RemoteGRPOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
trainer.train()
local = sum(p.numel() for p in trainer.model.parameters())
full = sum(p.ds_numel for p in trainer.model.parameters())
path, error = trainer.weight_sync.dump(trainer.model, 1)
if trainer.accelerator.is_main_process:
    dumped, original = load_file(str(path / "model.safetensors")), load_file(str(Path(model) / "model.safetensors"))
    report = {
        "stage": trainer.model_wrapped.zero_optimization_stage(), "local_numel": local, "full_numel": full,
        "error": error, "same_keys": sorted(set(original) - set(dumped)) == [],
        "max_diff": max((dumped[k] - original[k]).abs().max().item() for k in original),
        "manifest": (path / "manifest.json").is_file(),
    }
    (output_dir / "zero3.json").write_text(json.dumps(report))
