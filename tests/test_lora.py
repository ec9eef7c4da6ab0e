"""Adapter-only LoRA sync (#16 item 3): a PEFT policy's weight sync ships its adapter alone, as a PEFT directory
that peft and the servers load; the server samples with it by name, and the reference is the server's base model."""

import json
import subprocess
from pathlib import Path

import peft
import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from open_r1_ext.trainer.weight_sync import ADAPTER_CONFIG, ADAPTER_FILE, WeightSync
from open_r1_ext.weight_files import MANIFEST, check_manifest, read_weight_dir
from tests.test_zero3 import launch


def trained_lora(model_path: Path, **config) -> peft.PeftModel:
    """A LoRA policy as after some training: its adapter's B matrices are no longer zero."""
    torch.manual_seed(0)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model_path),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    return model.eval()


def test_an_adapter_dump_is_what_peft_saves_and_loads(tiny_model, tmp_path):
    """The dump (buckets smaller than one tensor) holds the adapter alone, under `save_pretrained`'s names, with its
    config and a manifest; peft loads it into the base model and gives the policy's logits; the policy is untouched."""
    model = trained_lora(tiny_model)
    before = {name: param.clone() for name, param in model.named_parameters()}
    sync = WeightSync(Accelerator(cpu=True), str(tmp_path / "weights"), 0, str(tmp_path / "log"), [],
                      bucket_mb=0.001, adapter_only=True)
    path = sync.dump(model, 3)
    assert path == tmp_path / "weights" / "step-3"
    assert sorted(p.name for p in path.iterdir()) == sorted([ADAPTER_FILE, ADAPTER_CONFIG, MANIFEST])
    check_manifest(path, checksums=False)
    model.save_pretrained(tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / ADAPTER_FILE))
    dumped = read_weight_dir(path)
    assert sorted(dumped) == sorted(saved) and all(torch.equal(dumped[k], saved[k]) for k in saved)
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    assert config["r"] == 4 and config["inference_mode"] and config["peft_type"] == "LORA"
    assert sorted(config["target_modules"]) == sorted(json.loads((tmp_path / "saved" / ADAPTER_CONFIG).read_text())["target_modules"])
    # a few percent of the model's bytes
    full = sum(t.numel() * t.element_size() for t in read_weight_dir(tiny_model).values())
    assert sum(t.numel() * t.element_size() for t in dumped.values()) < 0.2 * full
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(path)).eval()
    ids = torch.tensor([[1, 5, 9, 20, 3, 7]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-6)
    assert all(torch.equal(before[name], param) for name, param in model.named_parameters())


def test_zero3_lora_on_two_processes_dumps_the_unsharded_adapter(tiny_model, tmp_path):
    """DeepSpeed ZeRO-3, 2 gloo processes, every LoRA parameter partitioned: the adapter dump, gathered in buckets of
    1 kB, equals the adapter gathered whole, and peft loads it."""
    result = launch(tiny_model, tmp_path, "lora")
    assert result.returncode == 0, result.stderr[-5000:]
    report = json.loads((tmp_path / "zero3.json").read_text())
    assert report["local_numel"] == 0 < report["full_numel"] and report["buckets"] > 4
    dump = Path(report["path"])
    check_manifest(dump, checksums=False)
    dumped, whole = read_weight_dir(dump), load_file(str(tmp_path / "whole.safetensors"))
    assert sorted(dumped) == sorted(whole) and all(torch.equal(dumped[k], whole[k]) for k in whole)
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in dumped.items())  # it trained a step
    peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(dump))
