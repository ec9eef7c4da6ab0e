"""open_r1_ext: GRPO with TRL where the reference model and generation run on a separate server.

The trainer classes are imported lazily, so the server and the launcher start without importing TRL.
"""

__version__ = "0.1.0"

_LAZY = {
    "RemoteGRPOTrainer": "open_r1_ext.trainer.remote_trainer",
    "RemoteGRPOConfig": "open_r1_ext.config.grpo_config",
    "SGLangClient": "open_r1_ext.sglang_client",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'open_r1_ext' has no attribute {name!r}")
