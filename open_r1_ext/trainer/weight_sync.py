"""Weight sync: dump the policy atomically to a shared directory and have servers reload it.

Every rank calls `WeightSync.sync`. The dump `<sync_dir>/step-<N>/` is a sharded transformers directory
(`model-0000k-of-0000n.safetensors`, its index, config, manifest; merged LoRA): the policy is walked in buckets of
at most `bucket_mb` (gathered bucket by bucket under DeepSpeed ZeRO-3, a collective), each bucket one shard, and
every rank writes its share of the shards into one temporary directory; the main process publishes it (one rename,
see `weight_files`) once all are written, calls `/update_weights_from_disk` on each target server and checks the
version it then reports. Outcomes are shared, so every rank stops together, with the same message, on a failure
anywhere, instead of hanging at a barrier; a failed dump is removed, never published. With `adapter_only` (a LoRA
policy) the dump is the adapter alone, a PEFT directory (`adapter_model.safetensors`, `adapter_config.json`,
manifest) read in the same buckets, and a target with `adapter` loads it under the name `policy-v<N>`
(`/load_lora_adapter`), unloading the names it no longer needs.

The dump is published (renamed into place) before it is sealed. Once the servers confirmed it, a background thread
seals it (checksums into its manifest, fsync) while training goes on, not during the reload (a concurrent flush
slowed the reload by ~50% here), then appends the sync to `<output_dir>/weight_sync.jsonl` and prunes old dumps:
the log, what a resumed run reloads (after checking the checksums), names only sealed dumps on stable storage.
`wait_durable` drains that work: before the next dump, before a checkpoint, and when training ends.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import shutil
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

import torch

from open_r1_ext.named_tensors import AdapterTensors
from open_r1_ext.server_pool import ServerPool, load_adapter
from open_r1_ext.sglang_client import ServerError, ServerRequestError, SGLangClient
from open_r1_ext.weight_broadcast import (DEFAULT_TIMEOUT_S, StagedBucket, WeightBroadcast, WeightUpdate,
                                          resolve_backend, stage)
from open_r1_ext.weight_files import (DEFAULT_BUCKET_MB, WeightFileError, check_manifest, is_disk_full, publish,
                                      remove_temporary_dirs, seal_weight_dir, shard_name, temporary_dir, write_index,
                                      write_shard)

logger = logging.getLogger(__name__)
STEP_PREFIX = "step-"
ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"  # as `PeftModel.save_pretrained`


class WeightSyncError(ServerError):
    """A server did not take new weights; training stops rather than sample from stale ones."""


class WeightDumpError(WeightSyncError):
    """A weight dump could not be written (e.g. the disk is full); nothing of it was published."""


def describe_write_error(path: Path, error: BaseException, where: str = "") -> str:
    """One line for a failed dump: the path, 'no space left on device' when that is the cause, the error."""
    place = f"{path} ({where})" if where else str(path)
    if is_disk_full(error):
        return (f"could not write the weight dump {place}: no space left on device ({type(error).__name__}: {error}); "
                f"free space under {path.parent} or set sync.sync_dir to a larger file system")
    return f"could not write the weight dump {place}: {type(error).__name__}: {error}"


@dataclass
class SyncTarget:
    """A server that reloads the policy: its role, client, soft-update alpha, and what it last confirmed.

    With `adapter`, it loads adapter dumps under versioned names instead of replacing its weights, keeping the
    newest `keep_adapters` of the names it loaded (`loaded`, oldest first) and unloading older ones."""

    role: str
    client: SGLangClient
    mixup_alpha: Optional[float] = None
    version: Optional[str] = None
    path: Optional[Path] = None
    step: Optional[int] = None
    adapter: bool = False
    keep_adapters: int = 1
    loaded: list[str] = field(default_factory=list)
    distributed: bool = False  # sent over the network (`WeightSync.send`), not dumped
    sent: Optional[AdapterTensors] = None  # `distributed` with `adapter`: the adapter last confirmed, kept to send again

    def version_for(self, step: int) -> str:
        return str(step) if self.role == "generation" else f"ref-{step}"

    def confirmed_by(self) -> Optional[list[str]]:
        """With a pool of servers, the replicas that hold what this target last confirmed (its weight version, or
        that version's adapter); None for one server."""
        if not isinstance(self.client, ServerPool):
            return None
        if self.adapter:
            return self.client.replicas_holding(adapter_name(self.version))
        return self.client.replicas_at(self.version)

    def reload_extra(self) -> dict:
        """The extra fields of its `/update_weights_from_disk` calls: the soft update's `mixup_alpha`, if any."""
        return {} if self.mixup_alpha in (None, 1.0) else {"mixup_alpha": self.mixup_alpha}


def adapter_name(version: str) -> str:
    """The name a LoRA adapter dump of weight version `version` is loaded and sampled under."""
    return f"policy-v{version}"


@dataclass
class Bucket:
    """Consecutive tensors of the policy that are gathered and written together, as one shard of the dump."""

    names: list[str]  # the names the model holds them under
    nbytes: int


class PolicyWeights:
    """The policy's tensors under the names a server loads, read one bucket at a time.

    Buckets hold at most `bucket_bytes` (a tensor larger than that is a bucket of its own). Under DeepSpeed ZeRO-3
    `gathered(bucket)` gathers only that bucket's parameters, a collective every rank enters in the same order;
    otherwise every rank holds every weight and reads its buckets alone. With PEFT the served tensors are the base
    model's, LoRA merged in (base weight + each active adapter's delta, computed aside: the model is not touched).
    """

    def __init__(self, accelerator, model, bucket_bytes: int):
        unwrapped = accelerator.unwrap_model(model)
        plugin = getattr(accelerator.state, "deepspeed_plugin", None)
        self.zero3 = plugin is not None and plugin.zero_stage == 3
        self.peft = hasattr(unwrapped, "get_base_model")
        self.peft_model = unwrapped
        self.model = unwrapped.get_base_model() if self.peft else unwrapped
        self.tensors = self._tensors()
        self.buckets = self._plan(bucket_bytes)

    def _tensors(self) -> dict[str, torch.Tensor]:
        """Parameters (a tied one once) and persistent buffers, by the name the model holds them under; LoRA's own
        parameters and the frozen originals of `modules_to_save` are not served."""
        ignored = set(getattr(self.model, "_keys_to_ignore_on_save", None) or ())
        tensors = {name: param for name, param in self.model.named_parameters()
                   if not (self.peft and ("lora_" in name or ".original_module." in name))}
        for module_name, module in self.model.named_modules():
            for name, buffer in module.named_buffers(recurse=False):
                if buffer is not None and name not in module._non_persistent_buffers_set:
                    tensors[f"{module_name}.{name}" if module_name else name] = buffer
        return {name: tensor for name, tensor in tensors.items() if name not in ignored}

    def _nbytes(self, tensor: torch.Tensor) -> int:
        return getattr(tensor, "ds_numel", tensor.numel()) * tensor.element_size()

    def _plan(self, bucket_bytes: int) -> list[Bucket]:
        buckets: list[Bucket] = []
        for name, tensor in self.tensors.items():
            size = self._nbytes(tensor)
            if not buckets or (buckets[-1].nbytes + size > bucket_bytes and buckets[-1].names):
                buckets.append(Bucket([], 0))
            buckets[-1].names.append(name)
            buckets[-1].nbytes += size
        return buckets

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def _lora_layer(self, name: str):
        """The LoRA layer whose frozen base weight `name` is (its bias is not adapted), or None."""
        if not self.peft or not name.endswith(".base_layer.weight"):
            return None
        return self.model.get_submodule(name.removesuffix(".base_layer.weight"))

    @contextlib.contextmanager
    def gathered(self, bucket: Bucket, read: bool, device: str = "cpu") -> Iterator[dict[str, torch.Tensor]]:
        """The bucket's tensors on `device` under their served names (when `read`; else `{}`), gathered under ZeRO-3
        for the time of the block (every rank enters it, reading or not)."""
        gather = contextlib.nullcontext()
        if self.zero3:
            import deepspeed

            gather = deepspeed.zero.GatheredParameters(self._gathered_params(bucket), modifier_rank=None)
        with gather, torch.no_grad():
            yield self._read(bucket, device) if read else {}

    def _gathered_params(self, bucket: Bucket) -> list[torch.nn.Parameter]:
        """What a bucket gathers under ZeRO-3: its parameters and the LoRA parameters merged into them."""
        params = [self.tensors[n] for n in bucket.names if isinstance(self.tensors[n], torch.nn.Parameter)]
        return params + [p for name in bucket.names if (layer := self._lora_layer(name)) is not None
                         for n, p in layer.named_parameters() if "lora_" in n]

    def _read(self, bucket: Bucket, device: str) -> dict[str, torch.Tensor]:
        from transformers.core_model_loading import revert_weight_conversion

        # the checkpoint's names and layout where transformers converts on load (e.g. fused experts); else as is
        served = {served_name(name): self._served(self.tensors[name], self._lora_layer(name), device)
                  for name in bucket.names}
        return revert_weight_conversion(self.model, served)

    @staticmethod
    def _served(tensor: torch.Tensor, layer, device: str) -> torch.Tensor:
        if layer is not None and not layer.merged:
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    tensor = tensor + layer.get_delta_weight(adapter)
        return tensor.detach().to(device).contiguous()


class AdapterWeights(PolicyWeights):
    """The active LoRA adapter of a PEFT policy alone, read one bucket at a time like the policy (gathered under
    ZeRO-3), under the names `PeftModel.save_pretrained` writes (peft's `get_peft_model_state_dict`), so that peft's
    and SGLang's loaders read the dump."""

    def __init__(self, accelerator, model, bucket_bytes: int):
        self.adapter = accelerator.unwrap_model(model).active_adapter
        super().__init__(accelerator, model, bucket_bytes)

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {name: param for name, param in self.peft_model.named_parameters()
                if "lora_" in name and f".{self.adapter}." in name}

    def _gathered_params(self, bucket: Bucket) -> list[torch.nn.Parameter]:
        return [self.tensors[name] for name in bucket.names]

    def _read(self, bucket: Bucket, device: str) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        # copies: under ZeRO-3 the gathered storage goes with the bucket, and the file is written after the last one
        tensors = {name: self.tensors[name].detach().to("cpu", copy=True).contiguous() for name in bucket.names}
        return get_peft_model_state_dict(self.peft_model, state_dict=tensors, adapter_name=self.adapter,
                                         save_embedding_layers=False)

    def gather_all(self, read: bool) -> dict[str, torch.Tensor]:
        """The whole adapter, its buckets read in turn (copies, on the CPU) where `read`; under ZeRO-3 every rank calls
        it (each bucket is gathered everywhere, a collective)."""
        tensors: dict[str, torch.Tensor] = {}
        for bucket in self.buckets:
            with self.gathered(bucket, read=read) as part:
                tensors.update(part)
        return tensors

    def config_dict(self) -> dict:
        """`adapter_config.json`'s content, as `PeftModel.save_pretrained` writes it (for inference)."""
        config = copy.copy(self.peft_model.peft_config[self.adapter])
        config.inference_mode = True
        return {key: sorted(value) if isinstance(value, set) else value for key, value in config.to_dict().items()}

    def save_config(self, directory: Path) -> None:
        """Write `config_dict()` as `directory/adapter_config.json`."""
        (directory / ADAPTER_CONFIG).write_text(json.dumps(self.config_dict(), indent=2, sort_keys=True))


def shard_writer(index: int, world: int) -> int:
    """The rank that writes shard `index` of a dump among `world` processes: round robin."""
    return index % world


def served_name(name: str) -> str:
    """A PEFT model's name of a base tensor as the base model's checkpoint names it (others are unchanged)."""
    name = name.replace(".base_layer.", ".")
    if ".modules_to_save." in name:  # `x.modules_to_save.<adapter>.weight` is the trained copy of `x.weight`
        head, tail = name.split(".modules_to_save.", 1)
        name = f"{head}.{tail.split('.', 1)[1]}"
    return name


def epochs_crossed(previous_epoch: float, epoch: float, every: float) -> bool:
    """True when a multiple of `every` epochs lies in (previous_epoch, epoch] (with float tolerance)."""
    eps = 1e-9
    return math.floor(epoch / every + eps) > math.floor(previous_epoch / every + eps)


class WeightSync:
    """Dumps and pushes the policy to servers; see the module docstring."""

    def __init__(self, accelerator, sync_dir: str, keep_last_dumps: int, log_path: str, targets: list[SyncTarget],
                 reload_attempts: int = 3, bucket_mb: float = DEFAULT_BUCKET_MB, adapter_only: bool = False,
                 network: Optional["NetworkTransport"] = None):
        self.accelerator = accelerator
        self.network = network  # how targets with `distributed` are reached (`sync.transport: distributed`)
        self._sender: Optional[WeightBroadcast] = None  # main process, from the first push
        self.adapter_only = adapter_only  # dump a PEFT policy's adapter alone (`AdapterWeights`), not merged weights
        self.targets = targets
        self.sync_dir = Path(sync_dir)
        self.keep_last_dumps = keep_last_dumps
        self.log_path = Path(log_path)
        self.reload_attempts = reload_attempts
        self.bucket_bytes = max(1, int(bucket_mb * 1e6))
        self._durable_writes: Optional[bool] = None  # fsync each shard where it is written: see `_writes_durable`
        # main process: each confirmed dump's seal, then its log entries and pruning, in order
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="open_r1_ext-weight-seal")
        self._pending: list[Future] = []
        self._seals: dict[Path, Future] = {}  # the seals still running, for `repush`
        self._logged: Optional[set[tuple[int, str]]] = None  # (step, role) in the log, read once by the first seal
        if accelerator.is_main_process:
            for leftover in remove_temporary_dirs(self.sync_dir):
                logger.warning("removed %s: a weight dump a crash left unfinished (it was never published)", leftover)

    # ------------------------------------------------------------ collective
    def sync(self, model, step: int, targets: list[SyncTarget]) -> Optional[str]:
        """Bring `targets` to the policy at `step`, every rank calls it: those reached over the network by a broadcast
        (`send`), the others by a dump they reload. Returns None or the first error (a dump that cannot be written
        raises `WeightDumpError`)."""
        dumped = [t for t in targets if not t.distributed]
        error = self.publish(dumped, self.dump(model, step), step) if dumped else None
        for target in targets:
            if target.distributed:
                error = error or self.send(model, step, target)
        return error

    def send(self, model, step: int, target: SyncTarget, only: Optional[list[str]] = None,
             collective: bool = True) -> Optional[str]:
        """Broadcast the policy to `target`'s servers (`weight_broadcast`) as weight version `step`, bucket by bucket
        in the dump's walk; returns None or the error. Every rank calls it when `collective` (under ZeRO-3 every
        bucket is gathered everywhere, and the outcome is shared); else only the main process, which must hold the
        whole policy. `only` (replica names, or URLs): a catch-up of those servers to the target's version, which stays
        the same; else a sync, which every server confirms. A target of adapters is sent the adapter in the request
        instead (`send_adapter`)."""
        if target.adapter:
            return self.send_adapter(model, step, target, collective)
        weights = PolicyWeights(self.accelerator, model, self.bucket_bytes)
        main = self.accelerator.is_main_process
        push, update, error = self._open_update(target, step, only, len(weights.buckets)) if main else (None, None, None)
        self.walk(weights, lambda index: update is not None and bool(update.live), lambda i, t: update.send(i, t),
                  self._send_device())
        if update is not None:
            error = push.finish(update.finish(), target.version_for(step), whole=only is None)
        if collective:
            error = self.broadcast_from_main(error)
        if error is None and only is None:
            self.confirm([target], None, step)
        return error

    def stage(self, model) -> Optional[list[StagedBucket]]:
        """A sync's buckets for a broadcast made later (`send_staged`, on the update thread while training goes on): the
        dump's walk (a collective under ZeRO-3, every rank calls it), each bucket flattened into host memory on the
        main process, which gets them (elsewhere None). It costs the training thread what a dump's walk does, less the
        writes, and host memory the size of the policy until the broadcast ends."""
        main = self.accelerator.is_main_process
        staged: list[StagedBucket] = []
        self.walk(PolicyWeights(self.accelerator, model, self.bucket_bytes), lambda index: main,
                  lambda i, tensors: staged.append(stage(tensors)), self._send_device())
        return staged if main else None

    def send_staged(self, staged: list[StagedBucket], step: int, target: SyncTarget) -> Optional[str]:
        """Main process, any thread: broadcast `stage`'s buckets to `target`'s servers as weight version `step`, and
        confirm it; None or the error."""
        push, update, error = self._open_update(target, step, None, len(staged))
        if update is not None:
            for index, bucket in enumerate(staged):
                update.send_staged(index, bucket)
            error = push.finish(update.finish(), target.version_for(step), whole=True)
        if error is None:
            self.confirm([target], None, step)
        return error

    def _open_update(self, target: SyncTarget, step: int, only: Optional[list[str]],
                     buckets: int) -> tuple[Optional["_Push"], Optional[WeightUpdate], Optional[str]]:
        """Main process: a send's servers (`_Push`) and their sessions opened (`WeightBroadcast.update`), or why not."""
        push = None
        try:
            push = _Push(target, only)
            return push, self.sender(push.clients).update(list(push.clients.values()), target.version_for(step),
                                                          buckets), None
        except (ServerError, OSError) as err:
            if push is not None:
                push.cancel()
            return None, None, f"the {target.role} server did not take the new weights: {err}"

    def _send_device(self) -> str:
        """Where a send's buckets are gathered: the broadcaster's buffer's device (CPU until the first send)."""
        return "cpu" if self._sender is None else self._sender.broadcaster.device

    def send_adapter(self, model, step: int, target: SyncTarget, collective: bool = True,
                     retire: bool = True) -> Optional[str]:
        """Send `target`'s servers the policy's LoRA adapter in the request (`/load_lora_adapter_from_tensors`: no
        file) under `adapter_name` of step `step`'s version; returns None or the error. Every rank calls it when
        `collective` (under ZeRO-3 each bucket is gathered everywhere); the main process keeps the adapter it sent for
        a server that loses it (`repush`). `retire`: see `push`."""
        main = self.accelerator.is_main_process
        weights = AdapterWeights(self.accelerator, model, self.bucket_bytes)
        sent = AdapterTensors.of(weights.gather_all(read=main), weights.config_dict()) if main else None
        error = None
        if main:
            try:
                self.push(target, sent, target.version_for(step), retire)
            except WeightSyncError as err:
                error = str(err)
        if collective:
            error = self.broadcast_from_main(error)
        if error is None:
            self.confirm([target], None, step)
            target.sent = sent
        return error

    def sender(self, clients: dict[str, SGLangClient]) -> WeightBroadcast:
        """The main process's `WeightBroadcast`, made at the first send (its backend: the recipe's, or NCCL when this
        process and the servers are on GPUs)."""
        if self._sender is None:
            network = self.network or NetworkTransport()
            device = self.accelerator.device
            reported = [] if network.backend != "auto" else [_device_of(client) for client in clients.values()]
            backend = resolve_backend(network.backend, device, reported)
            self._sender = WeightBroadcast(backend, device if backend == "nccl" else torch.device("cpu"),
                                           network.timeout_s, network.master_address, network.port)
        return self._sender

    def close(self) -> None:
        """End of training: the broadcaster process (if any) stops; a later send starts a new one."""
        if self._sender is not None:
            self._sender.close()

    def publish(self, targets: list[SyncTarget], path: Path, step: int) -> Optional[str]:
        """Have `targets` reload the dump `path` now; every rank calls it. Returns None or the error."""
        error = None
        if self.accelerator.is_main_process:
            try:
                self.push_all(targets, path, step)
            except WeightSyncError as err:
                error = str(err)
        error = self.broadcast_from_main(error)
        if error is None:
            self.confirm(targets, path, step)
        return error

    def dump(self, model, step: int) -> Path:
        """Write `<sync_dir>/step-<step>` and return it; every rank calls it, and every rank writes its share of the
        shards (shard k by rank k mod N) into one temporary directory the main process publishes once all are
        written. On a failure anywhere, every rank raises the same `WeightDumpError` and nothing is published."""
        path = self.sync_dir / f"{STEP_PREFIX}{step}"
        tmp, error = None, None
        if self.accelerator.is_main_process:
            try:
                self.wait_durable()  # one dump at a time in flight to the disk; a failed seal surfaces here
            except (OSError, WeightFileError) as err:
                error = f"a weight dump did not reach the disk (its seal failed): {err}"
            try:
                tmp = temporary_dir(path) if error is None else None
            except OSError as err:
                error = describe_write_error(path, err)
        tmp, error = self.broadcast_from_main((tmp, error))
        weights = (AdapterWeights if self.adapter_only else PolicyWeights)(self.accelerator, model, self.bucket_bytes)
        write = self._write_adapter if self.adapter_only else self._write_shards
        written, error = ({}, error) if error is not None else write(weights, tmp, path)
        outcomes = self.gather([(written, error)])
        if self.accelerator.is_main_process:
            error = next((e for _, e in outcomes if e is not None), None)
            try:
                if error is None:
                    self._finish(model, weights, tmp, path, {k: v for w, _ in outcomes for k, v in w.items()})
            except Exception as err:  # noqa: BLE001
                error = describe_write_error(path, err)
            if error is not None and tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays on a full disk
        error = self.broadcast_from_main(error)
        if error is not None:
            raise WeightDumpError(f"{error}\nStopping at step {step}: the servers keep the weights they have.")
        return path

    @staticmethod
    def walk(weights: PolicyWeights, wanted: Callable[[int], bool], take: Callable[[int, dict[str, torch.Tensor]], None],
             device: str = "cpu") -> None:
        """The one walk over the policy's buckets, in order: `take(index, tensors)` for each bucket this rank
        `wanted` (its tensors on `device`). Under ZeRO-3 every bucket is gathered on every rank (a collective), wanted
        or not; otherwise a rank reads only what it wants. Its sinks: a dump's shards, a broadcast to the servers."""
        for index, bucket in enumerate(weights.buckets):
            read = wanted(index)
            if not read and not weights.zero3:
                continue
            with weights.gathered(bucket, read=read, device=device) as tensors:
                if tensors:
                    take(index, tensors)
                tensors.clear()  # on CPU they share the gathered storage: let it go with the gather, not a bucket later

    def _write_shards(self, weights: PolicyWeights, tmp: Path, path: Path) -> tuple[dict[str, str], Optional[str]]:
        """Write this rank's shards of `weights` into `tmp`: the tensor -> shard map and None, or what failed. Under
        ZeRO-3 every bucket is gathered on every rank (a collective), also after a failure here."""
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        durable = self._writes_durable()
        written, errors = {}, []

        def write(index: int, tensors: dict[str, torch.Tensor]) -> None:
            name = shard_name(index, len(weights.buckets))
            try:
                write_shard(tmp / name, tensors, durable=durable)
                written.update(dict.fromkeys(tensors, name))
            except Exception as err:  # noqa: BLE001 - SafetensorError, OSError, ...: the dump fails, cleanly
                errors.append(describe_write_error(path, err, f"{name}, rank {rank}"))

        self.walk(weights, lambda index: shard_writer(index, world) == rank and not errors, write)
        return written, (errors[0] if errors else None)

    def _write_adapter(self, weights: AdapterWeights, tmp: Path, path: Path) -> tuple[dict[str, str], Optional[str]]:
        """The main process writes the adapter as one file (`ADAPTER_FILE`, what peft and SGLang load), its buckets
        read in turn; under ZeRO-3 every rank gathers each bucket (a collective), also after a failure here."""
        main, error = self.accelerator.is_main_process, None
        tensors = weights.gather_all(read=main)
        if main:
            try:
                write_shard(tmp / ADAPTER_FILE, tensors)
            except Exception as err:  # noqa: BLE001 - as in _write_shards: the dump fails, cleanly
                error = describe_write_error(path, err, ADAPTER_FILE)
        return {}, error

    def _finish(self, model, weights: PolicyWeights, tmp: Path, path: Path, weight_map: dict[str, str]) -> None:
        """Main process, once every shard is written: index, config files, manifest, rename."""
        if isinstance(weights, AdapterWeights):
            weights.save_config(tmp)
            publish(tmp, path)
            return
        base = weights.model
        write_index(tmp, weight_map, weights.nbytes)
        base.config.dtype = str(base.dtype).split(".")[1]  # as save_pretrained records them
        base.config.architectures = [type(base).__name__]
        base.config.save_pretrained(tmp)
        if getattr(base, "generation_config", None) is not None and base.can_generate():
            base.generation_config.save_pretrained(tmp)
        publish(tmp, path)

    def _writes_durable(self) -> bool:
        """Whether this rank fsyncs its shards as it writes them: only off the main process's machine (the main
        process's seal fsyncs every file through its own page cache, which holds what its machine's ranks wrote,
        not what another machine's did). Asked once, collectively."""
        if self._durable_writes is None:
            self._durable_writes = self.broadcast_from_main(socket.gethostname()) != socket.gethostname()
        return self._durable_writes

    def share_state(self, targets: list[SyncTarget]) -> None:
        """Give every rank the main process's view of what each server last confirmed."""
        views = self.broadcast_from_main([(t.version, t.path, t.step) for t in targets])
        for target, (version, path, step) in zip(targets, views):
            target.version, target.path, target.step = version, path, step

    def gather(self, values: list) -> list:
        """Every rank's `values`, concatenated in rank order, on every rank."""
        if self.accelerator.num_processes == 1:
            return values
        from accelerate.utils import gather_object

        return gather_object(values)

    def broadcast_from_main(self, value):
        if self.accelerator.num_processes == 1:
            return value
        from accelerate.utils import broadcast_object_list

        box = [value]
        broadcast_object_list(box, from_process=0)
        return box[0]

    # -------------------------------------------------------------- main only
    def push_all(self, targets: list[SyncTarget], path: Path, step: int, retire: bool = True) -> None:
        for target in targets:
            self.push(target, path, target.version_for(step), retire)

    def push_and_confirm(self, targets: list[SyncTarget], path: Path, step: int, retire: bool = True) -> None:
        """Main process, possibly on the rollout thread: push, then record (raises `WeightSyncError`). `retire`: see
        `push`."""
        self.push_all(targets, path, step, retire)
        self.confirm(targets, path, step)

    def confirm(self, targets: list[SyncTarget], path: Optional[Path], step: int) -> None:
        """Record that `targets` hold the policy of `step` (from the dump `path`, or pushed: None); the main process
        logs it once the dump is sealed."""
        for target in targets:
            target.version, target.path, target.step = target.version_for(step), path, step
            if isinstance(target.client, ServerPool) and not target.adapter and not self.accelerator.is_main_process:
                # another process's pool: what the main process's pool loaded is what its replicas must hold
                target.client.expect_weights(None if path is None else str(path.resolve()), target.version,
                                             **target.reload_extra())
        if self.accelerator.is_main_process:
            confirmed = [(t.role, t.version, t.confirmed_by()) for t in targets]
            seal = self._in_background(self._seal_log_and_prune, step, path, confirmed)
            if path is not None:
                self._seals = {p: f for p, f in self._seals.items() if not f.done()}
                self._seals[path] = seal

    def wait_durable(self) -> None:
        """Block until every confirmed dump so far is sealed and its sync logged; re-raises the first error of that
        work (`OSError`, or `WeightFileError` for a dump changed since it was published). Main process (elsewhere
        there is nothing to wait for)."""
        while self._pending:
            self._pending.pop(0).result()

    def _in_background(self, fn, *args) -> Future:
        future = self._background.submit(fn, *args)
        self._pending.append(future)
        return future

    def push(self, target: SyncTarget, path: Union[Path, AdapterTensors], version: str, retire: bool = True) -> None:
        """Have `target` reload `path` (a dump; for a target of adapters also an adapter in memory, sent in the request)
        and confirm `version`, else `WeightSyncError`. Retried only while the server
        answers (a refusal, another version); a server that does not answer has had the client's whole retry budget
        (`sglang_client.DEFAULT_MAX_RETRIES`), which is not spent again here. A target of adapters then unloads the
        ones beyond its newest `keep_adapters` (`retire_adapters`), unless not `retire` (the caller does it)."""
        load = self._load_adapter if target.adapter else self._load_weights
        last = None
        for attempt in range(1, self.reload_attempts + 1):
            try:
                last = load(target, path, version)
                if last is None:
                    if target.adapter and retire:
                        self.retire_adapters(target)
                    return
            except ServerRequestError as err:
                last = str(err)
            except ServerError as err:
                raise WeightSyncError(f"the {target.role} server did not take the new weights: {err}") from err
            logger.warning("%s server: reload of %s failed (attempt %d/%d): %s", target.role,
                           path if isinstance(path, Path) else "the adapter sent as tensors", attempt, self.reload_attempts,
                           last)
            if attempt < self.reload_attempts:
                time.sleep(float(attempt))
        raise WeightSyncError(f"the {target.role} server did not take the new weights: {last}")

    @staticmethod
    def _load_weights(target: SyncTarget, path: Path, version: str) -> Optional[str]:
        """`/update_weights_from_disk`; None once the server reports `version`, else what it reports."""
        target.client.update_weights_from_disk(str(path.resolve()), weight_version=version, **target.reload_extra())
        reported = target.client.weight_version()
        return None if reported == version else f"the server reports weight_version {reported!r}, expected {version!r}"

    @staticmethod
    def _load_adapter(target: SyncTarget, path: Union[Path, AdapterTensors], version: str) -> None:
        """`/load_lora_adapter` of `path` (or `/load_lora_adapter_from_tensors` of an adapter in memory) under
        `adapter_name(version)`, after unloading that name (left loaded when a stopped run resumes at that step with
        the server still up: SGLang refuses a name twice)."""
        name = adapter_name(version)
        with contextlib.suppress(ServerRequestError):  # not loaded: the usual case
            target.client.unload_lora_adapter(name)
        load_adapter(target.client, name, path if isinstance(path, AdapterTensors) else str(path.resolve()))
        target.loaded = [n for n in target.loaded if n != name] + [name]

    @staticmethod
    def retire_adapters(target: SyncTarget) -> None:
        """Main process: unload the adapters beyond the newest `keep_adapters` (SGLang lets their requests in flight
        finish first, the built-in server all its sampling under way)."""
        while len(target.loaded) > target.keep_adapters:
            old = target.loaded.pop(0)
            try:
                target.client.unload_lora_adapter(old)
            except ServerError as err:  # housekeeping: the new adapter is loaded, training goes on
                logger.warning("%s server: could not unload the LoRA adapter %s: %s", target.role, old, err)

    def repush(self, target: SyncTarget) -> None:
        """Reload the last confirmed dump (after a server restart lost it, or on resume); any rank may call it.
        Its checksums are verified first: after a crash, only they tell a damaged dump from a good one."""
        if target.sent is not None:  # an adapter sent in the request: sent again
            logger.warning("%s server at %s lost the adapter of weight_version %s (restarted?): sending it again",
                           target.role, target.client.base_url, target.version)
            self.push(target, target.sent, target.version)  # type: ignore[arg-type]
            return
        if target.path is None:
            return
        logger.warning("%s server at %s lost weight_version %s (restarted?): reloading %s",
                       target.role, target.client.base_url, target.version, target.path)
        try:
            sealing = self._seals.get(target.path)
            if sealing is not None:  # confirmed moments ago: its checksums are being written
                sealing.result()
            check_manifest(target.path, checksums=True)
        except (WeightFileError, OSError) as err:
            raise WeightSyncError(f"cannot restore the {target.role} server's weights: {err}") from err
        self.push(target, target.path, target.version)  # type: ignore[arg-type]

    def prune(self) -> None:
        """Delete dumps beyond the newest `keep_last_dumps`, never one a server was last confirmed on."""
        if self.keep_last_dumps <= 0:
            return
        pinned = {t.path.resolve() for t in self.targets if t.path is not None}
        dumps = sorted(self.dumps(), key=lambda p: int(p.name[len(STEP_PREFIX):]))
        for old in dumps[: -self.keep_last_dumps]:
            if old.resolve() not in pinned:
                shutil.rmtree(old, ignore_errors=True)

    def dumps(self) -> list[Path]:
        if not self.sync_dir.is_dir():
            return []
        return [p for p in self.sync_dir.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX) and p.name[len(STEP_PREFIX):].isdigit()]

    def _seal_log_and_prune(self, step: int, path: Optional[Path],
                            confirmed: list[tuple[str, Optional[str], Optional[list[str]]]]) -> None:
        if path is not None:  # (a send leaves no dump: its entry's path is null)
            seal_weight_dir(path)  # on an error the sync stays unlogged; `wait_durable` raises it
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self._logged is None:  # a resumed run syncs its checkpoint's step again: the log names each step once
            lines = self.log_path.read_text().splitlines() if self.log_path.is_file() else []
            self._logged = {(e["step"], e["role"]) for e in map(json.loads, filter(str.strip, lines))}
        with open(self.log_path, "a") as log:
            for role, version, replicas in confirmed:
                if (step, role) not in self._logged:
                    self._logged.add((step, role))
                    entry = {"step": step, "role": role, "path": None if path is None else str(path), "weight_version": version,
                             "time": round(time.time(), 3)}
                    log.write(json.dumps(entry if replicas is None else {**entry, "replicas": replicas}) + "\n")
        self.prune()

    def last_logged(self, role: str) -> Optional[dict]:
        """The newest confirmed sync of `role` in the log (to restore the reference on resume)."""
        self.wait_durable()
        if not self.log_path.is_file():
            return None
        entries = [json.loads(line) for line in self.log_path.read_text().splitlines() if line.strip()]
        entries = [e for e in entries if e["role"] == role]
        return entries[-1] if entries else None


