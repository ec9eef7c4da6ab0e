"""How training ends when a server fails, told as one story: a short message (what failed, which server, what to run
next), the traceback in a file, the failing step's metrics logged, a checkpoint to resume from; and one retry budget
per failure (a reload does not multiply the client's retries). Real server processes and the real tiny model."""

import contextlib
import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from http.server import BaseHTTPRequestHandler
from types import SimpleNamespace

import pytest

from open_r1_ext import RemoteGRPOTrainer
from open_r1_ext.launch.local_server import BuiltinServer, free_port
from open_r1_ext.sglang_client import SGLangClient, ServerError
from open_r1_ext.trainer.weight_sync import SyncTarget, WeightSync, WeightSyncError
from tests.helpers import (REPO, KillServerAt, children, http_server, reward_len, start_training, step_lines,
                           tiny_config, tiny_dataset, tiny_recipe)


class Unavailable(BaseHTTPRequestHandler):
    """Answers every request 503, counting them: a stand-in for a server that keeps failing."""

    calls = 0

    def do_POST(self):
        type(self).calls += 1
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST

    def log_message(self, *args):
        pass


def test_a_lost_server_costs_one_retry_budget_not_one_per_reload_attempt(tmp_path):
    with http_server(Unavailable) as url:
        client = SGLangClient(url, max_retries=2, backoff_factor=0.0)
        sync = WeightSync(SimpleNamespace(is_main_process=True, num_processes=1), str(tmp_path / "weights"), 2,
                          str(tmp_path / "weight_sync.jsonl"), targets=[])
        with pytest.raises(WeightSyncError, match="the generation server did not take the new weights"):
            sync.push(SyncTarget("generation", client), tmp_path, "1")
        assert Unavailable.calls == 3  # the client's 1 + 2 retries, once (it was 3 reload attempts x 3 before)


class CutsOff(BaseHTTPRequestHandler):
    """Answers the first `cut_offs` requests with headers and a part of the body, then closes the connection (a server
    killed while it answered); later ones in full."""

    calls, cut_offs = 0, 0

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).calls += 1
        body = b'{"weight_version": "7"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.calls <= self.cut_offs:
            self.wfile.write(body[:5])
            self.close_connection = True
            return
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("cut_offs,answered", [(2, True), (3, False)])
def test_an_answer_that_breaks_off_is_sent_again_as_often_as_max_retries(cut_offs, answered):
    CutsOff.calls, CutsOff.cut_offs = 0, cut_offs
    with http_server(CutsOff) as url:
        client = SGLangClient(url, max_retries=2, backoff_factor=0.0)
        if answered:
            assert client.post_json("/generate", {"input_ids": [1]}) == {"weight_version": "7"}
        else:
            with pytest.raises(ServerError, match=r"/generate: the answer broke off 3 times"):
                client.post_json("/generate", {"input_ids": [1]})
    assert CutsOff.calls == 3


def test_a_failed_sync_logs_its_step_saves_a_checkpoint_and_says_what_next(tiny_model, tmp_path):
    srv = BuiltinServer(str(tiny_model)).start()
    killer = KillServerAt(srv, step=2)  # before the weight-sync callback: the sync of step 2 finds no server
    args = tiny_config(tmp_path, max_steps=5, generation_url=srv.url, ref_model_url=f"{srv.url}/ref", max_retries=1)
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset(),
                                callbacks=[killer])
    try:
        with pytest.raises(ServerError) as failed:
            trainer.train()
    finally:
        killer.stop()
    message = str(failed.value)
    assert srv.url in message and "Training stopped at step 2. A checkpoint to resume from is in" in message
    assert message.endswith("run the same command again once the server answers again (see its log).")
    assert "dump" not in message  # the cause is the server, not the disk
    assert [h["step"] for h in trainer.state.log_history if "reward" in h] == [1, 2]  # step 2's metrics not lost
    assert (tmp_path / "checkpoint-2" / "trainer_state.json").is_file()


def test_train_ends_with_a_short_message_and_the_traceback_in_a_file(tmp_path, tiny_model):
    recipe = tiny_recipe(tmp_path, tiny_model, max_steps=40, max_retries=1)
    run = tmp_path / "run"
    trainer = start_training(recipe)
    try:
        assert step_lines(trainer, until_step=1) == [1]
        server = children(trainer.pid, "open_r1_ext.server")[0]
        subprocess.run(["kill", "-9", str(server)], check=True)
        step_lines(trainer, until_step=10**6)
        code, err = trainer.wait(timeout=300), trainer.stderr.read()
    finally:
        trainer.kill()
    assert code == 1
    assert "Traceback" not in err, err[-3000:]
    assert f"(traceback in {run}/traceback.log)" in err
    assert "run the same command again once the server answers again" in err
    assert "Traceback" in (run / "traceback.log").read_text()


def test_waiting_for_a_dead_server_writes_a_line_every_10_s_to_a_log_file(tmp_path, tiny_model):
    """`open-r1-ext train` against a port where nothing listens, its output a file (a SLURM log): a line every 10 s
    naming the URL it waits for (not a bar redrawn every second: 25 lines in 25 s), then the error."""
    recipe = tiny_recipe(tmp_path, tiny_model)
    url = f"http://127.0.0.1:{free_port()}"
    log = tmp_path / "slurm-train.out"
    with open(log, "w") as out:
        code = subprocess.run([sys.executable, "-m", "open_r1_ext.cli", "train", str(recipe), "--server-url", url,
                               "--set", "trainer.server_wait_timeout=25"], cwd=REPO, stdout=out,
                              stderr=subprocess.STDOUT, timeout=600).returncode
    text = log.read_bytes().decode()
    assert code == 1, text[-3000:]
    naming = [line for line in text.splitlines() if url in line]  # lines as a viewer splits them: at \n and \r
    waits = [line for line in text.split("\n") if re.fullmatch(  # the reference (in the server's /ref slot) first
        rf"\[\d\d:\d\d:\d\d\] waiting for {url}(/ref)?/health \(\d+ s of at most 25 s\)", line)]
    assert 2 <= len(waits) <= 4, text[-3000:]  # at ~2, 12 and 22 s: whole lines, no bar redrawn with \r
    assert len(naming) <= len(waits) + 2, naming  # and the error naming it
    assert any(re.search(f"{url}(/ref)? did not become healthy within 25 s", line) for line in naming), text[-3000:]


def test_waiting_on_a_terminal_keeps_the_bar():
    """The same wait with stderr on a terminal (a pseudo-terminal here): tqdm's bar, redrawn in place, no lines."""
    url = f"http://127.0.0.1:{free_port()}"
    code = ("from open_r1_ext.sglang_client import SGLangClient, ServerError\n"
            f"try:\n    SGLangClient({url!r}).wait_until_healthy(timeout=5, poll_interval=0.5)\n"
            "except ServerError as err:\n    print('gave up:', err)\n")
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal 120 columns wide
    process = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=follower, stderr=follower)
    os.close(follower)
    chunks = []
    with contextlib.suppress(OSError):  # EIO once the child closed the terminal
        while chunk := os.read(leader, 4096):
            chunks.append(chunk)
    os.close(leader)
    assert process.wait(timeout=60) == 0
    text = b"".join(chunks).decode(errors="replace")
    assert f"gave up: {url} did not become healthy within 5 s" in text, text
    assert f"\rwaiting for {url}/health: 00:02 of at most 5 s" in text, text  # the bar, redrawn in place
    assert "] waiting for" not in text  # no log lines
