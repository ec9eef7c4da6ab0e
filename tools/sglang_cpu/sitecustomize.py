"""Two fixes SGLang 0.5.23 needs on a CPU-only torch, in the SGLang venv (imported at interpreter start-up; each runs
just before the module it is for is first imported, so an interpreter that never imports it pays nothing).

1. torchvision op schemas. SGLang imports torchvision unconditionally (`srt/configs/__init__.py`). PyPI's only Linux
   torchvision is a CUDA build whose `_C.so` does not load against the CPU torch, and then
   `torchvision/_meta_registrations.py` fails with "operator torchvision::nms does not exist". Defining the two op
   schemas it registers meta kernels for lets it import; the ops themselves are never run by the language models SGLang
   serves here. Not needed where a CPU build of torchvision is installed.
2. pin_memory as a no-op without an accelerator. SGLang's LoRA layers and its torch_native LoRA backend ask for
   pinned host memory unconditionally (`srt/lora/layers.py:141` and others, `lora/backend/torch_backend.py:225-237`:
   `torch.tensor(..., pin_memory=True)`, `.pin_memory()`), which a torch without CUDA or another accelerator refuses
   ("pin_memory=True requires a CUDA or other accelerator backend"): `--enable-lora` dies at start. Pinning only
   speeds up host-to-device copies, and on a CPU there is no device: before `sglang.srt.lora` is imported (by
   `srt/server_args.py`, so in every SGLang process), and only when torch has no accelerator, `Tensor.pin_memory()`
   returns the tensor itself and the factories below drop `pin_memory=`. With `--lora-backend torch_native` SGLang
   then serves LoRA adapters on the CPU, its log-probs equal to peft's (tests/test_lora.py).

Installed into the SGLang venv by `tools/sglang_cpu/install.sh` (a .pth file puts this folder on its path).
"""

import functools
import importlib.abc
import sys

_TORCHVISION_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                        "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
# the factories SGLang's LoRA code calls with pin_memory=True, and their kin that take the argument too
_PINNING_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like", "ones_like",
                      "full_like")
_LIBRARIES: list = []  # the torchvision schema definitions live as long as their Library object


def _define_torchvision_schemas() -> None:
    import torch

    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _TORCHVISION_SCHEMAS:
        try:
            library.define(schema)
        except RuntimeError:  # already defined: a torchvision whose _C loaded
            pass
    _LIBRARIES.append(library)


def _unpinned_without_accelerator() -> None:
    import torch

    if torch.accelerator.is_available():
        return  # pinning works here and speeds up copies: leave it alone
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    for name in _PINNING_FACTORIES:
        factory = getattr(torch, name)

        def unpinned(*args, _factory=factory, **kwargs):
            kwargs.pop("pin_memory", None)
            return _factory(*args, **kwargs)

        setattr(torch, name, functools.wraps(factory)(unpinned))


class _BeforeImport(importlib.abc.MetaPathFinder):
    """Runs `fix` the first time `target` is looked for, then lets the normal finders import it."""

    def __init__(self, target: str, fix):
        self.target, self.fix = target, fix

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)
        self.fix()
        return None


sys.meta_path[:0] = [_BeforeImport("torchvision._meta_registrations", _define_torchvision_schemas),
                     _BeforeImport("sglang.srt.lora", _unpinned_without_accelerator)]
