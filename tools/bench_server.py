"""Benchmark the built-in server against what a trainer would do without it; prints a markdown table.

Two measurements, each taken side by side in one run (a warm-up call of each side, then repeats that alternate
which side goes first; medians are reported):

1. Reference log-probs: `SGLangClient.ref_logprobs` through a real built-in server subprocess (HTTP, JSON,
   the server's batcher) against the same forward in this process (transformers forward on the same float32
   weights, then the log-softmax of each next token, as `ModelEngine.score` computes it), on a batch of
   32 sequences x 256 tokens. Reported as tokens/s; target: HTTP / in-process >= 0.85. Done on the tiny model
   and on the ~100M-parameter config (`make_tiny_model(size="100m")`). The warm-up checks both give the same
   numbers. The server's batch window (`--max-batch-wait-ms`, 5 ms by default) only waits for requests already
   being received, so these lone requests do not wait it out.
2. Batched generation: 32 prompts sampled in one `client.generate` call against one request per prompt sent
   one after the other (what a naive client does), same sampling (seeded, temperature 1.0, `ignore_eos`, so
   every completion has the same length), on the tiny model. Reported in seconds; target: speedup >= 4.

Both sides of a comparison run on the same machine and never at the same time (every call is synchronous),
with the same torch thread count: `--threads N` here and `--num-threads N` for the server; by default the
server's own CPU default, half the cores (one on a 2-core machine). With more than one thread on a machine
shared with other jobs, OpenMP's spin-waiting makes timings erratic (a thread spins while the one it waits for
is descheduled): compare the load averages printed before and after. Models are built locally with
`tools/make_tiny_model.py` into a temporary directory, or into `--model-dir` to reuse them across runs. The
server runs without its `/ref` slot.

    python tools/bench_server.py [--quick] [--json FILE] [--model-dir DIR] [--threads N] [--max-batch-wait-ms MS]

`--quick` (under a minute on 2 CPU cores) keeps every measurement, on smaller batches (the 100M model on 2 x 64)
with fewer repeats (the table says which batch was used): it checks the harness only. `--json FILE` also writes every figure under
a stable key: `ref_logprobs.{tiny,100m}.{inprocess_tokens_per_s,http_tokens_per_s,ratio,target,met}`,
`generate.tiny.{sequential_s,batched_s,ratio,target,met}`, the timed samples of each side
(`*.baseline_samples_s`, `*.ours_samples_s`), and `machine.*` / `config.*`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import alternate, header, machine_facts, markdown_table, model_dir, verdict, write_json  # noqa: E402

from open_r1_ext.sglang_client import SGLangClient, served_vocabulary  # noqa: E402
from open_r1_ext.launch.local_server import BuiltinServer  # noqa: E402
from open_r1_ext.server.batcher import DEFAULT_MAX_WAIT_MS  # noqa: E402

REF_TARGET = 0.85
GENERATE_TARGET = 4.0


@dataclass(frozen=True)
class RefSetup:
    """One reference log-prob comparison: which model, what batch, how many timed repeats."""

    size: str
    batch: int
    seq_len: int
    repeats: int


@dataclass(frozen=True)
class GenerateSetup:
    """The batched-vs-sequential generation comparison."""

    prompts: int
    prompt_len: int
    max_new_tokens: int
    repeats: int


FULL_REF = (RefSetup("tiny", 32, 256, 7), RefSetup("100m", 32, 256, 3))
QUICK_REF = (RefSetup("tiny", 8, 128, 2), RefSetup("100m", 2, 64, 2))
FULL_GENERATE = GenerateSetup(prompts=32, prompt_len=16, max_new_tokens=32, repeats=3)
QUICK_GENERATE = GenerateSetup(prompts=8, prompt_len=16, max_new_tokens=8, repeats=1)


@dataclass
class Row:
    """One comparison; `key` prefixes its JSON figures (e.g. `ref_logprobs.tiny`)."""

    key: str
    measurement: str
    model: str
    baseline_name: str
    baseline: float
    ours_name: str
    ours: float
    unit: str
    ratio: float
    target: float
    baseline_samples_s: list[float]
    ours_samples_s: list[float]

    @property
    def met(self) -> bool:
        return self.ratio >= self.target

    def figures(self) -> dict:
        return {
            f"{self.key}.{self.baseline_name}": self.baseline,
            f"{self.key}.{self.ours_name}": self.ours,
            f"{self.key}.ratio": self.ratio,
            f"{self.key}.target": self.target,
            f"{self.key}.met": self.met,
            f"{self.key}.baseline_samples_s": self.baseline_samples_s,
            f"{self.key}.ours_samples_s": self.ours_samples_s,
        }


@torch.inference_mode()
def in_process_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """`log p(t_i | t_<i)` of each row: the forward the server runs (`ModelEngine.score`), without padding."""
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[:, :-1].float()
    return logits.gather(-1, ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def measure_ref_logprobs(client: SGLangClient, path: Path, setup: RefSetup) -> Row:
    """Reference log-prob throughput: HTTP through the built-in server vs the same forward in-process."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (setup.batch, setup.seq_len), generator=generator)
    sequences = ids.tolist()

    def over_http() -> list[torch.Tensor]:
        return client.ref_logprobs(sequences)

    def in_process() -> torch.Tensor:
        return in_process_logprobs(model, ids)

    torch.testing.assert_close(torch.stack(over_http()), in_process(), atol=1e-4, rtol=0)
    local_s, http_s = alternate(in_process, over_http, setup.repeats)
    tokens = setup.batch * setup.seq_len
    local_rate = tokens / statistics.median(local_s)
    http_rate = tokens / statistics.median(http_s)
    return Row(
        key=f"ref_logprobs.{setup.size}",
        measurement=f"ref log-probs {setup.batch}x{setup.seq_len}, tokens/s: in-process vs HTTP (median of {setup.repeats})",
        model=setup.size,
        baseline_name="inprocess_tokens_per_s",
        baseline=local_rate,
        ours_name="http_tokens_per_s",
        ours=http_rate,
        unit="tok/s",
        ratio=http_rate / local_rate,
        target=REF_TARGET,
        baseline_samples_s=local_s,
        ours_samples_s=http_s,
    )


