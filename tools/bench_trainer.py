"""Benchmark the trainer process with the reference model on a server against stock TRL; prints a markdown table.

Two figures, from the same GRPO runs (beta=0.04, generation by the policy in the trainer for both, so only the
reference differs; float32 on CPU, bf16 off):

1. Peak RSS of the trainer process: stock `GRPOTrainer` (local reference model) against `RemoteGRPOTrainer` with
   `ref_model_url` on a built-in server (`--no-ref-slot`: one copy of the model). Each run is a fresh subprocess
   (`--child RUN`), since a process's peak RSS only grows; it reports its own VmHWM. The server process is
   not counted: moving the reference out of the trainer is the point. Target: saving >= 0.8 x the reference
   model's parameter bytes (parameters x element size, counted in the stock run).
2. Seconds per step, remote / stock, mean over the steps after the first (warm-up). Target <= 1.1 (issue #13 aims
   at <= 0.9). The server computes the reference pass on the same cores while the trainer runs the policy's forward
   of the loss (the prefetched reference is collected after it): sharing the cores is part of the honest cost.

Beside them, rows that say where the ratio comes from: the remote run with `prefetch_reference=False` (the
reference asked in line, when TRL asks for it), and both trainers with `beta=0` (no reference at all: the limit a
remote reference could reach if it cost nothing). Every run also counts the CPU seconds per step of the trainer
process and of the server (`/proc`), and `(trainer + server CPU) / cores` is the step a perfect overlap of both on
this machine's cores would take: when the stock run already keeps the cores busy, moving the reference to a server
on the same cores cannot make the step shorter than that.

Both children, and the server's reference pass, run with the same torch thread count (`--threads`, default 1: the
trainer and the server each on a core of its own, as on a cluster where the server has GPUs of its own; with as many
threads as cores, both ask for every core and the overlap turns into contention, the `cores_bound` row's case); runs
alternate stock/remote across repeats and the table gives medians (and, as a cross-check robust to load spikes
from other work on the machine, the median of all timed steps). The model is built with `tools/make_tiny_model.py`
(`size="100m"`, ~104M parameters) into a temporary directory, or into `--model-dir`.

    python tools/bench_trainer.py [--quick] [--json FILE] [--model-dir DIR] [--threads N] [--runs KIND,...]

`--quick` (under a minute on 2 CPU cores) runs the tiny model, 2 steps, one run each: it checks the harness, and
its RSS saving is within noise (the tiny reference is ~0.4 MB). `--json FILE` also writes every figure under a
stable key, e.g. `trainer.rss_saving_fraction`, `trainer.seconds_per_step_ratio` (remote / stock),
`trainer.no_prefetch_seconds_per_step_ratio`, `trainer.beta0_seconds_per_step_ratio` (remote / stock, both beta=0),
`trainer.reference_free_limit_ratio` (stock beta=0 / stock), `trainer.<run>.cores_bound_seconds_per_step` and the
remote trainer's step-time parts in seconds, `trainer.<run>.part.timing/<part>` and `trainer.<run>.part.background/<name>`.
`--runs` picks a subset of the runs (e.g. `--runs stock,remote` while profiling); stock and remote are always run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (MIB, arithmetic_prompts, header, machine_facts, markdown_table, model_dir,  # noqa: E402
                          verdict, write_json)

SAVING_TARGET = 0.8  # of the reference's parameter bytes
STEP_TIME_TARGET = 1.1  # remote / stock
# The runs, each a fresh process: (trainer, beta, prefetch_reference). "remote" asks a server for the reference.
RUNS = {
    "stock": ("stock", 0.04, None),
    "remote": ("remote", 0.04, True),
    "remote_no_prefetch": ("remote", 0.04, False),
    "stock_beta0": ("stock", 0.0, None),
    "remote_beta0": ("remote", 0.0, None),
}


@dataclass(frozen=True)
class Setup:
    """Which model, how many optimizer steps per run (the first is warm-up), how many runs of each kind."""

    size: str
    steps: int
    repeats: int
    batch: int = 8  # completions per step: batch / generations prompts
    generations: int = 4
    completion_len: int = 16


FULL = Setup(size="100m", steps=8, repeats=2)
QUICK = Setup(size="tiny", steps=2, repeats=1)


# ------------------------------------------------------------------ child: one training run in a fresh process
def proc_status_bytes(field: str) -> int:
    """A `VmXXX` line of /proc/self/status, in bytes (VmHWM: peak resident set, VmRSS: current)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def train_settings(output_dir: Path, setup: Setup, beta: float) -> dict:
    return dict(output_dir=str(output_dir), per_device_train_batch_size=setup.batch, num_generations=setup.generations,
                max_completion_length=setup.completion_len, max_steps=setup.steps, beta=beta, learning_rate=1e-5,
                seed=42, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True)


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds of process `pid` so far, all its threads, from its CPU-time clock (clock_getcpuclockid): nanosecond
    resolution, where /proc/PID/stat counts 10 ms clock ticks, coarser than a --quick step's server work."""
    clock = ctypes.c_int()
    error = ctypes.CDLL("libc.so.6").clock_getcpuclockid(pid, ctypes.byref(clock))
    if error:
        raise OSError(error, f"clock_getcpuclockid({pid}): {os.strerror(error)}")
    return time.clock_gettime(clock.value)


