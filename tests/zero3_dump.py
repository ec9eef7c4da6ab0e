"""Run by test_zero3.py under `accelerate launch` (2 CPU processes): DeepSpeed ZeRO-3 with every parameter
partitioned, weight dumps in buckets smaller than one layer. Each rank records the shards it wrote in
`<output_dir>/writes-<rank>.json`; rank 0 writes what it checked in `<output_dir>/zero3.json`.

    python -m tests.zero3_dump MODEL OUTPUT_DIR dump        one step at learning rate 0, then one dump
    python -m tests.zero3_dump MODEL OUTPUT_DIR train URL   3 steps against the server at URL, a checkpoint every
                                                            step, resuming from the last one when there is one
    python -m tests.zero3_dump MODEL OUTPUT_DIR distributed URL [in-flight]
                                                            2 steps against the server at URL with
                                                            `transport: distributed` (buckets of 20 kB; with in-flight
                                                            updates: staged, broadcast on the update thread), then a
                                                            dump of the final policy; each rank counts its broadcasts
                                                            in `zero3-<rank>.json`
    python -m tests.zero3_dump MODEL OUTPUT_DIR lora URL    a LoRA policy: 3 steps of async generation against the
                                                            server at URL (its adapters synced), then one more
                                                            adapter dump in buckets of 1 kB; rank 0 writes the
                                                            adapter gathered whole, each rank the weight versions
                                                            its batches were sampled with (`versions-<rank>.json`)

Faults injected by the test, named as such: in `dump` mode, a second dump (step 2) in which rank 1's first shard
write raises ENOSPC (each rank writes the error it got to `<output_dir>/failed-<rank>.txt`); with
`KILL_RANK_1_AT_STEP=N`, rank 1 kills itself (SIGKILL) right after writing its first shard of the dump of step N.
"""

import errno
import json
import os
import signal
import sys
from pathlib import Path

import deepspeed

deepspeed.init_distributed(dist_backend="gloo")  # on CPU, before transformers builds the model under zero.Init


from safetensors.torch import load_file  # noqa: E402

from open_r1_ext import RemoteGRPOTrainer  # noqa: E402
from open_r1_ext.trainer import weight_sync  # noqa: E402
from open_r1_ext.weight_files import read_weight_dir  # noqa: E402
from tests.helpers import reward_len, tiny_config, tiny_dataset  # noqa: E402

BUCKET_MB = 0.02  # 20 kB: the tiny model's layers hold ~160 kB, its largest tensor 77 kB (a bucket of its own)
model, output_dir, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
rank = int(os.environ["RANK"])
zero3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
         "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto"}
writes = []
write_shard = weight_sync.write_shard
kill_at = os.environ.get("KILL_RANK_1_AT_STEP")


def recording_write_shard(path, tensors, durable=False):
    if rank == 1 and path.parent.name.startswith(".step-2.tmp-") and mode == "dump":
        raise OSError(errno.ENOSPC, "No space left on device", str(path))  # injected fault: rank 1's disk is full
    written = write_shard(path, tensors, durable)
    writes.append({"dump": path.parent.name, "shard": path.name})
    (output_dir / f"writes-{rank}.json").write_text(json.dumps(writes))
    if kill_at is not None and rank == 1 and path.parent.name.startswith(f".step-{kill_at}.tmp-"):
        os.kill(os.getpid(), signal.SIGKILL)  # injected fault: this rank dies in the middle of the dump
    return written


weight_sync.write_shard = recording_write_shard
if mode == "dump":
    args = tiny_config(output_dir, max_steps=1, per_device_train_batch_size=2, deepspeed=zero3, beta=0.0,
                       learning_rate=0.0, bucket_mb=BUCKET_MB)
    trainer = RemoteGRPOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    trainer.train()
    local = sum(p.numel() for p in trainer.model.parameters())
    full = sum(p.ds_numel for p in trainer.model.parameters())
    path = trainer.weight_sync.dump(trainer.model, 1)
    if trainer.accelerator.is_main_process:
        dumped, original = read_weight_dir(path), load_file(str(Path(model) / "model.safetensors"))
        report = {
            "stage": trainer.model_wrapped.zero_optimization_stage(), "local_numel": local, "full_numel": full,
            "keys": sorted(dumped) == sorted(original),
            "max_diff": max((dumped[k] - original[k]).abs().max().item() for k in original),
            "path": str(path),
        }
        (output_dir / "zero3.json").write_text(json.dumps(report))
    try:
        trainer.weight_sync.dump(trainer.model, 2)
        failure = "no error"
    except weight_sync.WeightDumpError as err:
        failure = str(err)
    (output_dir / f"failed-{rank}.txt").write_text(failure)
