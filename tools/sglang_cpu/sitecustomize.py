"""Lets PyPI's torchvision import beside a CPU torch, in the SGLang venv (imported at interpreter start-up).

SGLang 0.5.23 imports torchvision unconditionally (`srt/configs/__init__.py`). PyPI's only Linux torchvision is a CUDA
build whose `_C.so` does not load against the CPU torch, and then `torchvision/_meta_registrations.py` fails with
"operator torchvision::nms does not exist". Defining the two op schemas it registers meta kernels for, just before
that module is imported, lets it import; the ops themselves are never run by the language models SGLang serves here.
Not needed where a CPU build of torchvision is installed. Installed into the SGLang venv by `tools/sglang_cpu/install.sh`.
"""

import importlib.abc
import sys

_TARGET = "torchvision._meta_registrations"
_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


class _DefineSchemasFirst(importlib.abc.MetaPathFinder):
    """Defines the schemas the first time `_TARGET` is looked for, then lets the normal finders import it."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        import torch

        library = torch.library.Library("torchvision", "FRAGMENT")
        for schema in _SCHEMAS:
            try:
                library.define(schema)
            except RuntimeError:  # already defined: a torchvision whose _C loaded
                pass
        _LIBRARIES.append(library)  # the definitions live as long as the Library object
        return None


_LIBRARIES: list = []
sys.meta_path.insert(0, _DefineSchemasFirst())