@dataclass(frozen=True)
class NetworkTransport:
    """`sync.transport: distributed`: how the main process reaches the servers (`weight_broadcast.WeightBroadcast`)."""

    backend: str = "auto"
    timeout_s: float = DEFAULT_TIMEOUT_S
    master_address: Optional[str] = None
    port: int = 0


def _device_of(client: SGLangClient) -> Optional[str]:
    """The device a server says it runs on (`/server_info`), None if it does not say or does not answer."""
    try:
        return client.server_info().get("device")
    except ServerError:
        return None


class _Push:
    """One send to a target, main process: the servers it goes to (a pool's replicas, bracketed by `begin_push` and
    `end_push`; or the one server), and its outcome as a message."""

    def __init__(self, target: SyncTarget, only: Optional[list[str]]):
        self.target, self.pool = target, target.client if isinstance(target.client, ServerPool) else None
        if self.pool is not None:
            self.clients = self.pool.begin_push(only)
        else:
            self.clients = {target.client.base_url: target.client}
        self._open = True

    def cancel(self) -> None:
        if self.pool is not None and self._open:
            self._open = False
            self.pool.end_push({}, "", whole=False)

    def finish(self, outcomes: dict[str, Optional[ServerError]], version: str, whole: bool) -> Optional[str]:
        """Record the outcomes (by URL); None, or why the target did not take the weights."""
        role = self.target.role
        by_name = {name: outcomes.get(client.base_url) for name, client in self.clients.items()}
        if self.pool is None:
            error = next(iter(by_name.values()), None)
            return None if error is None else f"the {role} server did not take the new weights: {error}"
        self._open = False
        try:
            self.pool.end_push(by_name, version, whole)
        except ServerRequestError as err:
            return f"the {role} servers did not take the new weights: {err}"
        if whole and not any(error is None for error in by_name.values()):
            failures = "; ".join(str(e) for e in by_name.values()) or "no replica to send them to"
            return f"no {role} replica took the new weights: {failures}"
        return None
