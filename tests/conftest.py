"""Shared fixtures: tiny models built locally (no download), built-in and real SGLang server processes on free ports,
the local SLURM cluster and a tiny run on it."""

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from xdist.scheduler import LoadGroupScheduling

from tools.make_tiny_model import make_tiny_model

from open_r1_ext.launch.local_server import BuiltinServer, SGLangServer, free_port
from open_r1_ext.sglang_client import SGLangClient
from tests.helpers import LORA_FLAGS, SGLANG_FLOAT32, restore_default_weights
from tests.slurm_helpers import REPO, TinyRun, fake_slurm_commands

# One torch thread per process: the tests run trainers and servers side by side on 2 cores, and OpenMP pools that
# together want more threads than there are cores spin against each other (two trainer tests: 51 s with the default,
# 26 s like this). Children (trainer processes, SLURM jobs) inherit the variable; this process's OpenMP runtime read
# the environment when torch was imported, so a thread started here still defaults to every core
# (test_server's thread-count test relies on that).
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"
# DeepSpeed builds its CPU communication op (~45 s of CPU) into TORCH_EXTENSIONS_DIR, by default one directory for
# every venv of this user: its build files name the venv, so a checkout's tests and a fresh clone's, run side by side,
# rebuilt it at each switch while the other trainers waited on its lock (69 s seen). Here it is the venv's own
# torch_extensions/, where `make venv` builds the op once; children (trainer processes, SLURM jobs) inherit it.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
# torch builds it with the first `ninja` on PATH: the venv's (pip's, as `make venv` and the SLURM jobs of the tests find
# it, `slurm_helpers.job_env`) or the system's. Each of the two builds the op again after the other (their build logs
# do not agree: ~25-45 s of CPU each time, every other trainer waiting on its lock), so every process here finds the
# venv's first.
if os.environ["PATH"].split(os.pathsep)[0] != str(Path(sys.prefix) / "bin"):
    os.environ["PATH"] = f"{Path(sys.prefix) / 'bin'}{os.pathsep}{os.environ['PATH']}"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny Qwen2 model, seed 0."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-seed0"), seed=0)


@pytest.fixture(scope="session")
def other_tiny_model(tmp_path_factory) -> Path:
    """The same architecture with other weights (seed 1)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-seed1"), seed=1)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """A built-in server on the tiny model, shared by a test module; seeded sampling is reproducible
    (`--enable-deterministic-inference`)."""
    log = tmp_path_factory.mktemp("server-log") / "server.log"
    with BuiltinServer(str(tiny_model), log_path=str(log), deterministic=True) as srv:
        yield srv


@pytest.fixture(scope="session")
def lora_builtin_server(tiny_model, tmp_path_factory):
    """A built-in server for adapter-only LoRA runs, one per pytest process (tests/test_lora.py and
    tests/test_inflight_lora.py, one xdist group, through test_lora's `lora_server`, which unloads a test's adapters
    afterwards): generation with the adapters and the reference with its base model (no `/ref` slot)."""
    log = tmp_path_factory.mktemp("lora-server") / "server.log"
    with BuiltinServer(str(tiny_model), log_path=str(log), extra_args=("--no-ref-slot", *LORA_FLAGS)) as srv:
        yield srv


SGLANG_PYTHON_ENV = "OPEN_R1_EXT_SGLANG_PYTHON"  # another venv's interpreter with SGLang; default: the repo's .venv-sglang


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """The interpreter of the venv that has real SGLang 0.5.23 for the CPU (`make sglang-venv`, which `make test`
    runs first). Without it the tests against real SGLang fail, naming the fix: they are never skipped."""
    python = os.environ.get(SGLANG_PYTHON_ENV) or str(REPO / ".venv-sglang" / "bin" / "python")
    assert Path(python).is_file(), (f"no SGLang interpreter at {python}: run `make sglang-venv` (or set "
                                    f"{SGLANG_PYTHON_ENV} to the python of a venv made by tools/sglang_cpu/install.sh)")
    return python


@pytest.fixture(scope="module")
def sglang_server(tiny_model, sglang_python, tmp_path_factory):
    """Real SGLang on the CPU serving the tiny model, shared by a test module. SGLang's CPU backend has no
    deterministic mode (`--enable-deterministic-inference` needs a GPU attention backend), so it ignores
    `sampling_seed`; `--random-seed 0` makes a fresh server's sequence of samples repeatable."""
    log = tmp_path_factory.mktemp("sglang-log") / "sglang.log"
    with SGLangServer(str(tiny_model), python=sglang_python, log_path=str(log), extra_args=(*SGLANG_FLOAT32, "--random-seed", "0")) as srv:
        yield srv