def measure_generation(client: SGLangClient, vocab_size: int, setup: GenerateSetup) -> Row:
    """Wall time of `setup.prompts` prompts in one batched `generate` call vs one request per prompt in turn."""
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, vocab_size, (setup.prompts, setup.prompt_len), generator=generator).tolist()
    seeds = list(range(setup.prompts))
    sampling = {"max_new_tokens": setup.max_new_tokens, "temperature": 1.0, "ignore_eos": True}

    def check(completions) -> None:
        lengths = {len(c.token_ids) for per_prompt in completions for c in per_prompt}
        if len(completions) != setup.prompts or lengths != {setup.max_new_tokens}:
            raise RuntimeError(f"generate returned {len(completions)} prompts with lengths {sorted(lengths)}")

    def batched() -> None:
        check(client.generate(prompts, sampling, seeds=seeds))

    def sequential() -> None:
        check([client.generate([prompt], sampling, seeds=[seed])[0] for prompt, seed in zip(prompts, seeds)])

    batched()  # warm-up: one call of each shape
    client.generate(prompts[:1], sampling, seeds=seeds[:1])
    sequential_s, batched_s = alternate(sequential, batched, setup.repeats)
    sequential_median, batched_median = statistics.median(sequential_s), statistics.median(batched_s)
    return Row(
        key="generate.tiny",
        measurement=(
            f"generate {setup.prompts} prompts x {setup.max_new_tokens} new tokens, s: one request per prompt "
            f"vs one batched call (median of {setup.repeats})"
        ),
        model="tiny",
        baseline_name="sequential_s",
        baseline=sequential_median,
        ours_name="batched_s",
        ours=batched_median,
        unit="s",
        ratio=sequential_median / batched_median,
        target=GENERATE_TARGET,
        baseline_samples_s=sequential_s,
        ours_samples_s=batched_s,
    )


def run(models_root: Path, quick: bool, threads: int, batch_wait_ms: float) -> list[Row]:
    """Every measurement, model by model, each model served by its own built-in server subprocess."""
    server_args = ("--dtype", "float32", "--no-ref-slot", "--num-threads", str(threads),
                   "--max-batch-wait-ms", str(batch_wait_ms))
    rows = []
    for setup in QUICK_REF if quick else FULL_REF:
        path = model_dir(models_root, setup.size)
        with BuiltinServer(str(path), extra_args=server_args) as server:
            client = SGLangClient(server.url, max_retries=0)
            rows.append(measure_ref_logprobs(client, path, setup))
            if setup.size == "tiny":
                vocab_size = served_vocabulary(client.model_info())[0]
                rows.append(measure_generation(client, vocab_size, QUICK_GENERATE if quick else FULL_GENERATE))
    return rows


def format_figure(value: float, unit: str) -> str:
    return f"{value:,.0f} {unit}" if unit == "tok/s" else f"{value:.3f} {unit}"


def results_table(rows: list[Row]) -> str:
    return markdown_table(
        ("measurement", "model", "baseline", "ours", "ratio", "target", "met"),
        [(r.measurement, r.model, format_figure(r.baseline, r.unit), format_figure(r.ours, r.unit),
          f"{r.ratio:.2f}", f">= {r.target:g}", verdict(r.met)) for r in rows],
    )


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="finish in under a minute (smaller 100M batch, fewer repeats)")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this file")
    parser.add_argument("--model-dir", type=Path, default=None, help="build the models here (and reuse them) instead of a temp dir")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="torch threads here and in the server (default: the server's, half the cores: %(default)s)")
    parser.add_argument("--max-batch-wait-ms", type=float, default=DEFAULT_MAX_WAIT_MS,
                        help="the server's batch window (default: its default, %(default)s)")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    facts = machine_facts(args.quick)
    if args.model_dir is not None:
        rows = run(args.model_dir, args.quick, args.threads, args.max_batch_wait_ms)
    else:
        with tempfile.TemporaryDirectory(prefix="bench_server-") as tmp:
            rows = run(Path(tmp), args.quick, args.threads, args.max_batch_wait_ms)
    facts.update({
        "machine.load_average_1m_end": os.getloadavg()[0],
        "config.max_batch_wait_ms": args.max_batch_wait_ms,
        "wall_s": time.perf_counter() - started,
    })

    print(header(facts))
    print(f"load average at end: {facts['machine.load_average_1m_end']:.2f}; same torch threads in the server; "
          f"server --max-batch-wait-ms "
          f"{facts['config.max_batch_wait_ms']:g}; wall time: {facts['wall_s']:.1f} s")
    print()
    print(results_table(rows))
    if args.json is not None:
        figures = dict(facts)
        for row in rows:
            figures.update(row.figures())
        write_json(args.json, figures)


if __name__ == "__main__":
    main()
