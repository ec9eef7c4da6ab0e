"""Run by test_multiprocess.py under `accelerate launch`: train a few steps with remote generation, reference and
weight sync, then write what this rank saw to <output_dir>/rank-<i>.json."""

import json
import os
import sys


from open_r1_ext import RemoteGRPOTrainer
from tests.helpers import reward_len, tiny_config, tiny_dataset

model, url, output_dir, per_device = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
samples = []


def counting_reward(completions, **kwargs):
    samples.append(len(completions))
    return reward_len(completions)


args = tiny_config(output_dir, max_steps=3, per_device_train_batch_size=per_device, generation_url=url,
                   ref_model_url=f"{url}/ref")
trainer = RemoteGRPOTrainer(model=model, reward_funcs=counting_reward, args=args, train_dataset=tiny_dataset())
trainer.train()
rank = trainer.accelerator.process_index
with open(os.path.join(output_dir, f"rank-{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": trainer.accelerator.num_processes, "global_step": trainer.state.global_step,
               "local_samples": sum(samples), "server_version": trainer.remote_generation.target.client.weight_version(),
               "target_version": trainer.remote_generation.target.version}, f)
