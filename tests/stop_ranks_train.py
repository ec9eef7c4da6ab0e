"""Run by test_stop.py under `accelerate launch` with two processes: only rank 1 gets SIGTERM (after step 2); both
ranks must agree to stop at the same step and save one checkpoint. Writes what each rank saw to rank-<i>.json."""

import json
import os
import signal
import sys

from transformers import TrainerCallback

from open_r1_ext import RemoteGRPOTrainer
from tests.helpers import reward_len, tiny_config, tiny_dataset

model, url, output_dir = sys.argv[1], sys.argv[2], sys.argv[3]


class SigtermRankOne(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 2 and int(os.environ.get("RANK", "0")) == 1:
            os.kill(os.getpid(), signal.SIGTERM)


args = tiny_config(output_dir, max_steps=50, per_device_train_batch_size=2, generation_url=url,
                   ref_model_url=f"{url}/ref")
trainer = RemoteGRPOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=tiny_dataset(),
                            callbacks=[SigtermRankOne()])
trainer.train()
rank = trainer.accelerator.process_index
with open(os.path.join(output_dir, f"rank-{rank}.json"), "w") as f:
    json.dump({"global_step": trainer.state.global_step, "stopped_at": trainer.stop_signal.stopped_at,
               "received": trainer.stop_signal.received}, f)
