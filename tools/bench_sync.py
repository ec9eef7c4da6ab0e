"""Benchmark a weight sync (streamed dump + server reload) against a bare safetensors save + load, and the dump under
DeepSpeed ZeRO-3 with two processes (memory per rank, two writers vs one); prints markdown tables.

Side by side in one run, on the same float32 state dict of the ~100M-parameter model (`make_tiny_model(size="100m")`):

- bare: `safetensors.torch.save_file(state_dict)`, `load_file`, and copying the tensors into the model's parameters
  (the server copies into its parameters too);
- ours: what `WeightSync` does on the trainer's critical path: `WeightSync.dump` in one process (the policy in
  buckets of `bucket_mb`, default one shard here, each written with `save_file`; index, config, a manifest of file
  sizes written last, one rename), then
  `/update_weights_from_disk` over HTTP on a built-in server holding the same model (`--no-ref-slot`, this process's
  torch threads: it checks the manifest's sizes, loads, copies into its parameters). Then `seal_weight_dir`
  (xxh3-128 checksums into the manifest, fsync), which `WeightSync` runs on a background thread while training goes
  on: its parts and the time from the rename until the dump is sealed are reported, not counted in the total.

ZeRO-3 (2 gloo processes under `torch.distributed.run`, the model partitioned by `deepspeed.initialize`, the same
`WeightSync.dump` as the trainer's): the peak extra resident memory of a dump on each rank (`VmHWM` after resetting
it, minus `VmRSS` before; glibc's mmap threshold fixed at 64 kB so freed memory leaves), as a fraction of the model's
bytes, with buckets of 1/8 and of 1/4 of the model (target
<= 0.3 at 1/8); and the dump's wall time with both ranks writing their shards vs rank 0 writing all of them (same
buckets of 1/8, same gathers; target <= 0.75).

LoRA (r=16 on all linear layers, its B matrices made non-zero as after training), on the same server (started with
`--enable-lora`; its first adapter comes after the measurements above): a weight sync of the adapter alone
(`WeightSync` with `adapter_only`: dump + `/load_lora_adapter`, as the trainer pushes it) vs the merged full dump
of the same policy (dump + `/update_weights_from_disk`): bytes written and seconds per sync (targets <= 5% of the
bytes, <= 20% of the time), alternating, medians; beside them the adapter sent in the request, no file (issue #34:
gathered as for its dump, then `/load_lora_adapter_from_tensors`): the payload's bytes and seconds, against the
adapter dump's (`sync.lora.tensors_*`).

Over the network (`sync.transport: distributed`, issue #22; a second built-in server beside the first): seconds and
bytes written to the sync directory per sync of the same policy through `WeightSync`, to one replica and to a pool
of two, through the disk (dump + reload; also with the dump fsynced and dropped from the page cache before the
reload, so the server reads it from the disk: here the page cache makes the disk path cheap) and over the network
(gloo, flattened buckets, one group per server), and one group spanning both replicas (the topology not chosen),
in rotated rounds, medians (targets: 0 bytes; network / disk <= 1; two replicas / one <= 1.2); under ZeRO-3, the
peak extra memory of a send per rank (its shared buffer included). Keys `sync.distributed.*`.

Target: ours / bare <= 1.3. Each part of ours is reported (save, reload; the reload's steps are replayed in this
process on the same files to split it; the seal's checksums and fsync), with the throughput of other checksums on
the dump and what-if ratios (the checksums, or the whole seal, on the critical path before the rename; sha256
instead of xxh3), so the cost of each choice is visible.
Reads of a dump (issue 32), ours vs through a mapping, in rotated rounds, medians: a whole seal of a fresh dump
(written, not yet flushed, as `WeightSync` seals it: checksums + fsync, ours with the fsyncs on a thread beside the
checksums; the former seal: checksums through a mapping, then each fsync; target: ours within 10%), its checksums alone on
a dump in the page cache (`weight_files.checksum_of`: plain reads of 4 MiB into one buffer, xxh3's streaming API; the
former way: xxh3-128 of an mmap of the file, which a file that shrinks under it turns into SIGBUS), and the built-in
server's load of the shards with the copy into its parameters (`weight_files.read_shard`: the bytes read, then
`safetensors.torch.load`; the former way: `load_file`, a mapping).
The disk's sequential write bandwidth is measured in the same run (`dd bs=4M conv=fsync`-style, a file of the
dump's size) and set against the dump's write throughput (bytes / (save + fsync)).

Repeats alternate the order of the three (disk, bare, ours); each side starts after an untimed `sync`, so dirty
pages of the previous side are not written back inside it, and reads its files back right after writing them (as a
server does), with no `sync` in between. Medians are reported. Dumps go to a temporary
directory under /tmp, or under `--dir` (put it on the file system the dumps would use).

    python tools/bench_sync.py [--quick] [--reads] [--json FILE] [--dir DIR] [--model-dir DIR]

`--quick` (about a minute on 2 CPU cores) runs the tiny model (a ~0.4 MB dump), one round: it checks the
harness only. `--reads` measures the reads of a dump alone (`sync.reads.*`, 9 rounds). `--json FILE` writes every figure under a stable key, e.g. `sync.ratio`, `sync.ours.checksum_s` or
`sync.zero3.bucket_eighth.peak_extra_fraction`, `sync.lora.bytes_ratio` (`sync.ours.save_pretrained_s` is the shard writes: the name dates
from when a dump called `save_pretrained`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional

import torch
import xxhash
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import header, machine_facts, markdown_table, model_dir, rounds, verdict, write_json  # noqa: E402

from open_r1_ext import weight_broadcast, weight_files  # noqa: E402
from open_r1_ext.named_tensors import AdapterTensors  # noqa: E402
from open_r1_ext.protocol import init_weights_update_group_request, update_weights_from_distributed_request  # noqa: E402
from open_r1_ext.server_pool import ServerPool  # noqa: E402
from open_r1_ext.trainer import weight_sync  # noqa: E402
from open_r1_ext.sglang_client import SGLangClient  # noqa: E402
from open_r1_ext.launch.local_server import BuiltinServer, free_port  # noqa: E402

RATIO_TARGET = 1.3
DISTRIBUTED_TARGET = 1.0  # seconds per sync over the network / through the disk (page cache), one replica
REPLICAS_TARGET = 1.2  # seconds per sync over the network, two replicas / one
READS_TARGET = 1.1  # seconds of a seal (checksums + fsync): ours (plain reads) / the seal before issue 32 (a mapping)
READ_SIDES = ("seal_reads", "seal_mapped", "checksum_reads", "checksum_mapped", "load_reads", "load_mapped")
NETWORK_SIDES = ("disk_one", "disk_one_cold", "disk_two", "distributed_one", "distributed_two", "spanning_two")
MEMORY_TARGET = 0.3  # peak extra resident memory of a ZeRO-3 dump per rank / model bytes, buckets of 1/8
WRITERS_TARGET = 0.75  # ZeRO-3 dump wall time, two writers / one
LORA_RANK = 16
LORA_BYTES_TARGET, LORA_SECONDS_TARGET = 0.05, 0.20  # an adapter sync / the merged full sync of the same policy
LORA_FLAGS = ("--enable-lora", "--max-lora-rank", str(LORA_RANK), "--lora-target-modules", "all")
BUCKETS = {"eighth": 1 / 8, "quarter": 1 / 4}  # bucket sizes, as fractions of the model's bytes
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
         "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 2}
BLOCK = 4 << 20  # dd bs=4M
MB = 1e6
CHECKSUMS: dict[str, Callable[[], object]] = {
    "xxh3_128": xxhash.xxh3_128,  # what the manifest uses
    "sha256": hashlib.sha256,
    "blake2b": hashlib.blake2b,
    "sha1": hashlib.sha1,
}


@dataclass(frozen=True)
class Setup:
    """Which model's weights are synced, and how many alternating repeats the medians are taken over."""

    size: str
    repeats: int


