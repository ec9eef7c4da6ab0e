"""Run by the distributed weight-sync tests as a trainer that dies in the middle of a broadcast: it sends the weights
of MODEL to the server at URL as weight version VERSION in two buckets, over SGLang's distributed weight update; the
first bucket goes through, then, once the server was asked for the second, it stops before broadcasting it (an
injected stall, named as such), writes its broadcaster's pid to STALL_FILE and waits to be killed.

    python -m tests.broadcast_client URL MODEL VERSION STALL_FILE
"""

import sys
import time
from pathlib import Path

import torch

from open_r1_ext.sglang_client import SGLangClient
from open_r1_ext.weight_broadcast import Broadcaster, WeightBroadcast
from tests.weight_buckets import buckets_of

url, model, version, stall_file = sys.argv[1:5]
call = Broadcaster.call
broadcasts = []


def stalling_call(self, *message, **kwargs):
    if message[0] == "broadcast":
        broadcasts.append(message)
        if len(broadcasts) == 2:
            time.sleep(1.0)  # the server's request for bucket 2 is on its way: let it arrive (it then waits to receive)
            Path(stall_file).write_text(str(self.process.pid))
            time.sleep(600)  # injected stall: killed by the test
    return call(self, *message, **kwargs)


Broadcaster.call = stalling_call
update = WeightBroadcast("gloo", torch.device("cpu"), timeout_s=120).update([SGLangClient(url)], version, 2)
for index, bucket in enumerate(buckets_of(Path(model), 2)):
    update.send(index, bucket)
