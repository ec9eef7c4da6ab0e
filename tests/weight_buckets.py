"""Helpers of the distributed weight-sync tests: a model's weights in buckets, sent to servers with
`WeightBroadcast` as the trainer sends them (and as `tests/broadcast_client.py` does in a process of its own)."""

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch
from safetensors.torch import load_file

from open_r1_ext.sglang_client import ServerError, SGLangClient
from open_r1_ext.weight_broadcast import Broadcaster, WeightBroadcast

SEQUENCES = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]


def buckets_of(model: Path, count: int) -> list[dict[str, torch.Tensor]]:
    """The tensors of `model`'s `model.safetensors`, in `count` buckets (in name order; the last takes the rest)."""
    tensors = load_file(str(model / "model.safetensors"))
    names = sorted(tensors)
    size = -(-len(names) // count)
    return [{name: tensors[name] for name in names[i * size : (i + 1) * size]} for i in range(count)]


def send_model(urls: Sequence[str], model: Path, version: str, buckets: int = 2,
               sender: Optional[WeightBroadcast] = None, timeout_s: float = 60.0,
               **client_settings) -> dict[str, Optional[ServerError]]:
    """Send `model`'s weights to the servers at `urls` as `version` (a new gloo `WeightBroadcast` unless `sender`, which
    stays open; `client_settings`: the clients' keys); the outcome per URL."""
    own = sender is None
    sender = sender or WeightBroadcast("gloo", torch.device("cpu"), timeout_s=timeout_s)
    try:
        update = sender.update([SGLangClient(url, **client_settings) for url in urls], version, buckets)
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


@contextmanager
def before_broadcast(number: int, action: Callable[[Broadcaster], None]) -> Iterator[None]:
    """In the block, `action(broadcaster)` runs just before the `number`-th bucket is broadcast (an injected fault:
    stop the broadcaster, kill a server, stall)."""
    call, sent = Broadcaster.call, []

    def injected(self, *message, **kwargs):
        if message[0] == "broadcast":
            sent.append(message)
            if len(sent) == number:
                action(self)
        return call(self, *message, **kwargs)

    Broadcaster.call = injected
    try:
        yield
    finally:
        Broadcaster.call = call


def stop_process(broadcaster: Broadcaster) -> None:
    """An injected fault: the broadcaster stalls (SIGSTOP), as a hung collective would."""
    os.kill(broadcaster.process.pid, signal.SIGSTOP)


def kill_trainer_mid_broadcast(url: str, model: Path, version: str, work: Path) -> int:
    """Run `tests/broadcast_client.py` (a trainer sending `model` as `version` to `url`), SIGKILL it once the server
    waits for its second bucket; returns the pid its broadcaster had."""
    stall = work / "stalled"
    process = subprocess.Popen([sys.executable, "-m", "tests.broadcast_client", url, str(model), version, str(stall)],
                               cwd=Path(__file__).resolve().parents[1])
    try:
        deadline = time.monotonic() + 120
        while not stall.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stall.exists(), "the client never reached its second bucket"
        broadcaster = int(stall.read_text())
        os.kill(process.pid, signal.SIGKILL)  # the trainer dies while the server waits for bucket 2
    finally:
        process.kill()
        process.wait()
    return broadcaster