FULL = Setup(size="100m", repeats=5)
QUICK = Setup(size="tiny", repeats=1)
READS = Setup(size="100m", repeats=9)


class Stopwatch:
    """Seconds per named phase, accumulated over calls."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def part(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            with self.part(name):
                return fn(*args, **kwargs)

        return timed


@contextlib.contextmanager
def timing_seal(watch: Stopwatch):
    """Time the checksums and fsyncs inside `seal_weight_dir` by wrapping the module functions it calls."""
    originals = {"checksum": weight_files.checksum_of, "fsync": weight_files._fsync}
    weight_files.checksum_of = watch.wrap("checksum", originals["checksum"])
    weight_files._fsync = watch.wrap("fsync", originals["fsync"])
    try:
        yield
    finally:
        weight_files.checksum_of, weight_files._fsync = originals["checksum"], originals["fsync"]


def copy_into(model, tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(tensors[name])


def bare(model, state: dict[str, torch.Tensor], work: Path) -> dict[str, float]:
    """`save_file` + `load_file` + copy into the parameters, each phase timed."""
    watch, path = Stopwatch(), work / "bare.safetensors"
    os.sync()
    with watch.part("save"):
        save_file(state, str(path))
    with watch.part("load"):
        tensors = load_file(str(path))
    with watch.part("copy"):
        copy_into(model, tensors)
    path.unlink()
    seconds = dict(watch.seconds)
    seconds["total"] = seconds["save"] + seconds["load"] + seconds["copy"]
    return seconds


@contextlib.contextmanager
def timing_shards(watch: Stopwatch):
    """Time the shard writes inside `WeightSync.dump` by wrapping the function it calls."""
    original = weight_sync.write_shard
    weight_sync.write_shard = watch.wrap("save_pretrained", original)
    try:
        yield
    finally:
        weight_sync.write_shard = original


def ours(model, sync: "weight_sync.WeightSync", work: Path, client: SGLangClient, rep: int) -> dict[str, float]:
    """`WeightSync.dump` + the server's reload over HTTP, then `seal_weight_dir` (which `WeightSync` runs in the
    background); then the reload's steps replayed here (manifest sizes, load, copy), untimed in the total, to show
    what the server spent its time on."""
    watch = Stopwatch()
    os.sync()
    with timing_shards(watch), watch.part("dump"):
        directory = sync.dump(model, rep)
    published = time.perf_counter()
    with watch.part("reload"):
        client.update_weights_from_disk(str(directory), weight_version=f"bench-{rep}")
    with timing_seal(watch), watch.part("seal"):
        weight_files.seal_weight_dir(directory)
    sealed_after = time.perf_counter() - published
    with watch.part("replay_manifest"):
        weight_files.check_manifest(directory, checksums=False)
    with watch.part("replay_load"):
        tensors = {k: v for shard in weight_files.safetensors_files(directory) for k, v in weight_files.read_shard(shard).items()}
    with watch.part("replay_copy"):
        copy_into(model, tensors)
    shutil.rmtree(directory)
    s = watch.seconds
    replay = s["replay_manifest"] + s["replay_load"] + s["replay_copy"]
    return {"save_pretrained": s["save_pretrained"], "other": s["dump"] - s["save_pretrained"], "dump": s["dump"],
            "reload": s["reload"], "reload_manifest": s["replay_manifest"], "reload_load": s["replay_load"],
            "reload_copy": s["replay_copy"], "reload_rest": s["reload"] - replay, "total": s["dump"] + s["reload"],
            "seal": s["seal"], "checksum": s["checksum"], "fsync": s["fsync"], "sealed_after": sealed_after}


def disk_write_bandwidth(work: Path, size: int) -> float:
    """Bytes/s of writing `size` bytes in 4 MiB blocks then fsync, like `dd bs=4M conv=fsync`."""
    block = memoryview(os.urandom(BLOCK))
    path = work / "dd.bin"
    os.sync()
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as handle:
        written = 0
        while written < size:
            written += handle.write(block[: min(BLOCK, size - written)])
        os.fsync(handle.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return size / seconds


def checksum_throughputs(work: Path, state: dict[str, torch.Tensor]) -> dict[str, float]:
    """Bytes/s of each checksum over a safetensors file of `state` (in the page cache), read in 4 MiB blocks."""
    path = work / "checksum.safetensors"
    save_file(state, str(path))
    size = path.stat().st_size
    rates = {}
    for name, factory in CHECKSUMS.items():
        digest = factory()
        start = time.perf_counter()
        with open(path, "rb") as handle:
            while block := handle.read(BLOCK):
                digest.update(block)
        digest.hexdigest()
        rates[name] = size / (time.perf_counter() - start)
    path.unlink()
    return rates


def mapped_checksum(path: Path) -> str:
    """xxh3-128 of a file through a mapping: how the seal hashed before issue 32 (SIGBUS if the file shrinks)."""
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        return xxhash.xxh3_128(mapped).hexdigest()


def seal_before_issue_32(directory: Path) -> None:
    """`weight_files.seal_weight_dir` as it was before issue 32: each file's checksum through a mapping, the
    manifest replaced, then every fsync in turn."""
    weight_files.check_manifest(directory, checksums=False)
    files = json.loads((directory / weight_files.MANIFEST).read_text())["files"]
    for name, entry in files.items():
        entry[weight_files.CHECKSUM] = mapped_checksum(directory / name)
    weight_files._write_manifest(directory, files)
    for path in [*(directory / name for name in sorted(files)), directory / weight_files.MANIFEST, directory,
                 directory.parent]:
        weight_files._fsync(path)


def read_figures(model, sync: "weight_sync.WeightSync", repeats: int) -> dict:
    """Seconds of the reads of one dump (in the page cache), ours vs through a mapping, in rotated rounds, medians:
    a whole seal (checksums + fsync) of a fresh dump (written and not yet flushed, as `WeightSync` seals it), the
    seal's checksums of every file alone, and the built-in server's load of the shards + copy into its parameters."""
    steps = iter(range(1, 1 << 20))

    def seal_s(seal: Callable[[Path], None]) -> float:
        fresh = sync.dump(model, next(steps))
        try:
            start = time.perf_counter()
            seal(fresh)
            return time.perf_counter() - start
        finally:
            shutil.rmtree(fresh)

    directory = sync.dump(model, 0)
    files = {directory / name: entry["size"] for name, entry in
             json.loads((directory / weight_files.MANIFEST).read_text())["files"].items()}
    shards = weight_files.safetensors_files(directory)
    assert [weight_files.checksum_of(path, size) for path, size in files.items()] == [mapped_checksum(p) for p in files]

    def timed_s(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    sides = {
        "seal_reads": lambda: seal_s(weight_files.seal_weight_dir),
        "seal_mapped": lambda: seal_s(seal_before_issue_32),
        "checksum_reads": lambda: timed_s(lambda: [weight_files.checksum_of(path, size) for path, size in files.items()]),
        "checksum_mapped": lambda: timed_s(lambda: [mapped_checksum(path) for path in files]),
        "load_reads": lambda: timed_s(lambda: [copy_into(model, weight_files.read_shard(p)) for p in shards]),
        "load_mapped": lambda: timed_s(lambda: [copy_into(model, load_file(str(p))) for p in shards]),
    }
    samples = dict(zip(READ_SIDES, rounds([sides[name] for name in READ_SIDES], repeats)))
    shutil.rmtree(directory)
    bytes_read = sum(files.values())
    figures: dict = {"sync.reads.bytes": bytes_read, "sync.reads.repeats": repeats}
    for name, values in samples.items():
        figures[f"sync.reads.{name}_s"] = statistics.median(values)
        figures[f"sync.reads.{name}_samples_s"] = values
        figures[f"sync.reads.{name}_bytes_per_s"] = bytes_read / statistics.median(values)
    ratio = figures["sync.reads.seal_reads_s"] / figures["sync.reads.seal_mapped_s"]
    figures.update({"sync.reads.seal_ratio": ratio, "sync.reads.seal_target": READS_TARGET,
                    "sync.reads.seal_met": ratio <= READS_TARGET,
                    "sync.reads.checksum_ratio": figures["sync.reads.checksum_reads_s"] / figures["sync.reads.checksum_mapped_s"],
                    "sync.reads.load_ratio": figures["sync.reads.load_reads_s"] / figures["sync.reads.load_mapped_s"]})
    return figures


def reads_table(f: dict) -> str:
    """The rows of `read_figures`."""
    r, mb = "sync.reads", f["sync.reads.bytes"] / MB

    def row(what: str, ours: str, mapped: str, ratio: float, target: str, met: str) -> tuple:
        return (what, f"{f[f'{r}.{ours}_s']:.3f} s ({f[f'{r}.{ours}_bytes_per_s'] / MB:,.0f} MB/s)",
                f"{f[f'{r}.{mapped}_s']:.3f} s ({f[f'{r}.{mapped}_bytes_per_s'] / MB:,.0f} MB/s)", f"{ratio:.2f}",
                target, met, " ".join(f"{x:.3f}" for x in f[f"{r}.{ours}_samples_s"]) + " / "
                + " ".join(f"{x:.3f}" for x in f[f"{r}.{mapped}_samples_s"]))

    return markdown_table(
        (f"reads of a {mb:,.1f} MB dump in the page cache (median of {f[f'{r}.repeats']})", "plain reads (ours)",
         "through a mapping (before)", "ratio", "target", "met", "samples, ours / before (s)"),
        [row("seal of a fresh dump: xxh3-128 of every file + fsync", "seal_reads", "seal_mapped", f[f"{r}.seal_ratio"],
             f"<= {READS_TARGET:g}", verdict(f[f"{r}.seal_met"])),
         row("... its checksums alone (the dump in the page cache)", "checksum_reads", "checksum_mapped",
             f[f"{r}.checksum_ratio"], "-", "-"),
         row("built-in server: load the shards + copy into the parameters", "load_reads", "load_mapped",
             f[f"{r}.load_ratio"], "-", "-")])


def measure_reads(models_root: Path, work: Path, setup: Setup) -> dict:
    """`--reads`: `read_figures` alone, on the model of `setup` dumped by `WeightSync` as in a run."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir(models_root, setup.size), dtype=torch.float32)
    sync = weight_sync.WeightSync(Accelerator(cpu=True), str(work), 0, str(work / "weight_sync.jsonl"), [])
    return {"sync.model": setup.size, **read_figures(model, sync, setup.repeats)}


