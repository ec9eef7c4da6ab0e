"""What would kill a real SGLang 0.5.23 server (on the CPU here) is never sent, and what a killed one leaves is cleaned
up: a token id past the served model's vocabulary (its scheduler dies of an `IndexError`, and the whole server with
it) is refused by the trainer at start-up (a tokenizer larger than the served vocabulary) and by the client before any
request leaves; a SIGKILLed SGLang's files in /dev/shm (`sem.mp-*`, `sglang_loads_*.shm`) are removed once it is gone,
and only its own; a server is given a port that no outgoing connection takes while it starts. The vocabulary checks
run on the built-in server too (it answers such ids with HTTP 400)."""

import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from datasets import Dataset
from transformers import AutoTokenizer

from open_r1_ext import RemoteGRPOTrainer
from open_r1_ext.launch.local_server import (EPHEMERAL_PORTS, LOWEST_FREE_PORT, ORPHAN_AGE_S, PORT_RACE_RETRIES,
                                             PORT_TAKEN, SHARED_MEMORY, BuiltinServer, SGLangServer, SharedMemoryFiles,
                                             free_port)
from open_r1_ext.sglang_client import OutOfVocabularyError, ServerError, SGLangClient
from tests.helpers import reward_len, tiny_config

# Tokens added to the tiny tokenizer: ids 300-339, past the model's 300. SGLang pads its embedding to a multiple of 64
# rows: an id in 300-319 reads a padding row (garbage, silently), one from 320 on kills its scheduler.
ADDED = [f"<tool_{i}>" for i in range(40)]


@pytest.fixture(scope="module", params=("builtin", "sglang"))
def own_server(request):
    """The module's own server of each kind (not the session's shared SGLang: a test here that fails kills it)."""
    return request.getfixturevalue("server" if request.param == "builtin" else "sglang_server")


@pytest.fixture(scope="module")
def larger_tokenizer(tiny_model, tmp_path_factory) -> Path:
    """The tiny model's tokenizer with 40 tokens added (340 in all), its model left at a vocabulary of 300."""
    tokenizer, directory = AutoTokenizer.from_pretrained(tiny_model), tmp_path_factory.mktemp("larger-tokenizer")
    tokenizer.add_tokens(ADDED)
    tokenizer.save_pretrained(directory)
    return directory


def healthy(url: str) -> bool:
    return requests.get(f"{url}/health", timeout=30).status_code == 200


def test_a_tokenizer_larger_than_the_served_vocabulary_is_refused_at_start_up(own_server, tiny_model, larger_tokenizer,
                                                                             tmp_path):
    """The prompts use the added tokens: without the check the first batch would carry ids 320-327 to the server."""
    prompts = Dataset.from_list([{"prompt": f"{ADDED[20 + i]} What is {i} + {i}?"} for i in range(8)])
    args = tiny_config(tmp_path, generation_url=own_server.url, max_steps=1)
    tokenizer = AutoTokenizer.from_pretrained(larger_tokenizer)
    with pytest.raises(ValueError, match=rf"the tokenizer {larger_tokenizer} has 340 tokens \(added tokens included\), "
                                         rf"more than the 300 of the served model {tiny_model}"):
        trainer = RemoteGRPOTrainer(model=str(tiny_model), processing_class=tokenizer, reward_funcs=reward_len,
                                    args=args, train_dataset=prompts)
        trainer.train()
    assert healthy(own_server.url)


def test_token_ids_outside_the_served_vocabulary_are_never_sent(own_server):
    client = SGLangClient(own_server.url, max_retries=0)
    with pytest.raises(OutOfVocabularyError, match=rf"not sent to {own_server.url}: token id 300 of prompt 1 is "
                                                   r"outside the vocabulary of the model it serves \(.*: ids 0-299\)"):
        client.generate([[1, 2], [5, 300, 6], [320]], {"max_new_tokens": 2})
    with pytest.raises(OutOfVocabularyError, match="token id -1 of sequence 0"):
        client.ref_logprobs([[1, -1, 2]])
    assert healthy(own_server.url)
    (completion,), = client.generate([[5, 299, 6]], {"max_new_tokens": 2, "ignore_eos": True})  # the last id is fine
    assert len(completion.token_ids) == 2


def test_threads_sending_their_first_requests_together_ask_the_vocabulary_once(server):
    """In-flight generation sends each group from a thread of its own, all at once: one of them asks `/model_info` and
    reads the model's config, the others wait for it (without the lock all four asked, each sending its request only
    after its own answer and config read)."""
    client = SGLangClient(server.url)
    asked, model_info, together = [], client.model_info, threading.Barrier(4)
    client.model_info = lambda: asked.append(threading.get_ident()) or model_info()

    def first_request(_) -> int:
        together.wait(timeout=30)
        (completion,), = client.generate([[5, 6]], {"max_new_tokens": 1})
        return len(completion.token_ids)

    with ThreadPoolExecutor(max_workers=4) as threads:
        assert list(threads.map(first_request, range(4))) == [1] * 4
    assert len(asked) == 1, asked


