"""Benchmark the built-in server against what a trainer would do without it; prints markdown tables.

Two measurements, each taken side by side in one run (a warm-up call of each side, then repeats that alternate
which side goes first; medians are reported):

1. Reference log-probs: `SGLangClient.ref_logprobs` through a real built-in server subprocess (HTTP, JSON,
   the server's batcher) against the same forward in this process (transformers forward on the same float32
   weights, then the log-softmax of each next token, as `ModelEngine.score` computes it), on a batch of
   32 sequences x 256 tokens. Reported as tokens/s; target: HTTP / in-process >= 0.85. Done on the tiny model
   and on the ~100M-parameter config (`make_tiny_model(size="100m")`). The warm-up checks both give the same
   numbers. A second table splits the HTTP overhead (HTTP time - in-process time) into the pure-Python work of
   the HTTP path, timed in this process on a request and a response of the real shape: request JSON and
   validation, FastAPI's `jsonable_encoder` of the response, response JSON and tensors; and the server's batch
   window (`--max-batch-wait-ms`), which every request waits out.
2. Batched generation: 32 prompts sampled in one `client.generate` call against one request per prompt sent
   one after the other (what a naive client does), same sampling (seeded, temperature 1.0, `ignore_eos`, so
   every completion has the same length), on the tiny model. Reported in seconds; target: speedup >= 4.

Both sides of a comparison run on the same machine and never at the same time (every call is synchronous),
with the same torch thread count: torch's default, which the server subprocess uses too, or `--threads N` for
both (it sets `OMP_NUM_THREADS`, which the server inherits). On a machine shared with other jobs, torch's
multi-threaded kernels slow down erratically when one of their threads is descheduled: compare the load
averages printed before and after. Models are built locally with `tools/make_tiny_model.py` into a temporary
directory, or into `--model-dir` to reuse them across runs. The server runs without its `/ref` slot.

    python tools/bench_server.py [--quick] [--json FILE] [--model-dir DIR] [--threads N] [--max-batch-wait-ms MS]

`--quick` (under a minute on 2 CPU cores) keeps every measurement but scores the 100M model on a batch of
2 x 256 with fewer repeats (the table says which batch was used). `--json FILE` also writes every figure under
a stable key: `ref_logprobs.{tiny,100m}.{inprocess_tokens_per_s,http_tokens_per_s,ratio,target,met}`,
`ref_logprobs.{tiny,100m}.overhead.*_s`, `generate.tiny.{sequential_s,batched_s,ratio,target,met}`, and
`machine.*` / `config.*`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import header, machine_facts, markdown_table, model_dir, verdict, write_json  # noqa: E402

from open_r1_ext.client import SGLangClient  # noqa: E402
from open_r1_ext.protocol import GenerateReqInput, logprob_entries  # noqa: E402
from open_r1_ext.server_process import BuiltinServer  # noqa: E402

REF_TARGET = 0.85
GENERATE_TARGET = 4.0
DEFAULT_BATCH_WAIT_MS = 5.0  # the default of `python -m open_r1_ext.serve --max-batch-wait-ms`


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
QUICK_REF = (RefSetup("tiny", 32, 256, 5), RefSetup("100m", 2, 256, 2))
FULL_GENERATE = GenerateSetup(prompts=32, prompt_len=16, max_new_tokens=32, repeats=3)
QUICK_GENERATE = GenerateSetup(prompts=32, prompt_len=16, max_new_tokens=32, repeats=1)


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
    overhead_s: dict[str, float] = field(default_factory=dict)

    @property
    def met(self) -> bool:
        return self.ratio >= self.target

    def figures(self) -> dict:
        figures = {
            f"{self.key}.{self.baseline_name}": self.baseline,
            f"{self.key}.{self.ours_name}": self.ours,
            f"{self.key}.ratio": self.ratio,
            f"{self.key}.target": self.target,
            f"{self.key}.met": self.met,
            f"{self.key}.baseline_samples_s": self.baseline_samples_s,
            f"{self.key}.ours_samples_s": self.ours_samples_s,
        }
        figures.update({f"{self.key}.overhead.{name}": value for name, value in self.overhead_s.items()})
        return figures


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_time(fn: Callable[[], object], repeats: int) -> float:
    return statistics.median(timed(fn) for _ in range(repeats))


def alternate(baseline: Callable[[], object], ours: Callable[[], object], repeats: int) -> tuple[list[float], list[float]]:
    """Time both `repeats` times, swapping which goes first each round so drift in machine load hits both."""
    times: dict[str, list[float]] = {"baseline": [], "ours": []}
    order = [("baseline", baseline), ("ours", ours)]
    for rep in range(repeats):
        for name, fn in order if rep % 2 == 0 else order[::-1]:
            times[name].append(timed(fn))
    return times["baseline"], times["ours"]


@torch.inference_mode()
def in_process_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """`log p(t_i | t_<i)` of each row: the forward the server runs (`ModelEngine.score`), without padding."""
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[:, :-1].float()
    return logits.gather(-1, ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def http_overhead_parts(sequences: list[list[int]], logprobs: torch.Tensor, repeats: int) -> dict[str, float]:
    """Seconds per call of the pure-Python work on the HTTP path, timed here on a request and a response of the
    shape `ref_logprobs` sends and gets back (SGLang's `input_token_logprobs` triples, one per token)."""
    from fastapi.encoders import jsonable_encoder

    body = {"input_ids": sequences, "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True, "logprob_start_len": 0}
    response = [
        {"text": "", "output_ids": [], "meta_info": {
            "id": None, "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": len(seq),
            "completion_tokens": 0, "cached_tokens": 0, "weight_version": "default",
            "input_token_logprobs": logprob_entries([None, *row.tolist()], seq), "output_token_logprobs": [],
        }}
        for seq, row in zip(sequences, logprobs)
    ]
    encoded = json.dumps(response)

    def request_json_and_validation() -> None:
        GenerateReqInput.model_validate(json.loads(json.dumps(body)))

    def response_json_and_tensors() -> None:
        json.dumps(response, separators=(",", ":"))
        [torch.tensor([e[0] for e in r["meta_info"]["input_token_logprobs"][1:]]) for r in json.loads(encoded)]

    return {
        "request_json_and_validation_s": median_time(request_json_and_validation, repeats),
        "response_jsonable_encoder_s": median_time(lambda: jsonable_encoder(response), repeats),
        "response_json_and_tensors_s": median_time(response_json_and_tensors, repeats),
    }


def measure_ref_logprobs(client: SGLangClient, path: Path, setup: RefSetup, batch_wait_ms: float) -> Row:
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

    expected = in_process()
    torch.testing.assert_close(torch.stack(over_http()), expected, atol=1e-4, rtol=0)
    local_s, http_s = alternate(in_process, over_http, setup.repeats)
    overhead = http_overhead_parts(sequences, expected, setup.repeats)
    overhead["batch_window_s"] = batch_wait_ms / 1000.0
    overhead["measured_s"] = statistics.median(http_s) - statistics.median(local_s)
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
        overhead_s=overhead,
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


def run(models_root: Path, quick: bool, batch_wait_ms: float) -> list[Row]:
    """Every measurement, model by model, each model served by its own built-in server subprocess."""
    server_args = ("--dtype", "float32", "--no-ref-slot", "--max-batch-wait-ms", str(batch_wait_ms))
    rows = []
    for setup in QUICK_REF if quick else FULL_REF:
        path = model_dir(models_root, setup.size)
        with BuiltinServer(str(path), extra_args=server_args) as server:
            client = SGLangClient(server.url, max_retries=0)
            rows.append(measure_ref_logprobs(client, path, setup, batch_wait_ms))
            if setup.size == "tiny":
                vocab_size = client.model_info()["vocab_size"]
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


def overhead_table(rows: list[Row]) -> str:
    def ms(seconds: float) -> str:
        return f"{seconds * 1000:.1f}"

    return markdown_table(
        ("model", "in-process (ms)", "HTTP (ms)", "HTTP - in-process (ms)", "request JSON + validation (ms)",
         "response jsonable_encoder (ms)", "response JSON + tensors (ms)", "batch window (ms)"),
        [(r.model, ms(statistics.median(r.baseline_samples_s)), ms(statistics.median(r.ours_samples_s)),
          ms(r.overhead_s["measured_s"]), ms(r.overhead_s["request_json_and_validation_s"]),
          ms(r.overhead_s["response_jsonable_encoder_s"]), ms(r.overhead_s["response_json_and_tensors_s"]),
          ms(r.overhead_s["batch_window_s"])) for r in rows if r.overhead_s],
    )


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="finish in under a minute (smaller 100M batch, fewer repeats)")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this file")
    parser.add_argument("--model-dir", type=Path, default=None, help="build the models here (and reuse them) instead of a temp dir")
    parser.add_argument("--threads", type=int, default=None, help="torch threads here and in the server (default: torch's)")
    parser.add_argument("--max-batch-wait-ms", type=float, default=DEFAULT_BATCH_WAIT_MS,
                        help="the server's batch window (default: its default, %(default)s)")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read by the server subprocess's torch at start-up
        torch.set_num_threads(args.threads)
    facts = machine_facts(args.quick)
    if args.model_dir is not None:
        rows = run(args.model_dir, args.quick, args.max_batch_wait_ms)
    else:
        with tempfile.TemporaryDirectory(prefix="bench_server-") as tmp:
            rows = run(Path(tmp), args.quick, args.max_batch_wait_ms)
    facts.update({
        "machine.load_average_1m_end": os.getloadavg()[0],
        "config.max_batch_wait_ms": args.max_batch_wait_ms,
        "wall_s": time.perf_counter() - started,
    })

    print(header(facts) + f", at end: {facts['machine.load_average_1m_end']:.2f}; "
          f"server --max-batch-wait-ms {facts['config.max_batch_wait_ms']:g}; wall time: {facts['wall_s']:.1f} s")
    print()
    print(results_table(rows))
    print()
    print("Where the HTTP time goes (per call; the parts are timed in this process on the real payloads):")
    print()
    print(overhead_table(rows))
    if args.json is not None:
        figures = dict(facts)
        for row in rows:
            figures.update(row.figures())
        write_json(args.json, figures)


if __name__ == "__main__":
    main()