def measure(models_root: Path, work: Path, setup: Setup) -> dict:
    from transformers import AutoModelForCausalLM
    from accelerate import Accelerator

    path = model_dir(models_root, setup.size)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    dump_bytes = sum(t.numel() * t.element_size() for t in state.values())
    runs: dict[str, list[dict]] = {"bare": [], "ours": [], "disk": []}
    # one torch thread per server: each replica on a core of its own, as on separate allocations (two servers with two
    # threads each beside the trainer and the broadcaster oversubscribe 2 cores: OpenMP pools spinning against each
    # other made the two-replica network sync 1.0-3.7 x one, 40 s of system time in a run)
    server_args = ("--no-ref-slot", "--dtype", "float32", "--num-threads", "1")
    sync = weight_sync.WeightSync(Accelerator(cpu=True), str(work), 0, str(work / "weight_sync.jsonl"), [])
    second = BuiltinServer(str(path), extra_args=server_args, log_path=str(work / "server-b.log"))
    starting = threading.Thread(target=second.start)  # the second replica of the network rows, started meanwhile
    starting.start()
    try:
        with BuiltinServer(str(path), extra_args=(*server_args, *LORA_FLAGS), log_path=str(work / "server.log")) as server:
            client = SGLangClient(server.url, max_retries=0)
            for rep in range(setup.repeats):
                sides = [("disk", lambda: {"bytes_per_s": disk_write_bandwidth(work, dump_bytes)}),
                         ("bare", lambda: bare(model, state, work)), ("ours", lambda: ours(model, sync, work, client, rep))]
                for name, side in sides if rep % 2 == 0 else sides[::-1]:
                    runs[name].append(side())
            starting.join()
            reads = read_figures(model, sync, setup.repeats)
            network = network_figures(model, work, [server.url, second.url], setup.repeats)
            lora = lora_figures(path, work, client, setup.repeats)
            zero3 = zero3_figures(path, work, setup.repeats, server.url)
    finally:
        starting.join()
        second.stop()
    figures = summarize(runs, checksum_throughputs(work, state), dump_bytes, setup)
    figures.update(reads)
    figures.update(network)
    figures.update(lora)
    figures.update(zero3)
    return figures


