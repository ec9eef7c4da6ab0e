"""Helpers of the distributed weight-sync tests: a model's weights in buckets, sent to servers with
`WeightBroadcast` as the trainer sends them (and as `tests/broadcast_client.py` does in a process of its own)."""

from pathlib import Path
from typing import Optional, Sequence

import torch
from safetensors.torch import load_file

from open_r1_ext.sglang_client import ServerError, SGLangClient
from open_r1_ext.weight_broadcast import WeightBroadcast

SEQUENCES = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]


def buckets_of(model: Path, count: int) -> list[dict[str, torch.Tensor]]:
    """The tensors of `model`'s `model.safetensors`, in `count` buckets (in name order; the last takes the rest)."""
    tensors = load_file(str(model / "model.safetensors"))
    names = sorted(tensors)
    size = -(-len(names) // count)
    return [{name: tensors[name] for name in names[i * size : (i + 1) * size]} for i in range(count)]


def send_model(urls: Sequence[str], model: Path, version: str, buckets: int = 2,
               sender: Optional[WeightBroadcast] = None, timeout_s: float = 60.0) -> dict[str, Optional[ServerError]]:
    """Send `model`'s weights to the servers at `urls` as `version` (a new gloo `WeightBroadcast` unless `sender`, which
    stays open); the outcome per URL."""
    own = sender is None
    sender = sender or WeightBroadcast("gloo", torch.device("cpu"), timeout_s=timeout_s)
    try:
        update = sender.update([SGLangClient(url) for url in urls], version, buckets)
        for index, bucket in enumerate(buckets_of(model, buckets)):
            update.send(index, bucket)
        return update.finish()
    finally:
        if own:
            sender.close()


def served_logprobs(url: str) -> list[torch.Tensor]:
    return SGLangClient(url).ref_logprobs(SEQUENCES)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))
