"""Shared fixtures: tiny models built locally (no download) and built-in server processes on free ports."""

from pathlib import Path

import pytest

from tools.make_tiny_model import make_tiny_model

from open_r1_ext.launch.local_server import BuiltinServer


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
    """A built-in server on the tiny model, shared by a test module."""
    log = tmp_path_factory.mktemp("server-log") / "server.log"
    with BuiltinServer(str(tiny_model), log_path=str(log)) as srv:
        yield srv