# ------------------------------------------------------------------------------------------- over the network
def network_figures(model, work: Path, urls: list[str], repeats: int) -> dict:
    """Seconds and bytes written to the sync directory per sync, side by side in rotated rounds (`bench_common.rounds`),
    medians: `WeightSync.sync` through the disk (dump + reload; and "cold": the dump fsynced and dropped from the
    page cache before the reload, so the server reads it from the disk, as a server on another node would from a
    shared file system) and through the network (`sync.transport: distributed`, gloo: one group per server), to one
    replica and to a pool of two; beside them one group spanning both replicas (one broadcast for both)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    one, two = SGLangClient(urls[0], max_retries=0), ServerPool(urls, replica_max_retries=0)
    disk = weight_sync.WeightSync(accelerator, str(work / "disk"), 0, str(work / "disk.jsonl"), [])
    sent = weight_sync.WeightSync(accelerator, str(work / "sent"), 0, str(work / "sent.jsonl"), [],
                                  network=weight_sync.NetworkTransport("gloo"))  # one broadcaster, one group per server
    syncs = {name: sent if name.startswith(("distributed", "spanning")) else disk for name in NETWORK_SIDES}
    targets = {name: weight_sync.SyncTarget("generation", two if name.endswith("two") else one,
                                            distributed=name.startswith("distributed"))
               for name in NETWORK_SIDES if name != "spanning_two"}
    spanning = SpanningGroup(urls, sent.sender({url: SGLangClient(url) for url in urls}).broadcaster)  # its child too
    steps = iter(range(1, 1 << 20))

    def side(name: str) -> Callable[[], tuple[float, int]]:
        def run() -> tuple[float, int]:
            step, sync = next(steps), syncs[name]
            start = time.perf_counter()
            if name == "spanning_two":
                spanning.send(sync, model, str(step))
            elif name == "disk_one_cold":
                path = sync.dump(model, step)
                evict(path)
                error = sync.publish([targets[name]], path, step)
            else:
                error = sync.sync(model, step, [targets[name]])
            seconds = time.perf_counter() - start
            if name != "spanning_two" and error is not None:
                raise SystemExit(f"{name}: {error}")
            sync.wait_durable()  # the seal of a dump runs beside training: not counted, not left to run into the next
            written = sum(f.stat().st_size for f in sync.sync_dir.rglob("*") if f.is_file())
            shutil.rmtree(sync.sync_dir, ignore_errors=True)
            return seconds, written
        return run

    parts = [side(name) for name in NETWORK_SIDES]
    for part in parts:  # warm-up: the broadcaster's start, the groups' formation, first-call costs
        part()
    results = dict(zip(NETWORK_SIDES, rounds(parts, repeats)))
    sent.close()
    figures: dict = {"sync.distributed.bytes_per_sync_model": sum(p.numel() * p.element_size() for p in model.parameters())}
    for name, samples in results.items():
        figures[f"sync.distributed.{name}_s"] = statistics.median(s for s, _ in samples)
        figures[f"sync.distributed.{name}_samples_s"] = [s for s, _ in samples]
        figures[f"sync.distributed.{name}_bytes_written"] = statistics.median(b for _, b in samples)
    f = figures
    f["sync.distributed.vs_disk"] = f["sync.distributed.distributed_one_s"] / f["sync.distributed.disk_one_s"]
    f["sync.distributed.vs_disk_cold"] = f["sync.distributed.distributed_one_s"] / f["sync.distributed.disk_one_cold_s"]
    f["sync.distributed.two_vs_one"] = f["sync.distributed.distributed_two_s"] / f["sync.distributed.distributed_one_s"]
    f["sync.distributed.disk_two_vs_one"] = f["sync.distributed.disk_two_s"] / f["sync.distributed.disk_one_s"]
    f["sync.distributed.spanning_vs_per_server"] = f["sync.distributed.spanning_two_s"] / f["sync.distributed.distributed_two_s"]
    f["sync.distributed.broadcast_bytes_per_s"] = f["sync.distributed.bytes_per_sync_model"] / f["sync.distributed.distributed_one_s"]
    f["sync.distributed.disk_bytes_per_s"] = f["sync.distributed.bytes_per_sync_model"] / f["sync.distributed.disk_one_cold_s"]
    f.update({"sync.distributed.seconds_target": DISTRIBUTED_TARGET, "sync.distributed.replicas_target": REPLICAS_TARGET,
              "sync.distributed.bytes_met": f["sync.distributed.distributed_one_bytes_written"] == 0
              and f["sync.distributed.distributed_two_bytes_written"] == 0,
              "sync.distributed.seconds_met": f["sync.distributed.vs_disk"] <= DISTRIBUTED_TARGET,
              "sync.distributed.replicas_met": f["sync.distributed.two_vs_one"] <= REPLICAS_TARGET})
    return f


def evict(directory: Path) -> None:
    """Write a dump's files to the disk and drop them from the page cache (this file's pages only): the next read
    comes from the disk."""
    for path in directory.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


class SpanningGroup:
    """The topology not chosen, for comparison: one group spanning both replicas (world size 3, the replicas at
    rank_offset 1 and 2), each bucket one broadcast reaching both; the same walk, routes and broadcaster (a third
    group in its child) as `WeightBroadcast`."""

    NAME = "open_r1_ext-bench-spanning"

    def __init__(self, urls: list[str], broadcaster: "weight_broadcast.Broadcaster"):
        self.clients = [SGLangClient(url, max_retries=0) for url in urls]
        self.broadcaster = broadcaster
        self.formed = False

    def _post(self, client: SGLangClient, route: str, body: dict) -> dict:
        answer = client.post_once(route, body, timeout=120.0)
        if not answer.get("success"):
            raise SystemExit(f"{client.base_url}{route}: {answer.get('message')}")
        return answer

    def _each(self, route: str, bodies: list[dict]) -> None:
        with ThreadPoolExecutor(len(self.clients)) as threads:
            list(threads.map(lambda cb: self._post(cb[0], route, cb[1]), zip(self.clients, bodies)))

    def _form(self) -> None:
        world = 1 + len(self.clients)
        port = self.broadcaster.call("form", self.NAME, 0, world, "gloo", 120.0, None, deadline_s=30.0)
        bodies = [init_weights_update_group_request("127.0.0.1", port, rank, world, self.NAME, "gloo")
                  for rank in range(1, world)]
        with ThreadPoolExecutor(1) as thread:
            joined = thread.submit(self._each, "/init_weights_update_group", bodies)
            self.broadcaster.answer("forming the spanning group")
            joined.result()
        self.formed = True

    def send(self, sync: "weight_sync.WeightSync", model, version: str) -> None:
        if not self.formed:
            self._form()
        weights = weight_sync.PolicyWeights(sync.accelerator, model, sync.bucket_bytes)
        self._each("/begin_weight_update", [{}] * len(self.clients))

        def take(index: int, tensors: dict) -> None:
            layout = weight_broadcast.layout_of(tensors)
            weight_broadcast.flatten_into(self.broadcaster.ensure_buffer(layout.nbytes), tensors, layout)
            last = index == len(weights.buckets) - 1
            body = update_weights_from_distributed_request(layout.names, layout.dtypes, layout.shapes, self.NAME,
                                                           version if last else f"{version}-partial", flush_cache=last)
            with ThreadPoolExecutor(1) as thread:
                updated = thread.submit(self._each, "/update_weights_from_distributed", [body] * len(self.clients))
                errors = self.broadcaster.call("broadcast", [self.NAME], layout.nbytes)
                updated.result()
            if errors[self.NAME]:
                raise SystemExit(f"spanning broadcast: {errors[self.NAME]}")

        sync.walk(weights, lambda index: True, take)
        self._each("/end_weight_update", [{}] * len(self.clients))



# ------------------------------------------------------------------------------------------------------------ LoRA
def lora_figures(path: Path, work: Path, client: SGLangClient, repeats: int) -> dict:
    """An adapter-only sync vs the merged full sync of the same LoRA policy, on the server of `client`: bytes
    written, seconds (dump + the server's load), medians of `repeats` alternating runs."""
    import peft
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                peft.LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.01)
    target = weight_sync.SyncTarget("generation", client, adapter=True)
    sides = {"adapter": weight_sync.WeightSync(Accelerator(cpu=True), str(work / "adapter"), 0, str(work / "log"), [],
                                               adapter_only=True),
             "merged": weight_sync.WeightSync(Accelerator(cpu=True), str(work / "merged"), 0, str(work / "log"), [])}
    runs: dict[str, list[tuple[int, float]]] = defaultdict(list)

    def tensors_sync(rep: int) -> AdapterTensors:
        """The adapter in the request (`/load_lora_adapter_from_tensors`), no file; what was sent."""
        weights = weight_sync.AdapterWeights(sides["adapter"].accelerator, model, sides["adapter"].bucket_bytes)
        sent = AdapterTensors.of(weights.gather_all(read=True), weights.config_dict())
        client.load_lora_adapter_from_tensors(f"tensors-{rep}", sent)
        return sent

    for rep in range(repeats):
        for name in (*sides, "tensors") if rep % 2 == 0 else ("tensors", *list(sides)[::-1]):
            os.sync()
            start = time.perf_counter()
            if name == "tensors":
                sent = tensors_sync(rep)
                runs[name].append((len(sent.serialized), time.perf_counter() - start))
                client.unload_lora_adapter(f"tensors-{rep}")
                continue
            directory = sides[name].dump(model, rep)
            if name == "adapter":
                sides[name].push(target, directory, str(rep))
            else:
                client.update_weights_from_disk(str(directory), weight_version=f"lora-bench-{rep}")
            seconds = time.perf_counter() - start
            runs[name].append((sum(f.stat().st_size for f in directory.iterdir()), seconds))
            shutil.rmtree(directory)
    figures: dict = {"sync.lora.rank": LORA_RANK}
    for name in (*sides, "tensors"):
        figures[f"sync.lora.{name}_bytes"] = statistics.median(b for b, _ in runs[name])
        figures[f"sync.lora.{name}_s"] = statistics.median(s for _, s in runs[name])
    figures["sync.lora.bytes_ratio"] = figures["sync.lora.adapter_bytes"] / figures["sync.lora.merged_bytes"]
    figures["sync.lora.seconds_ratio"] = figures["sync.lora.adapter_s"] / figures["sync.lora.merged_s"]
    # the adapter sent in the request vs its dump (bytes sent vs bytes written, seconds each)
    figures["sync.lora.tensors_vs_dump_bytes"] = figures["sync.lora.tensors_bytes"] / figures["sync.lora.adapter_bytes"]
    figures["sync.lora.tensors_vs_dump_s"] = figures["sync.lora.tensors_s"] / figures["sync.lora.adapter_s"]
    figures.update({"sync.lora.bytes_target": LORA_BYTES_TARGET, "sync.lora.seconds_target": LORA_SECONDS_TARGET,
                    "sync.lora.bytes_met": figures["sync.lora.bytes_ratio"] <= LORA_BYTES_TARGET,
                    "sync.lora.seconds_met": figures["sync.lora.seconds_ratio"] <= LORA_SECONDS_TARGET})
    return figures


