"""The GPU checks of the network weight sync (issue #22) and of embedded servers bound to GPUs (#31), run by
tools/gpu_check.sh on a machine with one NVIDIA GPU; each prints a line and goes into OUT/gpu_check.json. Not run in
CI (no GPU there).

1. The built-in server on CUDA: healthy, generates, and its reference log-probs equal a local forward on the GPU.
2. Tiny GRPO runs with the trainer on the GPU against that server (5 steps each): weights synced through the disk,
   and over the network (`sync.transport: distributed`, gloo: NCCL needs the server on another GPU than the
   trainer's); seconds per step, and the server ends on the final policy.
3. `open-r1-ext train` with an embedded built-in server on the GPU (`resources.gpus_per_node: 1`) beside the tiny
   recipe's CPU trainer (2 steps): the split's `GPUs:` line, the GPU the server process saw and its device.
4. The network transport on the GPU, on the ~100M model (float32, one bucket), each checked against a dump of the same
   weights and timed (median of 5): NCCL from the trainer's broadcaster to the built-in server, both on this one GPU
   (NCCL may refuse two ranks of a group on one GPU: the line then says so and why); gloo from a CUDA IPC buffer
   (the broadcaster's CUDA path); and a dump + reload, for scale.

    python tools/gpu_check.py MODELS_DIR OUT_DIR      (MODELS_DIR holds tiny/ and 100m/ from make_tiny_model.py)
    GPU_CHECK_DEVICE=cpu GPU_CHECK_SIZE=tiny python tools/gpu_check.py ...   a dry run of the harness, no GPU
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from open_r1_ext.launch.local_server import BuiltinServer  # noqa: E402
from open_r1_ext.sglang_client import SGLangClient  # noqa: E402
from open_r1_ext.weight_broadcast import WeightBroadcast  # noqa: E402

SEQUENCES = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15]]
DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")  # `cpu`: a dry run of the harness on a machine without a GPU
SIZE = os.environ.get("GPU_CHECK_SIZE", "100m")  # the transports' model (`tiny` for a dry run)
figures: dict = {}


def report(key: str, value, note: str = "") -> None:
    figures[key] = value
    print(f"{key}: {value}{'  ' + note if note else ''}", flush=True)


def local_logprobs(model_dir: Path) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()
    rows = []
    with torch.no_grad():
        for seq in SEQUENCES:
            logits = model(torch.tensor([seq], device=DEVICE)).logits[0, :-1].float()
            rows.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:], device=DEVICE)[:, None])[:, 0].cpu())
    return rows


def check_server(url: str, model_dir: Path) -> None:
    client = SGLangClient(url)
    report("server.device", client.server_info().get("device"))
    report("server.generates", bool(client.generate([[1, 2, 3]], {"max_new_tokens": 4})))
    served = client.ref_logprobs(SEQUENCES)
    report("server.max_logprob_diff_vs_local", max((a - b).abs().max().item() for a, b in zip(served, local_logprobs(model_dir))))


def tiny_runs(url: str, model_dir: Path, work: Path) -> None:
    from open_r1_ext import RemoteGRPOConfig, RemoteGRPOTrainer
    from tools.bench_common import arithmetic_prompts

    for transport in ("disk", "distributed"):
        args = RemoteGRPOConfig(output_dir=str(work / transport), per_device_train_batch_size=8, num_generations=4,
                                max_completion_length=16, max_steps=5, logging_steps=1, beta=0.0, report_to=[],
                                save_strategy="no", bf16=False, learning_rate=1e-3, generation_url=url,
                                transport=transport, distributed_backend="gloo", use_cpu=DEVICE == "cpu")
        trainer = RemoteGRPOTrainer(model=str(model_dir), reward_funcs=lambda completions, **kw: [1.0] * len(completions),
                                    args=args, train_dataset=arithmetic_prompts(64))
        start = time.perf_counter()
        trainer.train()
        report(f"tiny_run.{transport}.seconds_per_step", round((time.perf_counter() - start) / 5, 4),
               f"(trainer on {trainer.accelerator.device})")
        client = SGLangClient(url)
        report(f"tiny_run.{transport}.server_version", client.weight_version())
        sent = client.ref_logprobs(SEQUENCES)
        trainer.save_model(str(work / f"final-{transport}"))
        client.update_weights_from_disk(str(work / f"final-{transport}"), weight_version="check")
        report(f"tiny_run.{transport}.server_holds_final_policy",
               all(torch.equal(a, b) for a, b in zip(sent, client.ref_logprobs(SEQUENCES))))


def embedded_server_gpus(model_dir: Path, out: Path) -> None:
    """The tiny recipe through `open-r1-ext train`, its built-in generation server embedded and given a GPU of its own
    (`train.bind_gpus`); what the trainer's log and the server's log say they got."""
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    run = out / "embedded"
    server = f"{{engine: builtin, device: {DEVICE}, dtype: float32, resources: {{gpus_per_node: 1}}}}"
    sets = [f"model.name_or_path={model_dir}", f"trainer.output_dir={run}", "trainer.max_steps=2",
            f"servers.generation={server}"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
    done = subprocess.run([sys.executable, "-m", "open_r1_ext.cli", "train", str(repo / "recipes/tiny/grpo.yaml"),
                           *(word for item in sets for word in ("--set", item))], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)
    report("embedded.exit_code", done.returncode, done.stderr[-400:] if done.returncode else "")
    split = [line for line in done.stderr.splitlines() if "GPUs: the trainer" in line]
    report("embedded.split", split[-1].split("GPUs: ", 1)[1] if split else "none (no GPU asked or visible)")
    log = run / "generation-server.log"
    seen = [line for line in log.read_text().splitlines() if "CUDA_VISIBLE_DEVICES=" in line] if log.exists() else []
    report("embedded.server_saw", seen[0].split("CUDA_VISIBLE_DEVICES=", 1)[1] if seen else "no log line")


def transports(url: str, model_dir: Path, other_dir: Path) -> None:
    """The ~100M model's weights (the other seed's) sent to the server at `url` by each transport."""
    from safetensors.torch import load_file

    client = SGLangClient(url)
    client.update_weights_from_disk(str(other_dir), weight_version="dump")
    dumped = client.ref_logprobs(SEQUENCES)
    weights = {k: v.to(DEVICE) for k, v in load_file(str(other_dir / "model.safetensors")).items()}
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    report("transport.bytes", nbytes)
    for name, backend in (("nccl", "nccl"), ("gloo_cuda_ipc", "gloo")):
        client.update_weights_from_disk(str(model_dir), weight_version="default")
        sender = WeightBroadcast(backend, torch.device(DEVICE), timeout_s=60)
        seconds, error = [], None
        try:
            for rep in range(6):
                start = time.perf_counter()
                update = sender.update([client], f"{name}-{rep}", 1)
                update.send(0, weights)
                outcome = update.finish()[url]
                if outcome is not None:
                    error = str(outcome)
                    break
                seconds.append(time.perf_counter() - start)
        finally:
            sender.close()
        if error is not None:
            duplicate = "Duplicate GPU" in error or "duplicate GPU" in error
            report(f"transport.{name}.error", error[:600], "(NCCL refuses two ranks of one group on one GPU: the server "
                                                         "needs another GPU than the trainer's)" if duplicate else "")
            continue
        report(f"transport.{name}.exact", all(torch.equal(a, b) for a, b in zip(client.ref_logprobs(SEQUENCES), dumped)))
        median = statistics.median(seconds[1:])  # the first forms the group
        report(f"transport.{name}.seconds", round(median, 4), f"({nbytes / median / 1e9:.1f} GB/s; first {seconds[0]:.2f} s)")
    seconds = []
    for rep in range(5):
        start = time.perf_counter()
        client.update_weights_from_disk(str(other_dir), weight_version=f"disk-{rep}")
        seconds.append(time.perf_counter() - start)
    report("transport.disk_reload_only.seconds", round(statistics.median(seconds), 4), "(the dump already written)")


def main() -> None:
    models, out = Path(sys.argv[1]), Path(sys.argv[2])
    from tools.make_tiny_model import make_tiny_model

    other = make_tiny_model(models / f"{SIZE}-seed1", seed=1, size=SIZE)
    with tempfile.TemporaryDirectory() as tmp:
        with BuiltinServer(str(models / "tiny"), extra_args=("--device", DEVICE, "--no-ref-slot"),
                           log_path=str(out / "server-tiny.log")) as server:
            check_server(server.url, models / "tiny")
            tiny_runs(server.url, models / "tiny", Path(tmp))
        embedded_server_gpus(models / "tiny", out)
        with BuiltinServer(str(models / SIZE), extra_args=("--device", DEVICE, "--no-ref-slot", "--dtype", "float32"),
                           log_path=str(out / f"server-{SIZE}.log")) as server:
            transports(server.url, models / SIZE, other)
    (out / "gpu_check.json").write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
