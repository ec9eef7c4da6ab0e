"""The benchmarks in tools/ run end to end with `--quick --json` and write their figures.

Benchmarks are not timed tests: these check that each one runs and writes finite positive numbers under the
keys its docstring promises, never that a target is met.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO


def run_quick_bench(tool: str, json_path: Path) -> dict:
    """`python tools/<tool> --quick --json json_path`; the figures it wrote."""
    done = subprocess.run([sys.executable, str(REPO / "tools" / tool), "--quick", "--json", str(json_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{tool} --quick failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert "| measurement |" in done.stdout  # the table was printed
    return json.loads(json_path.read_text())


def assert_finite_positive(figures: dict, keys: list[str]) -> None:
    bad = {k: figures.get(k) for k in keys
           if not (isinstance(figures.get(k), (int, float)) and math.isfinite(figures[k]) and figures[k] > 0)}
    assert not bad, f"not finite positive numbers: {bad}"


def test_bench_trainer_quick_writes_json(tmp_path):
    figures = run_quick_bench("bench_trainer.py", tmp_path / "trainer.json")
    assert_finite_positive(figures, [
        "trainer.reference_param_bytes",
        "trainer.stock.peak_rss_bytes", "trainer.remote.peak_rss_bytes",
        "trainer.stock.rss_after_init_bytes", "trainer.remote.rss_after_init_bytes",
        "trainer.stock.seconds_per_step", "trainer.remote.seconds_per_step",
        "trainer.seconds_per_step_ratio", "trainer.rss_saving_target", "trainer.seconds_per_step_target",
        "machine.cpu_cores",
        # the rows beside them: no prefetch, beta=0 (no reference), CPU seconds and the perfect-overlap bound
        "trainer.no_prefetch_seconds_per_step_ratio", "trainer.beta0_seconds_per_step_ratio",
        "trainer.reference_free_limit_ratio",
        *(f"trainer.{run}.{name}" for run in ("stock", "remote", "remote_no_prefetch", "stock_beta0", "remote_beta0")
          for name in ("seconds_per_step", "cpu_seconds_per_step", "cores_bound_seconds_per_step")),
        "trainer.remote.server_cpu_seconds_per_step", "trainer.remote.part.timing/train",
        "trainer.remote.part.background/reference",
    ])
    # the tiny model of --quick holds a ~0.4 MB reference: its RSS saving is within noise, may even be negative
    assert math.isfinite(figures["trainer.rss_saving_bytes"]) and math.isfinite(figures["trainer.rss_saving_fraction"])
    assert isinstance(figures["trainer.rss_saving_met"], bool) and isinstance(figures["trainer.seconds_per_step_met"], bool)


def test_bench_sync_quick_writes_json(tmp_path):
    figures = run_quick_bench("bench_sync.py", tmp_path / "sync.json")
    parts = ["save_pretrained", "dump", "reload", "reload_load", "reload_copy", "total", "seal", "checksum", "fsync",
             "sealed_after"]
    assert_finite_positive(figures, [
        "sync.dump_bytes", "sync.ratio", "sync.target",
        *(f"sync.ours.{part}_s" for part in parts),
        *(f"sync.bare.{part}_s" for part in ("save", "load", "copy", "total")),
        "sync.disk.write_bytes_per_s", "sync.dump_write_bytes_per_s", "sync.dump_write_vs_disk",
        "sync.ratio_with_checksums_before_rename", "sync.ratio_with_seal_before_rename",
        "sync.ratio_with_sha256_before_rename",
        "sync.checksum.sha256_bytes_per_s", "sync.checksum.xxh3_128_bytes_per_s",
        "sync.zero3.model_bytes", "sync.zero3.two_writers_s", "sync.zero3.one_writer_s", "sync.zero3.writers_ratio",
        "machine.cpu_cores",
    ])
    assert isinstance(figures["sync.met"], bool)
    # ZeRO-3 on 2 ranks: a peak for each rank and bucket size (the tiny model's are within noise: finite, >= 0)
    for bucket in ("eighth", "quarter"):
        by_rank = figures[f"sync.zero3.bucket_{bucket}.peak_extra_fraction_by_rank"]
        assert len(by_rank) == figures["sync.zero3.ranks"] == 2 and all(math.isfinite(x) and x >= 0 for x in by_rank)
        assert figures[f"sync.zero3.bucket_{bucket}.peak_extra_fraction"] == max(by_rank)
    assert isinstance(figures["sync.zero3.memory_met"], bool) and isinstance(figures["sync.zero3.writers_met"], bool)
    # LoRA: an adapter-only sync vs the merged full dump of the same policy
    assert_finite_positive(figures, [f"sync.lora.{key}" for key in ("adapter_bytes", "merged_bytes", "bytes_ratio",
                                                                    "adapter_s", "merged_s", "seconds_ratio")])
    assert figures["sync.lora.adapter_bytes"] < figures["sync.lora.merged_bytes"]
    # the adapter in the request (/load_lora_adapter_from_tensors): its payload is the adapter in base64 (4/3 of it)
    assert_finite_positive(figures, ["sync.lora.tensors_bytes", "sync.lora.tensors_s", "sync.lora.tensors_vs_dump_bytes",
                                     "sync.lora.tensors_vs_dump_s"])
    assert figures["sync.lora.tensors_vs_dump_bytes"] > 1
    assert isinstance(figures["sync.lora.bytes_met"], bool) and isinstance(figures["sync.lora.seconds_met"], bool)
    # over the network (issue #22): nothing written to the sync directory, the disk rows beside it
    sides = ("disk_one", "disk_one_cold", "disk_two", "distributed_one", "distributed_two", "spanning_two")
    assert_finite_positive(figures, [*(f"sync.distributed.{side}_s" for side in sides), "sync.distributed.vs_disk",
                                     "sync.distributed.two_vs_one", "sync.distributed.spanning_vs_per_server",
                                     "sync.distributed.broadcast_bytes_per_s",
                                     "sync.distributed.zero3.bucket_eighth.peak_extra_fraction"])
    assert all(figures[f"sync.distributed.{side}_bytes_written"] == 0 for side in sides[3:])
    assert all(figures[f"sync.distributed.{side}_bytes_written"] > 0 for side in sides[:3])
    assert figures["sync.distributed.bytes_met"] is True and isinstance(figures["sync.distributed.seconds_met"], bool)


def test_bench_server_quick_writes_json(tmp_path):
    figures = run_quick_bench("bench_server.py", tmp_path / "x.json")
    ref = [f"ref_logprobs.{size}.{name}" for size in ("tiny", "100m")
           for name in ("ratio", "inprocess_tokens_per_s", "http_tokens_per_s", "target")]
    assert_finite_positive(figures, [*ref, "generate.tiny.ratio", "generate.tiny.sequential_s", "generate.tiny.batched_s",
                                     "generate.tiny.target", "machine.cpu_cores"])
    assert all(isinstance(figures[f"{key}.met"], bool) for key in ("ref_logprobs.tiny", "ref_logprobs.100m", "generate.tiny"))


def test_bench_async_quick_writes_json(tmp_path):
    figures = run_quick_bench("bench_async.py", tmp_path / "async.json")
    assert_finite_positive(figures, ["async.sync_seconds_per_step", "async.async_seconds_per_step", "async.ratio",
                                     "async.sync_generation_share", "async.machine_parallel_speedup",
                                     "async.best_ratio_on_this_machine", "machine.cpu_cores",
                                     "async.sync_rollout_chain_share", "async.ratio_over_best", "async.target_over_best",
                                     "async.last_round.sync.timing/generate", "async.last_round.sync.timing/reload_wait",
                                     "async.last_round.async.background/generate"])
    assert isinstance(figures["async.met"], bool) and isinstance(figures["async.host_busy"], bool)
    assert len(figures["async.round_ratio"]) == figures["async.rounds"] == 1
    assert figures["async.sync_generation_share"] < figures["async.sync_rollout_chain_share"] < 1
    # part 2: in-flight updates vs one-step async on the long-tailed workload
    assert_finite_positive(figures, [
        *(f"inflight.{side}_tokens_per_s" for side in ("sync", "one_step", "in_flight", "one_step_distributed",
                                                        "in_flight_distributed")),
        "inflight.speedup_vs_one_step", "inflight.speedup_min", "inflight.speedup_max", "inflight.target",
        "inflight.in_flight_vs_sync", "inflight.machine_parallel_speedup", "inflight.last_round.in_flight.timing/train",
        "inflight.last_round.in_flight.background/paused", "inflight.last_round.in_flight.background/reload",
        "inflight.last_round.one_step.background/generate", "inflight.last_round.sync.timing/generate",
        # the network transport (issue #34): the training thread stages the policy, the update thread broadcasts it
        # with the servers paused around it
        "inflight.distributed_speedup_vs_one_step", "inflight.distributed_vs_disk", "inflight.distributed_sync_vs_disk",
        "inflight.in_flight_sync_s", "inflight.in_flight_distributed_sync_s", "inflight.in_flight_paused_s",
        "inflight.in_flight_distributed_paused_s", "inflight.last_round.in_flight_distributed.timing/stage",
        "inflight.last_round.in_flight_distributed.background/paused"])
    assert "inflight.last_round.in_flight.timing/group_wait" in figures and isinstance(figures["inflight.met"], bool)
    assert isinstance(figures["inflight.distributed_met"], bool) and isinstance(figures["inflight.distributed_sync_met"], bool)
    # nothing dumped over the network: the distributed sides' training threads never wrote a dump
    assert "inflight.last_round.in_flight_distributed.timing/dump" not in figures
    assert figures["inflight.round_speedup_vs_one_step"] == [figures["inflight.speedup_vs_one_step"]]


def test_bench_pool_quick_writes_json(tmp_path):
    figures = run_quick_bench("bench_pool.py", tmp_path / "pool.json")
    assert_finite_positive(figures, [
        *(f"pool.generate.{name}" for name in ("one_tokens_per_s", "two_tokens_per_s", "speedup", "bound",
                                               "ratio_to_bound", "ratio_min", "ratio_max", "cache_bound",
                                               "ratio_to_cache_bound", "direct_tokens_per_s", "pool_vs_direct", "target")),
        "pool.sync.one_s", "pool.sync.two_s", "pool.sync.ratio", "pool.sync.target", "machine.cpu_cores",
    ])
    assert isinstance(figures["pool.generate.met"], bool) and isinstance(figures["pool.sync.met"], bool)
    samples = [figures[f"pool.generate.{name}"] for name in ("one_samples_s", "two_samples_s", "bound_samples",
                                                                  "cache_bound_samples", "direct_samples_s")]
    assert len({len(s) for s in samples}) == 1  # one of each per round
    assert figures["pool.generate.ratio_min"] <= figures["pool.generate.ratio_to_bound"] <= figures["pool.generate.ratio_max"]


def test_bench_dynamic_sampling_quick_writes_json(tmp_path):
    figures = run_quick_bench("bench_dynamic_sampling.py", tmp_path / "dynamic_sampling.json")
    modes = ("", "async.", "inflight.")
    sides = [f"{mode}{name}" for mode in modes for name in ("plain", "filtered")]
    assert_finite_positive(figures, [
        *(f"dynamic_sampling.{side}.{key}" for side in sides
          for key in ("steps", "wall_s", "generation_s_per_step", "rounds_per_step", "groups_generated_per_kept")),
        *(f"dynamic_sampling.{side}.requests_s_per_step" for side in sides[:4]),
        *(f"dynamic_sampling.{mode}{ratio}" for mode in modes
          for ratio in ("steps_ratio", "generation_ratio", "wall_ratio")), "machine.cpu_cores"])
    assert "dynamic_sampling.inflight.plain.requests_s_per_step" not in figures  # untimed in flight
    assert figures["dynamic_sampling.plain.groups_generated_per_kept"] == 1.0  # nothing filtered without the filter
    # every step of a plain side is one round; a filtered side's share of them is a fraction (none, in 2 steps, may be)
    assert all(figures[f"dynamic_sampling.{mode}plain.one_round_steps"] == 1.0 for mode in modes)
    assert_finite_positive(figures, [f"dynamic_sampling.{mode}plain.one_round_generation_s_per_step" for mode in modes])
    assert all(0.0 <= figures[f"dynamic_sampling.{mode}filtered.one_round_steps"] <= 1.0 for mode in modes)
    assert figures["dynamic_sampling.seeds"] == 1 and figures["dynamic_sampling.max_steps"] == 2