# ----------------------------------------------------------------------------------------------- ZeRO-3, 2 ranks
def zero3_figures(path: Path, work: Path, repeats: int, url: str) -> dict:
    """Run `zero3_worker` in 2 gloo processes (sending to the server at `url`); its figures."""
    out = work / "zero3.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
               __file__, "--zero3-worker", str(path), str(work), str(repeats), str(out), url]
    # glibc returns every block of 64 kB or more to the system when it is freed (its default threshold grows to 32 MB
    # as blocks are freed, and freed blocks below it stay resident and are reused unseen): resident memory is then
    # what is live, and each dump's peak is its own, whatever ran before it
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, torch.get_num_threads() // 2)), TOKENIZERS_PARALLELISM="false",
               MALLOC_MMAP_THRESHOLD_="65536", PYTHONFAULTHANDLER="1")
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"the ZeRO-3 workers failed:\n{done.stderr[-5000:]}")
    return json.loads(out.read_text())


class ZeroThreeAccelerator:
    """accelerate's `Accelerator` on CPU (gloo) as `WeightSync` sees the trainer's under DeepSpeed ZeRO-3 (this
    harness builds the engine with `deepspeed.initialize` itself): its state names stage 3, and `unwrap_model`
    returns the engine's module."""

    def __init__(self, accelerator):
        self._accelerator = accelerator
        self.state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3))

    def __getattr__(self, name):
        return getattr(self._accelerator, name)

    def unwrap_model(self, engine):
        return engine.module


