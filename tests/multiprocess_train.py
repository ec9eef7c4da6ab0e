"""Run by test_multiprocess.py under `accelerate launch`: train a few steps with remote generation, reference and
weight sync (with a 5th argument `in-flight`: 2 steps with in-flight updates), then write what this rank saw to
<output_dir>/rank-<i>.json."""

import json
import os
import sys


from open_r1_ext import RemoteGRPOTrainer
from tests.helpers import reward_len, tiny_config, tiny_dataset

model, url, output_dir, per_device = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
in_flight = sys.argv[5:] == ["in-flight"]
samples = []


def counting_reward(completions, **kwargs):
    samples.append(len(completions))
    return reward_len(completions)


mode = dict(max_steps=2, async_generation=True, in_flight_updates=True) if in_flight else dict(max_steps=3)
args = tiny_config(output_dir, per_device_train_batch_size=per_device, generation_url=url, ref_model_url=f"{url}/ref",
                   **mode)
trainer = RemoteGRPOTrainer(model=model, reward_funcs=counting_reward, args=args, train_dataset=tiny_dataset())
generation, in_flight_counts, trained = trainer.remote_generation, [0], []
if in_flight:
    send, log_groups = generation.send, generation._log_groups

    def counted_send(group, done):  # the groups this process has sent and no step has taken yet
        send(group, done)
        in_flight_counts.append(generation._batches.running)

    def recorded_log_groups(groups, step):
        trained.extend([group.epoch, *group.position] for group in groups)
        log_groups(groups, step)

    generation.send, generation._log_groups = counted_send, recorded_log_groups
trainer.train()
rank = trainer.accelerator.process_index
with open(os.path.join(output_dir, f"rank-{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": trainer.accelerator.num_processes, "global_step": trainer.state.global_step,
               "local_samples": sum(samples), "server_version": generation.target.client.weight_version(),
               "target_version": generation.target.version, "most_in_flight": max(in_flight_counts),
               "trained": trained}, f)
