"""Run by the distributed weight-sync tests as a trainer that dies in the middle of a broadcast: it sends the weights
of MODEL to the server at URL as weight version VERSION in two buckets, over SGLang's distributed weight update; the
first bucket goes through, then, once the server was asked for the second, it stops before broadcasting it (an
injected stall, named as such), writes its broadcaster's pid to STALL_FILE and waits to be killed.

    python -m tests.broadcast_client URL MODEL VERSION STALL_FILE
"""

import sys
import time
from pathlib import Path

from tests.weight_buckets import before_broadcast, send_model

url, model, version, stall_file = sys.argv[1:5]


def stall(broadcaster) -> None:
    time.sleep(1.0)  # the server's request for bucket 2 is on its way: let it arrive (it then waits to receive)
    Path(stall_file).write_text(str(broadcaster.process.pid))
    time.sleep(600)  # injected stall: killed by the test


with before_broadcast(2, stall):
    send_model([url], Path(model), version, buckets=2, timeout_s=120)