def length_reward(completions, **kwargs) -> list[float]:
    return [len(c[0]["content"]) / 10.0 for c in completions]


def child(run: str, model: str, setup: Setup, threads: int, output_dir: Path, ref_url: Optional[str],
          server_pid: int) -> dict:
    """Train `setup.steps` steps of `RUNS[run]`; return peak RSS, RSS before training, per-step seconds and CPU
    seconds (this process, the server), losses and the step-time parts the remote trainer logs."""
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from open_r1_ext import RemoteGRPOConfig, RemoteGRPOTrainer
    from open_r1_ext.trainer.remote_trainer import RemoteReference

    class StepClock(TrainerCallback):
        """Wall time, this process's CPU time and the server's at the start and after each step."""

        def mark(self) -> tuple[float, float, float]:
            return time.perf_counter(), time.process_time(), process_cpu_seconds(server_pid)

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks = [self.mark()]

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(self.mark())

    torch.set_num_threads(threads)
    dataset = arithmetic_prompts(64)
    kind, beta, prefetch = RUNS[run]
    settings = train_settings(output_dir, setup, beta)
    if kind == "stock":
        args = GRPOConfig(**settings)
        trainer = GRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=dataset)
        reference = trainer.ref_model.parameters() if trainer.ref_model is not None else ()
        reference_bytes = sum(p.numel() * p.element_size() for p in reference)
    else:
        remote = {"ref_model_url": ref_url, "prefetch_reference": prefetch} if beta else {}
        args = RemoteGRPOConfig(**settings, **remote)
        trainer = RemoteGRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=dataset)
        if beta and not isinstance(trainer.ref_model, RemoteReference):
            raise RuntimeError(f"the remote run built a local reference: {type(trainer.ref_model).__name__}")
        reference_bytes = 0
    rss_after_init = proc_status_bytes("VmRSS")
    clock = StepClock()
    trainer.add_callback(clock)
    trainer.train()
    marks = clock.marks
    timed = [h for h in trainer.state.log_history if "step_wall_time" in h][1:]  # the remote trainer's, after step 1
    parts = sorted({key for h in timed for key in h if key.startswith(("timing/", "background/"))})
    return {
        "peak_rss_bytes": proc_status_bytes("VmHWM"),
        "rss_after_init_bytes": rss_after_init,
        "step_seconds": [b[0] - a[0] for a, b in zip(marks, marks[1:])],
        "cpu_seconds": [b[1] - a[1] for a, b in zip(marks, marks[1:])],
        "server_cpu_seconds": [b[2] - a[2] for a, b in zip(marks, marks[1:])],
        "parts": {key: statistics.mean(h.get(key, 0.0) for h in timed) for key in parts},
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "reference_param_bytes": reference_bytes,
        "torch_threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------- parent: the server, the runs, the table
def run_child(run: str, model: Path, setup: Setup, threads: int, output_dir: Path, server) -> dict:
    """`--child run` in a fresh interpreter; its result is the last line of its stdout."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", run, "--setup", json.dumps(asdict(setup)),
               "--model", str(model), "--threads", str(threads), "--out-dir", str(output_dir), "--ref-url", server.url,
               "--server-pid", str(server.process.pid)]
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if done.returncode != 0:
        raise RuntimeError(f"{run} run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(models_root: Path, work: Path, setup: Setup, threads: int, chosen: list[str]) -> dict:
    """The `chosen` runs against one built-in server, their order reversed on odd repeats."""
    from open_r1_ext.launch.local_server import BuiltinServer

    path = model_dir(models_root, setup.size)
    runs: dict[str, list[dict]] = {run: [] for run in chosen}
    server_args = ("--no-ref-slot", "--dtype", "float32", "--num-threads", str(threads))
    with BuiltinServer(str(path), extra_args=server_args, log_path=str(work / "server.log")) as server:
        for rep in range(setup.repeats):
            for run in chosen if rep % 2 == 0 else chosen[::-1]:
                runs[run].append(run_child(run, path, setup, threads, work / f"{run}-{rep}", server))
    return summarize(runs, setup)


def summarize(runs: dict[str, list[dict]], setup: Setup) -> dict:
    figures: dict = {"trainer.model": setup.size, "trainer.steps": setup.steps, "trainer.timed_steps": setup.steps - 1,
                     "trainer.repeats": setup.repeats, "trainer.completions_per_step": setup.batch,
                     "trainer.completion_len": setup.completion_len,
                     "trainer.torch_threads": runs["stock"][0]["torch_threads"]}
    cores = os.cpu_count() or 1
    for kind, results in runs.items():
        per_run = [statistics.mean(r["step_seconds"][1:]) for r in results]
        figures[f"trainer.{kind}.peak_rss_bytes"] = statistics.median(r["peak_rss_bytes"] for r in results)
        figures[f"trainer.{kind}.rss_after_init_bytes"] = statistics.median(r["rss_after_init_bytes"] for r in results)
        figures[f"trainer.{kind}.seconds_per_step"] = statistics.median(per_run)
        timed_steps = [t for r in results for t in r["step_seconds"][1:]]
        figures[f"trainer.{kind}.median_step_seconds"] = statistics.median(timed_steps)
        figures[f"trainer.{kind}.step_seconds"] = [r["step_seconds"] for r in results]
        for name in ("cpu_seconds", "server_cpu_seconds"):
            figures[f"trainer.{kind}.{name}_per_step"] = statistics.median(statistics.mean(r[name][1:]) for r in results)
        figures[f"trainer.{kind}.cores_bound_seconds_per_step"] = (
            figures[f"trainer.{kind}.cpu_seconds_per_step"] + figures[f"trainer.{kind}.server_cpu_seconds_per_step"]) / cores
        for part in sorted({part for r in results for part in r["parts"]}):
            figures[f"trainer.{kind}.part.{part}"] = statistics.median(r["parts"].get(part, 0.0) for r in results)
    reference = runs["stock"][0]["reference_param_bytes"]
    saving = figures["trainer.stock.peak_rss_bytes"] - figures["trainer.remote.peak_rss_bytes"]
    ratio = figures["trainer.remote.seconds_per_step"] / figures["trainer.stock.seconds_per_step"]
    figures.update({
        "trainer.reference_param_bytes": reference,
        "trainer.rss_saving_bytes": saving,
        "trainer.rss_saving_fraction": saving / reference,
        "trainer.rss_saving_target": SAVING_TARGET,
        "trainer.rss_saving_met": saving >= SAVING_TARGET * reference,
        "trainer.seconds_per_step_ratio": ratio,
        "trainer.seconds_per_step_target": STEP_TIME_TARGET,
        "trainer.seconds_per_step_met": ratio <= STEP_TIME_TARGET,
        "trainer.median_step_ratio": (figures["trainer.remote.median_step_seconds"]
                                      / figures["trainer.stock.median_step_seconds"]),
        "trainer.loss_max_abs_diff": max(abs(a - b) for s, r in zip(runs["stock"], runs["remote"])
                                         for a, b in zip(s["losses"], r["losses"])),
    })
    step = lambda run: figures[f"trainer.{run}.seconds_per_step"]  # noqa: E731
    if "remote_no_prefetch" in runs:
        figures["trainer.no_prefetch_seconds_per_step_ratio"] = step("remote_no_prefetch") / step("stock")
    if "stock_beta0" in runs:
        figures["trainer.reference_free_limit_ratio"] = step("stock_beta0") / step("stock")
    if {"stock_beta0", "remote_beta0"} <= runs.keys():
        figures["trainer.beta0_seconds_per_step_ratio"] = step("remote_beta0") / step("stock_beta0")
    return figures


def table(f: dict) -> str:
    mib = lambda key: f"{f[key] / MIB:,.0f} MiB"  # noqa: E731
    reference = f["trainer.reference_param_bytes"]
    init_saving = f["trainer.stock.rss_after_init_bytes"] - f["trainer.remote.rss_after_init_bytes"]
    rows = [
        ("peak RSS of the trainer process (VmHWM)", mib("trainer.stock.peak_rss_bytes"),
         mib("trainer.remote.peak_rss_bytes"),
         f"saving {f['trainer.rss_saving_bytes'] / MIB:,.0f} MiB = {f['trainer.rss_saving_fraction']:.2f} x reference "
         f"params ({reference / MIB:,.0f} MiB)", f">= {SAVING_TARGET:g} x reference params",
         verdict(f["trainer.rss_saving_met"])),
        ("RSS after trainer init, before step 1 (weights are mmapped, paged in at first use)",
         mib("trainer.stock.rss_after_init_bytes"), mib("trainer.remote.rss_after_init_bytes"),
         f"saving {init_saving / MIB:,.0f} MiB = {init_saving / reference:.2f} x", "-", "-"),
        (f"seconds per step (mean of steps 2..{f['trainer.steps']})", f"{f['trainer.stock.seconds_per_step']:.3f} s",
         f"{f['trainer.remote.seconds_per_step']:.3f} s", f"remote / stock {f['trainer.seconds_per_step_ratio']:.3f}",
         f"<= {STEP_TIME_TARGET:g}", verdict(f["trainer.seconds_per_step_met"])),
        ("median seconds of one step (steps 2.., all runs): robust to load spikes",
         f"{f['trainer.stock.median_step_seconds']:.3f} s", f"{f['trainer.remote.median_step_seconds']:.3f} s",
         f"remote / stock {f['trainer.median_step_ratio']:.3f}", "-", "-"),
        ("(trainer + server CPU seconds per step) / cores: a perfectly overlapped step on these cores",
         f"{f['trainer.stock.cores_bound_seconds_per_step']:.3f} s",
         f"{f['trainer.remote.cores_bound_seconds_per_step']:.3f} s",
         f"remote bound / stock {f['trainer.remote.cores_bound_seconds_per_step'] / f['trainer.stock.seconds_per_step']:.3f}",
         "-", "-"),
    ]
    if "trainer.no_prefetch_seconds_per_step_ratio" in f:
        rows.append(("seconds per step, reference not prefetched (prefetch_reference=False)",
                     f"{f['trainer.stock.seconds_per_step']:.3f} s",
                     f"{f['trainer.remote_no_prefetch.seconds_per_step']:.3f} s",
                     f"remote / stock {f['trainer.no_prefetch_seconds_per_step_ratio']:.3f}", "-", "-"))
    if "trainer.beta0_seconds_per_step_ratio" in f:
        rows.append(("seconds per step with beta=0 (no reference at all)",
                     f"{f['trainer.stock_beta0.seconds_per_step']:.3f} s",
                     f"{f['trainer.remote_beta0.seconds_per_step']:.3f} s",
                     f"remote / stock {f['trainer.beta0_seconds_per_step_ratio']:.3f}", "-", "-"))
    if "trainer.reference_free_limit_ratio" in f:
        rows.append(("the limit: stock beta=0 / stock beta=0.04 (a reference that cost nothing)",
                     f"{f['trainer.stock.seconds_per_step']:.3f} s", f"{f['trainer.stock_beta0.seconds_per_step']:.3f} s",
                     f"{f['trainer.reference_free_limit_ratio']:.3f}", "-", "-"))
    return markdown_table(("measurement", "stock (local ref)", "remote ref", "ratio / saving", "target", "met"), rows)


def parts_line(f: dict, run: str) -> str:
    """The remote trainer's step-time parts of `run` (means over steps 2..), longest first."""
    prefix = f"trainer.{run}.part."
    parts = sorted(((value, key[len(prefix):]) for key, value in f.items() if key.startswith(prefix)), reverse=True)
    return f"{run}: " + ", ".join(f"{name} {value:.3f} s" for value, name in parts if value >= 0.0005)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 steps, one run each (under a minute)")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure and ratio to this file")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="build the model here (and reuse it) instead of a temp dir")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of both trainer runs and of the server (default 1: a core each)")
    child_args = parser.add_argument_group("internal: one training run (started by the benchmark itself)")
    parser.add_argument("--runs", default=",".join(RUNS), type=lambda text: text.split(","),
                        help=f"comma-separated runs (of {', '.join(RUNS)}; stock and remote are always run)")
    child_args.add_argument("--child", choices=tuple(RUNS), default=None)
    child_args.add_argument("--setup", type=lambda text: Setup(**json.loads(text)), default=None)
    child_args.add_argument("--model", default=None)
    child_args.add_argument("--out-dir", type=Path, default=None)
    child_args.add_argument("--ref-url", default=None)
    child_args.add_argument("--server-pid", type=int, default=None)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.runs) - set(RUNS))
    if unknown:
        parser.error(f"--runs: unknown run(s) {', '.join(unknown)}; choose from {', '.join(RUNS)}")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.model, args.setup, args.threads, args.out_dir, args.ref_url,
                               args.server_pid)))
        return
    started = time.perf_counter()
    facts = machine_facts(args.quick)
    setup = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(prefix="bench_trainer-") as tmp:
        chosen = ["stock", "remote", *(run for run in RUNS if run in args.runs and run not in ("stock", "remote"))]
        figures = measure(args.model_dir or Path(tmp), Path(tmp), setup, args.threads, chosen)
    facts.update({"machine.load_average_1m_end": os.getloadavg()[0], "wall_s": time.perf_counter() - started})
    figures.update(facts)

    print(header(facts) + f", at end: {facts['machine.load_average_1m_end']:.2f}; wall time: {facts['wall_s']:.1f} s")
    print(f"model: {setup.size} ({figures['trainer.reference_param_bytes'] / MIB:,.1f} MiB of float32 parameters); "
          f"{setup.steps} steps per run (first = warm-up), {setup.repeats} run(s) of each, alternating; "
          f"{setup.batch // setup.generations} prompts x {setup.generations} completions of <= {setup.completion_len} "
          f"tokens per step, beta 0.04, local generation; torch threads per trainer and server: "
          f"{figures['trainer.torch_threads']}; reference server: built-in, --no-ref-slot, not counted in RSS; "
          f"losses stock vs remote differ by <= {figures['trainer.loss_max_abs_diff']:.1e}")
    print("step-time parts of the remote trainer (timing/* on the training thread, background/* beside it):")
    for run in chosen:
        if run.startswith("remote"):
            print("  " + parts_line(figures, run))
    print()
    print(table(figures))
    if args.json is not None:
        write_json(args.json, figures)


if __name__ == "__main__":
    main()