elif mode == "distributed":
    from open_r1_ext import weight_broadcast

    in_flight = dict(async_generation=True, in_flight_updates=True, num_generations=2) if sys.argv[5:] == ["in-flight"] \
        else {}
    args = tiny_config(output_dir, max_steps=2, per_device_train_batch_size=2, deepspeed=zero3, beta=0.0,
                       generation_url=sys.argv[4], bucket_mb=BUCKET_MB, transport="distributed", learning_rate=5e-3,
                       **in_flight)
    trainer = RemoteGRPOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    sent, send = [], weight_broadcast.WeightUpdate.send_flat

    def counting_send(self, index, layout, fill):
        sent.append(index)
        send(self, index, layout, fill)

    weight_broadcast.WeightUpdate.send_flat = counting_send
    trainer.train()
    final = trainer.weight_sync.dump(trainer.model, 99)  # the whole final policy, as the dump's walk gathers it
    buckets = len(weight_sync.PolicyWeights(trainer.accelerator, trainer.model, trainer.weight_sync.bucket_bytes).buckets)
    report = {"sent": sent, "buckets": buckets, "broadcaster": trainer.weight_sync._sender is not None,
              "stage": trainer.model_wrapped.zero_optimization_stage(), "final": str(final)}
    (output_dir / f"zero3-{rank}.json").write_text(json.dumps(report))
elif mode == "lora":
    import deepspeed
    import peft
    from safetensors.torch import save_file

    args = tiny_config(output_dir, max_steps=3, per_device_train_batch_size=2, deepspeed=zero3, beta=0.0,
                       generation_url=sys.argv[4], async_generation=True, learning_rate=5e-2,
                       bucket_mb=BUCKET_MB / 20)  # 1 kB: the adapter's 28 tensors in many buckets
    trainer = RemoteGRPOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=tiny_dataset(),
                                peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    versions, log_rollout = [], trainer.remote_generation._log_rollout

    def recording_log_rollout(completions, served=None):
        versions.append(sorted({str(c.weight_version) for c in completions}))
        log_rollout(completions, served)

    trainer.remote_generation._log_rollout = recording_log_rollout
    trainer.train()
    (output_dir / f"versions-{rank}.json").write_text(json.dumps(versions))
    path = trainer.weight_sync.dump(trainer.model, 4)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    lora = [p for n, p in unwrapped.named_parameters() if "lora_" in n]
    with deepspeed.zero.GatheredParameters(lora, modifier_rank=None):  # the unsharded adapter, all at once
        whole = {k: v.clone() for k, v in peft.get_peft_model_state_dict(unwrapped).items()}
    if trainer.accelerator.is_main_process:
        save_file(whole, str(output_dir / "whole.safetensors"))
        report = {"path": str(path), "local_numel": sum(p.numel() for p in lora),
                  "full_numel": sum(p.ds_numel for p in lora), "buckets": len(weight_sync.AdapterWeights(
                      trainer.accelerator, trainer.model, trainer.weight_sync.bucket_bytes).buckets)}
        (output_dir / "zero3.json").write_text(json.dumps(report))
else:
    args = tiny_config(output_dir, max_steps=3, per_device_train_batch_size=2, deepspeed=zero3, beta=0.0,
                       generation_url=sys.argv[4], bucket_mb=BUCKET_MB, save_strategy="steps", save_steps=1,
                       learning_rate=5e-3)
    trainer = RemoteGRPOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    trainer.train(resume_from_checkpoint=any(output_dir.glob("checkpoint-*")) or None)
    if trainer.accelerator.is_main_process:
        (output_dir / "zero3.json").write_text(json.dumps({"global_step": trainer.state.global_step}))
