"""The payload of SGLang's `/load_lora_adapter_from_tensors` (`serialized_named_tensors`): what the trainer sends, and
how the built-in server reads it.

SGLang 0.5.23 reads each tensor-parallel rank's copy with `MultiprocessingSerializer.deserialize`: base64, then its
`SafeUnpickler` (`utils/common.py` ~3085-3340), which allows torch's tensor-rebuilding functions and routes
`torch.storage._load_from_bytes` to a weights-only load. Torch's `ForkingPickler`, which SGLang's own callers use,
pickles a CPU tensor as a handle to this machine's shared memory: it cannot cross nodes. A plain pickle holds the bytes
themselves (`_rebuild_tensor_v2` over `_load_from_bytes`), so a trainer on another node sends that. The built-in
server unpickles it allowing exactly those three names, never anything else a body may name.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from dataclasses import dataclass

import torch

# What a plain pickle of `{name: CPU tensor}` names (torch 2.13): anything else in a body is refused.
_REBUILD = ("torch._utils", "_rebuild_tensor_v2")
_STORAGE = ("torch.storage", "_load_from_bytes")
_HOOKS = ("collections", "OrderedDict")


@dataclass(eq=False)  # one adapter sent: compared by identity, as a dump by its path
class AdapterTensors:
    """A LoRA adapter held in memory to be sent (`/load_lora_adapter_from_tensors`), not written: its tensors
    serialized once (`serialized`, one `serialized_named_tensors` entry), however many servers and retries it goes to,
    and its `adapter_config.json` (`config`)."""

    serialized: str
    config: dict

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor], config: dict) -> "AdapterTensors":
        """`tensors` as peft names them in `adapter_model.safetensors`, serialized."""
        return cls(serialize_named_tensors(tensors), config)


def serialize_named_tensors(tensors: dict[str, torch.Tensor]) -> str:
    """One rank's `serialized_named_tensors` entry: `{name: tensor}` on the CPU, each tensor compact (a view would
    carry its whole storage), plainly pickled, base64."""
    compact = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in tensors.items()}
    return base64.b64encode(pickle.dumps(compact, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


class _NamedTensorsUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == _REBUILD:
            return torch._utils._rebuild_tensor_v2
        if (module, name) == _STORAGE:
            return _load_storage
        if (module, name) == _HOOKS:
            from collections import OrderedDict

            return OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed (only tensors: {{name: tensor}})")


def _load_storage(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def deserialize_named_tensors(payload: str) -> dict[str, torch.Tensor]:
    """`{name: tensor}` from one `serialized_named_tensors` entry; `ValueError` saying why for anything else (not
    base64, a pickle naming anything but tensors, not a dict of tensors by name)."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"not base64: {err}") from None
    try:
        tensors = _NamedTensorsUnpickler(io.BytesIO(raw)).load()
    except Exception as err:  # noqa: BLE001 - any failure of a hostile or broken pickle is the client's mistake
        raise ValueError(f"not a pickle of tensors: {err}") from None
    if not (isinstance(tensors, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in tensors.items())):
        raise ValueError("not a dict of tensors by name")
    return tensors