def peak_extra_rss(fn: Callable[[], object]) -> int:
    """Bytes of resident memory at the peak of `fn()` above where it started (Linux: VmHWM reset by clear_refs)."""

    def status(field: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
        return int(line.split()[1]) * 1024

    Path("/proc/self/clear_refs").write_text("5")  # resets the high-water mark to the current RSS
    before = status("VmRSS")
    fn()
    return status("VmHWM") - before


def zero3_worker(path: Path, work: Path, repeats: int, out: Path, url: str) -> None:
    """One of 2 ranks: the policy partitioned by ZeRO-3; `WeightSync.dump` with buckets of each size (peak extra
    memory), then with buckets of 1/8 written by both ranks or by rank 0 alone (wall time); one `WeightSync.send` to
    the server at `url` with buckets of 1/8 (peak extra memory, its shared buffer included). Rank 0 writes `out`."""
    import deepspeed
    from accelerate import Accelerator
    from accelerate.utils import gather_object
    from transformers import AutoModelForCausalLM

    accelerator = ZeroThreeAccelerator(Accelerator(cpu=True))  # the gloo process group
    deepspeed.init_distributed(dist_backend="gloo")
    engine, *_ = deepspeed.initialize(model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), config=ZERO3)
    model_bytes = sum(p.ds_numel * p.element_size() for p in engine.module.parameters())
    sync_dir = work / "zero3"

    def syncer(fraction: float) -> weight_sync.WeightSync:
        return weight_sync.WeightSync(accelerator, str(sync_dir), 0, str(sync_dir / "log"), [],
                                      bucket_mb=model_bytes * fraction / 1e6)

    def dump(sync, step: int) -> float:
        accelerator.wait_for_everyone()
        start = time.perf_counter()
        sync.dump(engine, step)
        seconds = time.perf_counter() - start
        if accelerator.is_main_process:
            shutil.rmtree(sync_dir / f"step-{step}")
        return seconds

    dump(syncer(BUCKETS["eighth"]), repeats)  # warm-up: first-call allocations and imports are not a dump's cost
    mine: dict[str, list[float]] = defaultdict(list)
    for rep in range(repeats):
        for name, fraction in BUCKETS.items():
            sync = syncer(fraction)
            mine[f"{name}.peak_extra_fraction"].append(peak_extra_rss(lambda: dump(sync, rep)) / model_bytes)
        order = (2, 1) if rep % 2 == 0 else (1, 2)
        for writers in order:
            original = weight_sync.shard_writer
            if writers == 1:  # the one-writer baseline: every shard to rank 0 (same buckets, same gathers)
                weight_sync.shard_writer = lambda index, world: 0
            try:
                mine[f"writers_{writers}_s"].append(dump(syncer(BUCKETS["eighth"]), rep))
            finally:
                weight_sync.shard_writer = original
    # a send, once (a new broadcaster: its start is no part of the peak, its shared buffer is)
    sender = syncer(BUCKETS["eighth"])
    sender.network = weight_sync.NetworkTransport("gloo")
    target = weight_sync.SyncTarget("generation", SGLangClient(url, max_retries=0), distributed=True)
    if accelerator.is_main_process:
        sender.sender({url: target.client}).broadcaster.start()
    accelerator.wait_for_everyone()
    mine["send.peak_extra_fraction"].append(peak_extra_rss(lambda: sender.send(engine, repeats, target)) / model_bytes)
    sender.close()
    ranks = gather_object([dict(mine)])
    if accelerator.is_main_process:
        out.write_text(json.dumps(zero3_summary(ranks, model_bytes)))
    leave(accelerator)


def leave(accelerator) -> None:
    """End a ZeRO-3 worker once its figures are written: both ranks leave together (none exits while the other still
    works), the process group is destroyed, and the process exits without the interpreter's teardown of the gloo and
    DeepSpeed objects. A rank of torch 2.13 aborted at its end, "terminate called without an active exception", in
    two suite runs, once with the group still up and once with it destroyed while the other rank still wrote these
    figures; neither was reproduced (57 runs of this worker or a cut-down copy and 12 of the whole benchmark, quiet or
    beside two busy loops), so this removes the likeliest cause, not a proven one. Every figure is written by then:
    nothing is lost by skipping the teardown. PYTHONFAULTHANDLER (`zero3_figures`) prints every thread's stack should
    a rank abort anyway."""
    accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def zero3_summary(ranks: list[dict], model_bytes: int) -> dict:
    """The figures of `zero3_worker` from each rank's measurements (rank 0's wall times)."""
    figures: dict = {"sync.zero3.ranks": len(ranks), "sync.zero3.model_bytes": model_bytes}
    for name in BUCKETS:
        by_rank = [statistics.median(r[f"{name}.peak_extra_fraction"]) for r in ranks]
        figures[f"sync.zero3.bucket_{name}.peak_extra_fraction_by_rank"] = by_rank
        figures[f"sync.zero3.bucket_{name}.peak_extra_fraction"] = max(by_rank)
    by_rank = [statistics.median(r["send.peak_extra_fraction"]) for r in ranks]
    figures["sync.distributed.zero3.bucket_eighth.peak_extra_fraction_by_rank"] = by_rank
    figures["sync.distributed.zero3.bucket_eighth.peak_extra_fraction"] = max(by_rank)
    figures["sync.zero3.memory_target"] = MEMORY_TARGET
    figures["sync.zero3.memory_met"] = figures["sync.zero3.bucket_eighth.peak_extra_fraction"] <= MEMORY_TARGET
    two, one = (statistics.median(ranks[0][f"writers_{n}_s"]) for n in (2, 1))
    figures.update({"sync.zero3.two_writers_s": two, "sync.zero3.one_writer_s": one, "sync.zero3.writers_ratio": two / one,
                    "sync.zero3.writers_target": WRITERS_TARGET, "sync.zero3.writers_met": two / one <= WRITERS_TARGET})
    return figures