def test_a_killed_sglang_server_leaves_no_shared_memory_file_and_another_servers_stay(tiny_model, sglang_python,
                                                                                      sglang_server, tmp_path):
    """SIGKILL to the server's whole process group (its launcher, scheduler, detokenizer and their resource tracker),
    as the OOM killer or a node's cleanup would: SGLang's own unlinks never run. Another SGLang serves meanwhile."""
    other = SharedMemoryFiles()
    other.note(sglang_server.process.pid)
    assert other.files  # the other server has files there too, which must stay
    victim = SGLangServer(str(tiny_model), python=sglang_python, log_path=str(tmp_path / "victim.log")).start()
    left = victim.shared_memory.files
    assert sorted(Path(path).name[:7] for path in left) == ["sem.mp-", "sglang_"]  # sem.mp-*, sglang_loads_*.shm
    opened = [os.open(path, os.O_RDONLY) for path in left]  # held here meanwhile: another test's server starting
    try:  # now would take them for orphans once a minute old (`remove_orphaned_shared_memory`)
        os.killpg(victim.process.pid, signal.SIGKILL)
        victim.process.wait()
        assert all(os.path.exists(path) for path in left)  # SGLang removed none of them
    finally:
        for fd in opened:
            os.close(fd)
    victim.stop()  # the server is gone: its files go
    assert not [path for path in left if os.path.exists(path)]
    assert all(os.stat(path).st_ino == inode for path, inode in other.files.items())
    assert healthy(sglang_server.url)


def test_files_that_killed_servers_left_are_removed_as_a_server_starts_and_held_ones_stay(tiny_model, sglang_server,
                                                                                          tmp_path):
    """What a server SIGKILLed before anyone could remove its files leaves (a job task SIGKILLed by SLURM after its
    KillWait, 5 s on the local cluster) is removed as the next server starts on the node: files of SGLang's kinds
    that no process maps or holds, older than a minute. A running SGLang's files stay, old or not, and so does a file
    just made."""
    running = SharedMemoryFiles()
    running.note(sglang_server.process.pid)
    long_ago = time.time() - 2 * ORPHAN_AGE_S
    for path in running.files:
        os.utime(path, (long_ago, long_ago))  # as old as an orphan: held, so it stays
    orphans = [SHARED_MEMORY / f"sem.mp-test{os.getpid()}", SHARED_MEMORY / f"sglang_loads_test_{os.getpid()}.shm"]
    young = SHARED_MEMORY / f"sem.mp-young{os.getpid()}"
    for path in [*orphans, young]:
        path.write_bytes(b"\0" * 32)
    for path in orphans:
        os.utime(path, (long_ago, long_ago))
    try:
        with BuiltinServer(str(tiny_model), log_path=str(tmp_path / "server.log")) as started:
            assert healthy(started.url)
        assert not [path for path in orphans if path.exists()]
        assert young.exists() and all(os.stat(path).st_ino == inode for path, inode in running.files.items())
        assert healthy(sglang_server.url)
    finally:
        for path in [*orphans, young]:
            path.unlink(missing_ok=True)


def test_a_server_port_is_one_no_outgoing_connection_takes_meanwhile(server):
    """SGLang binds its port 20-30 s after its launch; an outgoing connection of any process takes its local port from
    the kernel's ephemeral range, so `free_port` picks below it (a start in a test run once met `address already in
    use`, and SGLang then hung until the start-up timeout)."""
    first_ephemeral = int(EPHEMERAL_PORTS.read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1 and all(LOWEST_FREE_PORT <= port < first_ephemeral for port in ports)
    with socket.create_connection(("127.0.0.1", server.port)) as outgoing:
        assert outgoing.getsockname()[1] >= first_ephemeral  # where the connections' ports come from


def test_a_server_whose_port_is_taken_before_it_binds_it_is_launched_again(tiny_model, tmp_path, capfd):
    """Another process takes the chosen port between its choice and the server's bind (what SGLang's `nccl_port`, also
    chosen free and bound later, met once in a test run): the server ends saying `address already in use` and is
    launched again on a new port; one given its port is launched again on it, and fails with its error once the port
    stays taken (`PORT_RACE_RETRIES` more launches, each logged)."""
    log = tmp_path / "server.log"
    chosen = BuiltinServer(str(tiny_model), log_path=str(log))
    taken = chosen.port
    with socket.socket() as other:
        other.bind(("127.0.0.1", taken))
        other.listen()
        with chosen:
            assert chosen.port != taken and healthy(chosen.url)
            assert log.read_text().lower().count(PORT_TAKEN) == 1
            assert f"on port {taken} found a port it binds taken at start-up" in capfd.readouterr().err
        given = BuiltinServer(str(tiny_model), port=taken, log_path=str(tmp_path / "given.log"))
        with pytest.raises(ServerError, match="exited with code"):
            given.start()
        assert given.port == taken
        assert (tmp_path / "given.log").read_text().lower().count(PORT_TAKEN) == 1 + PORT_RACE_RETRIES
