"""The built-in server's side of SGLang's distributed weight update: the groups a model slot joined, its begin/end
session, and receiving a broadcast (one per tensor, or one flattened bucket), with SGLang 0.5.23's answers and
messages (`managers/scheduler_components/weight_updater.py`, `model_executor/model_runner_components/
weight_updater.py`). Two differences, both in the server's favour: every collective is bounded by
`--weight-update-timeout` (SGLang's groups use torch's default, 30 minutes), and a group forms and a broadcast is
received beside generation, which stops only while the received tensors are copied in. The routes are
`app.weight_update_routes`; the copy is `ModelEngine.load_tensors`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Optional

import torch

from open_r1_ext.protocol import FLATTENED_BUCKET, InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput
from open_r1_ext.weight_broadcast import destroy_group, empty_bucket, torch_dtype, weight_update_group

logger = logging.getLogger(__name__)
DEFAULT_WEIGHT_UPDATE_TIMEOUT_S = 300.0  # --weight-update-timeout
NO_SESSION = ("update_weights_from_distributed must run between begin_weight_update() and end_weight_update()")


class WeightReceiver:
    """One model slot's weight-update groups and session. The blocking calls (`init_group`, `receive`) run on a
    thread of their own, never on the batcher's."""

    def __init__(self, device: torch.device, timeout_s: float = DEFAULT_WEIGHT_UPDATE_TIMEOUT_S):
        self.device, self.timeout_s = device, timeout_s
        self.groups: dict[str, object] = {}
        self.session: Optional[str] = None  # the selector of the open session
        self._lock = threading.Lock()
        self._buffer: Optional[torch.Tensor] = None  # the last bucket's, received into again (no new pages each time)
        self.updating: Optional[asyncio.Lock] = None  # one update at a time (made in the server's event loop)

    def init_group(self, obj: InitWeightsUpdateGroupReqInput) -> tuple[bool, str]:
        """Join the group as rank `rank_offset` (this server has one TP rank)."""
        try:
            if obj.rank_offset >= obj.world_size:
                raise ValueError(f"rank_offset {obj.rank_offset} is not below world_size {obj.world_size}")
            if obj.backend == "nccl" and self.device.type != "cuda":
                raise ValueError(f"backend nccl needs the server on a GPU; this one runs on {self.device} (use gloo)")
            with self._lock:
                if obj.group_name in self.groups:
                    raise ValueError(f"the group {obj.group_name} exists; destroy it first")
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            logger.info("init custom process group: master_address=%s, master_port=%d, rank=%d, world_size=%d, "
                        "group_name=%s, backend=%s", obj.master_address, obj.master_port, obj.rank_offset,
                        obj.world_size, obj.group_name, obj.backend)
            group = weight_update_group(obj.master_address, obj.master_port, obj.rank_offset, obj.world_size,
                                        obj.group_name, obj.backend, self.timeout_s)
        except Exception as err:  # noqa: BLE001 - SGLang's answer names it
            message = f"Failed to initialize custom process group: {err}."
            logger.error(message)
            return False, message
        with self._lock:
            self.groups[obj.group_name] = group
        return True, "Succeeded to initialize custom process group."

    def destroy_group(self, name: str) -> tuple[bool, str]:
        with self._lock:
            group = self.groups.pop(name, None)
        if group is None:
            return False, "The group to be destroyed does not exist."
        try:
            destroy_group(group)
        except Exception as err:  # noqa: BLE001
            return False, f"Failed to destroy custom process group: {err}."
        return True, "Succeeded to destroy custom process group."

    def begin(self, selector: str) -> tuple[bool, str]:
        with self._lock:
            if self.session is not None:
                return False, "a weight-update session is already open; call end_weight_update() first"
            self.session = selector
        return True, "Success"

    def end(self) -> tuple[bool, str]:
        with self._lock:
            if self.session is None:
                return False, "no weight-update session is open; call begin_weight_update() first"
            self.session = None
        return True, "Success"

    def receive(self, obj: UpdateWeightsFromDistributedReqInput) -> list[tuple[str, torch.Tensor]]:
        """The tensors rank 0 broadcasts now; raises (the broadcast failed or timed out, an unknown group). A
        flattened bucket's tensors are views of a buffer the next receive reuses: load them first (the route holds
        `updating` from the receive until they are loaded)."""
        group = self.groups.get(obj.group_name)
        if group is None:
            raise KeyError(f"Group {obj.group_name} not in {list(self.groups)}. Please call "
                           "`init_weights_update_group` first.")
        if obj.load_format == FLATTENED_BUCKET:
            self._buffer, tensors = empty_bucket(obj.names, obj.dtypes, obj.shapes, self.device, reuse=self._buffer)
            nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
            torch.distributed.broadcast(self._buffer[:nbytes], src=0, group=group)
            return tensors
        tensors = [(name, torch.empty(shape, dtype=torch_dtype(dtype), device=self.device))
                   for name, dtype, shape in zip(obj.names, obj.dtypes, obj.shapes)]
        works = [torch.distributed.broadcast(tensor, src=0, group=group, async_op=True) for _, tensor in tensors]
        for work in works:
            work.wait()
        return tensors