def summarize(runs: dict[str, list[dict]], checksums: dict[str, float], dump_bytes: int, setup: Setup) -> dict:
    figures: dict = {"sync.model": setup.size, "sync.repeats": setup.repeats, "sync.dump_bytes": dump_bytes}
    for side in ("bare", "ours"):
        for part in runs[side][0]:
            figures[f"sync.{side}.{part}_s"] = statistics.median(r[part] for r in runs[side])
        figures[f"sync.{side}.total_samples_s"] = [r["total"] for r in runs[side]]
    ours_s, bare_s = figures["sync.ours.total_s"], figures["sync.bare.total_s"]
    disk = statistics.median(r["bytes_per_s"] for r in runs["disk"])
    dump_write = statistics.median(dump_bytes / (r["save_pretrained"] + r["fsync"]) for r in runs["ours"])
    sha256_s = dump_bytes / checksums["sha256"]  # one pass, timed on the same file

    def what_if(**extra: Callable[[dict], float]) -> float:
        """ours / bare with seconds added to each repeat's total."""
        return statistics.median(r["total"] + sum(fn(r) for fn in extra.values()) for r in runs["ours"]) / bare_s

    figures.update({
        "sync.ratio": ours_s / bare_s,
        "sync.target": RATIO_TARGET,
        "sync.met": ours_s / bare_s <= RATIO_TARGET,
        "sync.disk.write_bytes_per_s": disk,
        "sync.dump_write_bytes_per_s": dump_write,
        "sync.dump_write_vs_disk": dump_write / disk,
        "sync.ratio_with_checksums_before_rename": what_if(checksum=lambda r: r["checksum"]),
        "sync.ratio_with_seal_before_rename": what_if(seal=lambda r: r["seal"]),
        "sync.ratio_with_sha256_before_rename": what_if(sha256=lambda r: sha256_s),
    })
    figures.update({f"sync.checksum.{name}_bytes_per_s": rate for name, rate in checksums.items()})
    return figures


def tables(f: dict) -> str:
    ours_s, n = f["sync.ours.total_s"], f["sync.repeats"]
    main = markdown_table(
        ("measurement", "bare safetensors", "ours (dump + reload)", "ratio", "target", "met"),
        [
            (f"save/dump + load/reload of {f['sync.dump_bytes'] / MB:,.1f} MB, s (median of {n})",
             f"{f['sync.bare.total_s']:.3f} s", f"{ours_s:.3f} s", f"{f['sync.ratio']:.2f}", f"<= {RATIO_TARGET:g}",
             verdict(f["sync.met"])),
            ("write throughput, MB/s: disk (4 MiB blocks + fsync) vs dump (save + fsync)",
             f"disk {f['sync.disk.write_bytes_per_s'] / MB:,.0f}", f"dump {f['sync.dump_write_bytes_per_s'] / MB:,.0f}",
             f"{f['sync.dump_write_vs_disk']:.2f}", "-", "-"),
        ],
    )
    parts = [
        ("ours", "shards (save_file per bucket)", "save_pretrained"),
        ("ours", "the rest: walking the buckets, index, config files, manifest of sizes, rename", "other"),
        ("ours", "reload over HTTP (server: manifest sizes, load, copy)", "reload"),
        ("ours", "... its manifest check (replayed here on the same files)", "reload_manifest"),
        ("ours", "... its read of the shards, read_shard (replayed here)", "reload_load"),
        ("ours", "... its copy into the parameters (replayed here)", "reload_copy"),
        ("ours", "... the rest: HTTP, queueing (a median of differences: < 0 is noise)", "reload_rest"),
        ("bare", "save_file", "save"),
        ("bare", "load_file", "load"),
        ("bare", "copy into the parameters", "copy"),
    ]
    components = markdown_table(
        ("side", "component", "seconds (median)", "share of ours' total"),
        [(side, what, f"{f[f'sync.{side}.{key}_s']:.3f}", f"{f[f'sync.{side}.{key}_s'] / ours_s:.0%}")
         for side, what, key in parts],
    )
    background = (f"Off the critical path (not in the total; `WeightSync` seals on a background thread after the "
                  f"reload while training goes on): seal {f['sync.ours.seal_s']:.3f} s = xxh3-128 of every file "
                  f"{f['sync.ours.checksum_s']:.3f} s + fsync of every file and the directory "
                  f"{f['sync.ours.fsync_s']:.3f} s; the dump was sealed {f['sync.ours.sealed_after_s']:.3f} s after "
                  f"it was published (the sync is logged then).")
    rates = ", ".join(f"{name} {f[f'sync.checksum.{name}_bytes_per_s'] / MB:,.0f}" for name in CHECKSUMS)
    what_if = (f"Checksum throughput on the dump, MB/s: {rates}. What-if ratios (ours / bare): xxh3-128 checksums "
               f"before the rename {f['sync.ratio_with_checksums_before_rename']:.2f}; the whole seal (checksums and "
               f"fsync) before the rename {f['sync.ratio_with_seal_before_rename']:.2f}; sha256 checksums before the "
               f"rename {f['sync.ratio_with_sha256_before_rename']:.2f}.")
    zero3 = markdown_table(
        ("ZeRO-3, 2 gloo processes", "measured", "target", "met"),
        [(f"peak extra resident memory per rank / model bytes, buckets of 1/8 (by rank: "
          f"{', '.join(f'{x:.2f}' for x in f['sync.zero3.bucket_eighth.peak_extra_fraction_by_rank'])})",
          f"{f['sync.zero3.bucket_eighth.peak_extra_fraction']:.2f}", f"<= {MEMORY_TARGET:g}", verdict(f["sync.zero3.memory_met"])),
         (f"the same, buckets of 1/4 (by rank: "
          f"{', '.join(f'{x:.2f}' for x in f['sync.zero3.bucket_quarter.peak_extra_fraction_by_rank'])})",
          f"{f['sync.zero3.bucket_quarter.peak_extra_fraction']:.2f}", "-", "-"),
         (f"dump wall time, two writers / one ({f['sync.zero3.two_writers_s']:.3f} s / {f['sync.zero3.one_writer_s']:.3f} s)",
          f"{f['sync.zero3.writers_ratio']:.2f}", f"<= {WRITERS_TARGET:g}", verdict(f["sync.zero3.writers_met"]))],
    )
    lora = markdown_table(
        (f"LoRA r={f['sync.lora.rank']}, all linear layers: one sync", "adapter only", "merged full dump", "ratio",
         "target", "met"),
        [("bytes written", f"{f['sync.lora.adapter_bytes'] / MB:,.2f} MB", f"{f['sync.lora.merged_bytes'] / MB:,.1f} MB",
          f"{f['sync.lora.bytes_ratio']:.3f}", f"<= {LORA_BYTES_TARGET:g}", verdict(f["sync.lora.bytes_met"])),
         ("seconds (dump + the server's load, median)", f"{f['sync.lora.adapter_s']:.3f} s",
          f"{f['sync.lora.merged_s']:.3f} s", f"{f['sync.lora.seconds_ratio']:.2f}", f"<= {LORA_SECONDS_TARGET:g}",
          verdict(f["sync.lora.seconds_met"]))],
    )
    lora_tensors = markdown_table(
        (f"LoRA r={f['sync.lora.rank']}: the adapter in the request (/load_lora_adapter_from_tensors)", "tensors",
         "adapter dump", "ratio"),
        [("bytes sent (the request's payload) / written", f"{f['sync.lora.tensors_bytes'] / MB:,.2f} MB",
          f"{f['sync.lora.adapter_bytes'] / MB:,.2f} MB", f"{f['sync.lora.tensors_vs_dump_bytes']:.2f}"),
         ("seconds (gather + the server's load; dump + the server's load, median)", f"{f['sync.lora.tensors_s']:.3f} s",
          f"{f['sync.lora.adapter_s']:.3f} s", f"{f['sync.lora.tensors_vs_dump_s']:.2f}")],
    )
    return (f"{main}\n\n{components}\n\n{background}\n\n{what_if}\n\n{reads_table(f)}\n\n{zero3}\n\n{lora}\n\n"
            f"{lora_tensors}\n\n{network_table(f)}")


