"""Weight sync: dump the policy atomically to a shared directory and have servers reload it.

Every rank calls `WeightSync.sync` (gathering parameters under DeepSpeed ZeRO-3 is collective); the main process
writes `<sync_dir>/step-<N>/` (merged LoRA, safetensors + config + manifest, see `weight_files.write_weight_dir`),
calls `/update_weights_from_disk` on each target server, and checks the version it then reports. The outcome is
broadcast, so every rank stops together on a failure instead of hanging at a barrier.

The dump is published (renamed into place) before it is sealed. Once the servers confirmed it, a background thread
seals it (checksums into its manifest, fsync) while training goes on, not during the reload (a concurrent flush
slowed the reload by ~50% here), then appends the sync to `<output_dir>/weight_sync.jsonl` and prunes old dumps:
the log, what a resumed run reloads (after checking the checksums), names only sealed dumps on stable storage.
`wait_durable` drains that work: before the next dump, before a checkpoint, and when training ends.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from open_r1_ext.sglang_client import ServerError, ServerRequestError, SGLangClient
from open_r1_ext.weight_files import WeightFileError, check_manifest, seal_weight_dir, write_weight_dir

logger = logging.getLogger(__name__)
STEP_PREFIX = "step-"


class WeightSyncError(ServerError):
    """A server did not take new weights; training stops rather than sample from stale ones."""


@dataclass
class SyncTarget:
    """A server that reloads the policy: its role, client, soft-update alpha, and what it last confirmed."""

    role: str
    client: SGLangClient
    mixup_alpha: Optional[float] = None
    version: Optional[str] = None
    path: Optional[Path] = None
    step: Optional[int] = None

    def version_for(self, step: int) -> str:
        return str(step) if self.role == "generation" else f"ref-{step}"


def policy_state_dict(accelerator, model) -> Optional[dict[str, torch.Tensor]]:
    """The full policy weights on CPU (main process; None elsewhere): gathered under ZeRO-3, LoRA merged."""
    unwrapped = accelerator.unwrap_model(model)
    gather = contextlib.nullcontext()
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and plugin.zero_stage == 3:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(unwrapped.parameters()), modifier_rank=None)
    with gather:
        if not accelerator.is_main_process:
            return None
        if hasattr(unwrapped, "merge_adapter"):  # PEFT: serve the merged weights under the base model's names
            unwrapped.merge_adapter()
            try:
                return {
                    k.replace("base_model.model.", "").replace(".base_layer", ""): v.detach().cpu().clone()
                    for k, v in unwrapped.state_dict().items()
                    if "lora_" not in k and "modules_to_save" not in k
                }
            finally:
                unwrapped.unmerge_adapter()
        return {k: v.detach().cpu().clone() for k, v in unwrapped.state_dict().items()}


def saveable_model(accelerator, model):
    unwrapped = accelerator.unwrap_model(model)
    return unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped


def epochs_crossed(previous_epoch: float, epoch: float, every: float) -> bool:
    """True when a multiple of `every` epochs lies in (previous_epoch, epoch] (with float tolerance)."""
    eps = 1e-9
    return math.floor(epoch / every + eps) > math.floor(previous_epoch / every + eps)


class WeightSync:
    """Dumps and pushes the policy to servers; see the module docstring."""

    def __init__(self, accelerator, sync_dir: str, keep_last_dumps: int, log_path: str, targets: list[SyncTarget],
                 reload_attempts: int = 3):
        self.accelerator = accelerator
        self.targets = targets
        self.sync_dir = Path(sync_dir)
        self.keep_last_dumps = keep_last_dumps
        self.log_path = Path(log_path)
        self.reload_attempts = reload_attempts
        # main process: each confirmed dump's seal, then its log entries and pruning, in order
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="open_r1_ext-weight-seal")
        self._pending: list[Future] = []
        self._seals: dict[Path, Future] = {}  # the seals still running, for `repush`
        self._logged: Optional[set[tuple[int, str]]] = None  # (step, role) in the log, read once by the first seal

    # ------------------------------------------------------------ collective
    def sync(self, model, step: int, targets: list[SyncTarget]) -> Optional[str]:
        """Dump the policy at `step` and push it to `targets`; every rank calls it. Returns None or the error."""
        path, error = self.dump(model, step)
        return error if error is not None else self.publish(targets, path, step)

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

    def dump(self, model, step: int) -> tuple[Path, Optional[str]]:
        """Write `<sync_dir>/step-<step>` (every rank calls; the main process writes); returns it and any error."""
        state_dict = policy_state_dict(self.accelerator, model)
        path = self.sync_dir / f"{STEP_PREFIX}{step}"
        error = None
        if self.accelerator.is_main_process:
            try:
                self.wait_durable()  # one dump at a time in flight to the disk; a failed seal surfaces here
                self._write(model, state_dict, path)
            except (OSError, WeightFileError) as err:
                error = f"could not write the weight dump {path} to disk: {err}"
        return path, self.broadcast_from_main(error)

    def share_state(self, targets: list[SyncTarget]) -> None:
        """Give every rank the main process's view of what each server last confirmed."""
        views = self.broadcast_from_main([(t.version, t.path, t.step) for t in targets])
        for target, (version, path, step) in zip(targets, views):
            target.version, target.path, target.step = version, path, step

    def broadcast_from_main(self, value):
        if self.accelerator.num_processes == 1:
            return value
        from accelerate.utils import broadcast_object_list

        box = [value]
        broadcast_object_list(box, from_process=0)
        return box[0]

    # -------------------------------------------------------------- main only
    def _write(self, model, state_dict, path: Path) -> None:
        from transformers.utils import logging as hf_logging

        target = saveable_model(self.accelerator, model)
        hf_logging.disable_progress_bar()  # one "Writing model shards" bar per step is noise in a training log
        try:
            write_weight_dir(path, lambda tmp: target.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True))
        finally:
            hf_logging.enable_progress_bar()

    def push_all(self, targets: list[SyncTarget], path: Path, step: int) -> None:
        for target in targets:
            self.push(target, path, target.version_for(step))

    def push_and_confirm(self, targets: list[SyncTarget], path: Path, step: int) -> None:
        """Main process, possibly on the rollout thread: push, then record (raises `WeightSyncError`)."""
        self.push_all(targets, path, step)
        self.confirm(targets, path, step)

    def confirm(self, targets: list[SyncTarget], path: Path, step: int) -> None:
        for target in targets:
            target.version, target.path, target.step = target.version_for(step), path, step
        if self.accelerator.is_main_process:
            seal = self._in_background(self._seal_log_and_prune, step, path, [(t.role, t.version) for t in targets])
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

    def push(self, target: SyncTarget, path: Path, version: str) -> None:
        """Have `target` reload `path` and confirm `version`, else `WeightSyncError`. Retried only while the server
        answers (a refusal, another version); a server that does not answer has had the client's whole retry budget
        (`sglang_client.DEFAULT_MAX_RETRIES`), which is not spent again here."""
        extra = {} if target.mixup_alpha in (None, 1.0) else {"mixup_alpha": target.mixup_alpha}
        last = None
        for attempt in range(1, self.reload_attempts + 1):
            try:
                target.client.update_weights_from_disk(str(path.resolve()), weight_version=version, **extra)
                reported = target.client.weight_version()
                if reported == version:
                    return
                last = f"the server reports weight_version {reported!r}, expected {version!r}"
            except ServerRequestError as err:
                last = str(err)
            except ServerError as err:
                raise WeightSyncError(f"the {target.role} server did not take the new weights: {err}") from err
            logger.warning("%s server: reload of %s failed (attempt %d/%d): %s", target.role, path, attempt, self.reload_attempts, last)
            if attempt < self.reload_attempts:
                time.sleep(float(attempt))
        raise WeightSyncError(f"the {target.role} server did not take the new weights: {last}")

    def repush(self, target: SyncTarget) -> None:
        """Reload the last confirmed dump (after a server restart lost it, or on resume); any rank may call it.
        Its checksums are verified first: after a crash, only they tell a damaged dump from a good one."""
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

    def _seal_log_and_prune(self, step: int, path: Path, confirmed: list[tuple[str, Optional[str]]]) -> None:
        seal_weight_dir(path)  # on an error the sync stays unlogged; `wait_durable` raises it
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self._logged is None:  # a resumed run syncs its checkpoint's step again: the log names each step once
            lines = self.log_path.read_text().splitlines() if self.log_path.is_file() else []
            self._logged = {(e["step"], e["role"]) for e in map(json.loads, filter(str.strip, lines))}
        with open(self.log_path, "a") as log:
            for role, version in confirmed:
                if (step, role) not in self._logged:
                    self._logged.add((step, role))
                    log.write(json.dumps({"step": step, "role": role, "path": str(path),
                                          "weight_version": version, "time": round(time.time(), 3)}) + "\n")
        self.prune()

    def last_logged(self, role: str) -> Optional[dict]:
        """The newest confirmed sync of `role` in the log (to restore the reference on resume)."""
        self.wait_durable()
        if not self.log_path.is_file():
            return None
        entries = [json.loads(line) for line in self.log_path.read_text().splitlines() if line.strip()]
        entries = [e for e in entries if e["role"] == role]
        return entries[-1] if entries else None