@pytest.fixture(scope="session")
def shared_sglang(tiny_model, sglang_python, tmp_path_factory):
    """Real SGLang on the tiny model for the protocol suite (`protocol_server`), one per pytest process: every start
    costs ~20 s of the suite, so the modules share it. A test that reloads its weights puts the start-up weights back
    (`helpers.restore_default_weights`); nothing may rely on the order of its samples (it serves many tests)."""
    log = tmp_path_factory.mktemp("shared-sglang-log") / "sglang.log"
    with SGLangServer(str(tiny_model), python=sglang_python, log_path=str(log), extra_args=(*SGLANG_FLOAT32, "--random-seed", "0")) as srv:
        yield srv


PROTOCOL_SERVERS = ("builtin", "sglang")


@pytest.fixture(scope="module", params=PROTOCOL_SERVERS)
def protocol_server(request):
    """The server of a protocol test, which runs once on each: the module's built-in server (`server`, deterministic)
    and real SGLang 0.5.23 on the CPU (`shared_sglang`, which has no deterministic mode: it ignores `sampling_seed`).
    `protocol_server.engine` says which; what only one of them does is asserted for that one, saying why."""
    return request.getfixturevalue("server" if request.param == "builtin" else "shared_sglang")


@pytest.fixture()
def any_server(protocol_server, tiny_model):
    """A test that runs on the built-in server and on real SGLang (`protocol_server`: the module's built-in server, the
    SGLang server the modules share), which is continued and put back on the tiny model's weights afterwards."""
    yield protocol_server
    SGLangClient(protocol_server.url).continue_generation()
    restore_default_weights(protocol_server.url, tiny_model)


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    """The local one-node cluster, started as CI does; a failure to start fails the tests with its output."""
    started = subprocess.run(["bash", "tools/local_slurm.sh", "start"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert started.returncode == 0, f"tools/local_slurm.sh start failed:\n{started.stdout}\n{started.stderr}"


@pytest.fixture()
def fake_slurm(tmp_path, monkeypatch):
    """`make(squeue_lines, squeue_error, sbatch_ok)`: stand-in `squeue`, `scancel` and `sbatch`
    (`slurm_helpers.fake_slurm_commands`) first on PATH, for the job runtime's tests without a cluster; returns the
    file of their calls."""
    def make(squeue_lines: str = "", squeue_error: str = "", sbatch_ok: int = 99) -> Path:
        calls = fake_slurm_commands(tmp_path / "bin", squeue_lines, squeue_error, sbatch_ok)
        monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
        return calls
    return make


@pytest.fixture()
def signal_handlers():
    """The job runtime installs its own SIGTERM/SIGHUP handlers; give pytest its own back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.fixture()
def tiny_run(tmp_path, tiny_model):
    """A fresh run of the tiny recipe; afterwards every job of it still queued is cancelled, whatever the test did."""
    name = f"t{uuid.uuid4().hex[:6]}"
    overrides = [f"model.name_or_path={tiny_model}", f"trainer.output_dir={tmp_path / 'run'}",
                 f"servers.generation.port={free_port()}", "trainer.max_steps=4", f"slurm.job_name={name}"]
    run = TinyRun(tmp_path / "run", name, overrides)
    try:
        yield run
    finally:
        leftover = [job_id for job_id, _, _ in run.jobs()]
        if leftover:
            subprocess.run(["scancel", *leftover], check=False)


CLUSTER_GROUPS = ("slurm", "rehearsal")  # the tests on the local SLURM cluster: the longest groups, sent out first


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """How `make test` (`pytest -n 3 --dist loadgroup`) spreads the tests over its pytest-xdist workers: the
    rehearsal of the shipped recipes (tests/test_rehearsal.py, its own group) on one worker, the other tests on the
    local SLURM cluster one after the other on another (each checks the jobs of its own run), every other module's
    tests together (its module fixtures, servers mostly, start once), beside and after them. It runs before xdist's hook, which writes the
    groups into the test ids (`tests/test_layout.py` checks that they are there)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            slurm = {"slurm_cluster", "tiny_run"} & set(getattr(item, "fixturenames", ()))
            item.add_marker(pytest.mark.xdist_group("slurm" if slurm else item.module.__name__))


class ClusterGroupsFirst(LoadGroupScheduling):
    """xdist's `loadgroup`, with `CLUSTER_GROUPS` handed out first: each runs its tests one at a time for ~10 minutes,
    most of it waiting on jobs, and xdist (which orders groups by their number of tests) started the SLURM tests a few
    minutes in, the tail of the suite (a fresh clone's `make test`: 23 minutes, the SLURM worker busy to the end)."""

    def _assign_work_unit(self, node) -> None:
        for group in reversed(CLUSTER_GROUPS):
            if group in self.workqueue:
                self.workqueue.move_to_end(group, last=False)
        super()._assign_work_unit(node)


def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") == "loadgroup":
        return ClusterGroupsFirst(config, log)
    return None