def network_table(f: dict) -> str:
    """The rows of `network_figures`: seconds and bytes written per sync, through the disk and over the network."""
    d, n = "sync.distributed", f["sync.repeats"]

    def row(what: str, key: str) -> tuple:
        return (what, f"{f[f'{d}.{key}_s']:.3f} s", f"{f[f'{d}.{key}_bytes_written'] / MB:,.1f} MB",
                " ".join(f"{x:.3f}" for x in f[f"{d}.{key}_samples_s"]))

    rows = [row("disk: dump + reload, one replica (page cache)", "disk_one"),
            row("disk, the dump read back from the disk (fsynced, dropped from the page cache)", "disk_one_cold"),
            row("disk, two replicas (a pool)", "disk_two"),
            row("network (gloo, flattened buckets), one replica", "distributed_one"),
            row("network, two replicas, one group each (what the trainer does)", "distributed_two"),
            row("network, two replicas, one group spanning both", "spanning_two")]
    table = markdown_table((f"one sync of {f[f'{d}.bytes_per_sync_model'] / MB:,.1f} MB (median of {n})", "seconds",
                            "written to the sync directory", "samples (s)"), rows)
    ratios = markdown_table(
        ("network transport", "measured", "target", "met"),
        [("bytes written per sync", f"{f[f'{d}.distributed_one_bytes_written']:.0f}", "0", verdict(f[f"{d}.bytes_met"])),
         ("seconds per sync / disk's (page cache); / disk's (read from the disk)",
          f"{f[f'{d}.vs_disk']:.2f}; {f[f'{d}.vs_disk_cold']:.2f}", f"<= {DISTRIBUTED_TARGET:g}", verdict(f[f"{d}.seconds_met"])),
         ("two replicas / one (disk: " f"{f[f'{d}.disk_two_vs_one']:.2f})", f"{f[f'{d}.two_vs_one']:.2f}",
          f"<= {REPLICAS_TARGET:g}", verdict(f[f"{d}.replicas_met"])),
         ("spanning group / one group per server, two replicas", f"{f[f'{d}.spanning_vs_per_server']:.2f}", "-", "-"),
         ("ZeRO-3, 2 processes: peak extra memory of a send per rank / model bytes, buckets of 1/8 (by rank: "
          f"{', '.join(f'{x:.2f}' for x in f[f'{d}.zero3.bucket_eighth.peak_extra_fraction_by_rank'])}; the shared "
          "buffer included)", f"{f[f'{d}.zero3.bucket_eighth.peak_extra_fraction']:.2f}", "-", "-")])
    return f"{table}\n\n{ratios}"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, one round (under a minute)")
    parser.add_argument("--reads", action="store_true",
                        help="only the reads of a dump (the seal's checksums, the built-in server's load), ours vs "
                             "through a mapping: 100M model, 9 rounds")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure and ratio to this file")
    parser.add_argument("--dir", type=Path, default=None,
                        help="write the dumps under this directory (default: a temp dir in /tmp)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="build the model here (and reuse it) instead of a temp dir")
    parser.add_argument("--zero3-worker", nargs=5, metavar=("MODEL", "WORK", "REPEATS", "OUT", "URL"), default=None,
                        help=argparse.SUPPRESS)  # one rank of the ZeRO-3 measurement (run under torch.distributed.run)
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.zero3_worker is not None:
        model, work, repeats, out, url = args.zero3_worker
        zero3_worker(Path(model), Path(work), int(repeats), Path(out), url)
        return
    started = time.perf_counter()
    facts = machine_facts(args.quick)
    setup = QUICK if args.quick else READS if args.reads else FULL
    with tempfile.TemporaryDirectory(prefix="bench_sync-", dir=args.dir) as tmp:
        work = Path(tmp)
        figures = (measure_reads if args.reads else measure)(args.model_dir or work, work, setup)
    facts.update({"machine.load_average_1m_end": os.getloadavg()[0], "wall_s": time.perf_counter() - started})
    figures.update(facts)
    figures["config.dir"] = str(args.dir or tempfile.gettempdir())

    print(header(facts) + f", at end: {facts['machine.load_average_1m_end']:.2f}; wall time: {facts['wall_s']:.1f} s")
    if args.reads:
        print(f"model: {setup.size}; dumps under {figures['config.dir']}; {setup.repeats} rounds, rotated; float32")
        print()
        print(reads_table(figures))
    else:
        print(f"model: {setup.size}; dumps under {figures['config.dir']}; {setup.repeats} repeats, alternating; "
              "server: built-in, --no-ref-slot, --enable-lora, float32")
        print()
        print(tables(figures))
    if args.json is not None:
        write_json(args.json, figures)


if __name__ == "__main__":
    main()
