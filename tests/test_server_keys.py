"""The API key and the admin key on both servers, each started as the launchers start it: the run's key from a key file
the launchers write (`run_key.write_run_key`, read with `--config`), the admin key as `--admin-api-key`. Real SGLang
0.5.23 on the CPU and the built-in server answer alike: 401 without the key (`/health` open), the admin routes only to
the admin key, the other routes only to the API key; and the client sends each key where it belongs."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from open_r1_ext.launch.local_server import BuiltinServer, SGLangServer
from open_r1_ext.config.recipe import load_recipe
from open_r1_ext.launch.run_key import key_file, new_key, read_run_key, write_run_key
from open_r1_ext.sglang_client import ServerError, ServerRequestError, SGLangClient
from tests.conftest import PROTOCOL_SERVERS
from tests.helpers import restore_default_weights
from tests.weight_buckets import send_model
from tests.slurm_helpers import RECIPE

ADMIN_KEY = "admin-key"


def run_recipe(tiny_model, run_dir: Path, *overrides: str):
    return load_recipe(RECIPE, [f"model.name_or_path={tiny_model}", f"trainer.output_dir={run_dir}", *overrides])


@pytest.fixture(scope="module", params=PROTOCOL_SERVERS)
def keyed(request, tiny_model, tmp_path_factory):
    """A server started with a generated run key file (`--config`) and an admin key: `(server, api key)`."""
    run_dir = tmp_path_factory.mktemp("keyed-run")
    recipe = run_recipe(tiny_model, run_dir)
    write_run_key(recipe, run_dir)
    flags = ("--config", str(key_file(run_dir)), "--admin-api-key", ADMIN_KEY)
    log = str(run_dir / "server.log")
    if request.param == "builtin":
        server = BuiltinServer(str(tiny_model), log_path=log, extra_args=("--no-ref-slot", *flags))
    else:
        server = SGLangServer(str(tiny_model), python=request.getfixturevalue("sglang_python"), log_path=log,
                              extra_args=flags)
    with server:
        yield server, read_run_key(recipe, run_dir)


def test_a_server_started_with_the_run_key_file_wants_the_key(keyed):
    server, key = keyed
    assert key.encode() not in Path(f"/proc/{server.process.pid}/cmdline").read_bytes()  # what `ps` shows
    assert requests.get(f"{server.url}/health", timeout=30).status_code == 200  # open, as for SGLang's probes
    for wrong in (None, "Bearer nope", f"Bearer {ADMIN_KEY}"):  # the admin key opens only the admin routes
        headers = {"Authorization": wrong} if wrong else {}
        for method, route, body in (("GET", "/model_info", None), ("POST", "/generate", {"input_ids": [1, 2]}),
                                    ("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 1})):
            r = requests.request(method, f"{server.url}{route}", json=body, headers=headers, timeout=30)
            assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"}), (route, wrong)
    for scheme in ("Bearer", "bearer", "BEARER"):  # the scheme in any case (RFC 7235), as SGLang reads it
        r = requests.get(f"{server.url}/model_info", headers={"Authorization": f"{scheme} {key}"}, timeout=30)
        assert r.status_code == 200, scheme
    client = SGLangClient(server.url, api_key=key)
    assert len(client.ref_logprobs([[1, 2, 3]])[0]) == 2
    assert client.generate([[1, 2]], {"max_new_tokens": 2, "ignore_eos": True})[0][0].finish_reason == "length"


def test_the_admin_routes_take_only_the_admin_key(keyed, tiny_model):
    server, key = keyed
    with pytest.raises(ServerRequestError, match="HTTP 401"):  # the API key does not open them
        SGLangClient(server.url, api_key=key, max_retries=0).update_weights_from_disk(str(tiny_model), "3")
    r = requests.post(f"{server.url}/flush_cache", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 401
    client = SGLangClient(server.url, api_key=key, admin_api_key=ADMIN_KEY)  # the admin key on those routes only
    try:
        assert client.update_weights_from_disk(str(tiny_model), "3")["success"]
        assert client.weight_version() == "3"
        assert requests.post(f"{server.url}/flush_cache", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                             timeout=30).status_code == 200
    finally:
        restore_default_weights(server.url, tiny_model, api_key=key, admin_api_key=ADMIN_KEY)


def test_the_distributed_weight_update_routes_take_only_the_admin_key(keyed, tiny_model):
    """`sync.transport: distributed`: SGLang's five weight-update routes are admin routes too; the client sends the
    admin key there."""
    server, key = keyed
    refused = send_model([server.url], tiny_model, "4", api_key=key)[server.url]
    assert "HTTP 401" in str(refused)
    try:
        assert send_model([server.url], tiny_model, "4", api_key=key, admin_api_key=ADMIN_KEY) == {server.url: None}
        assert SGLangClient(server.url, api_key=key).weight_version() == "4"
    finally:
        restore_default_weights(server.url, tiny_model, api_key=key, admin_api_key=ADMIN_KEY)


def test_generated_keys_never_start_with_a_dash_and_a_given_one_that_does_is_refused(tmp_path, tiny_model,
                                                                                    sglang_python):
    """SGLang's `--config` turns the key file into `--api-key VALUE`, so a key starting with `-` reads as a flag and
    SGLang exits at start ("expected one argument"; `secrets.token_urlsafe`, the old generator, starts with `-` once in
    64). Generated keys are hex; a recipe's own key starting with `-` is refused before anything starts."""
    keys = {new_key() for _ in range(2000)}
    assert len(keys) == 2000 and not any(k.startswith("-") for k in keys) and all(len(k) == 64 for k in keys)
    with pytest.raises(ValueError, match=r"servers.api_key: starts with '-'"):
        run_recipe(tiny_model, tmp_path / "run", "servers.api_key=-abc")
    key_file(tmp_path).write_text('api-key: "-abc"\n')  # such a file, as it would have been written
    server = SGLangServer(str(tiny_model), python=sglang_python, log_path=str(tmp_path / "sglang.log"),
                          extra_args=("--config", str(key_file(tmp_path))))
    with pytest.raises(ServerError, match="exited with code 2 while starting"):
        server.start()
    assert "argument --api-key: expected one argument" in (tmp_path / "sglang.log").read_text()
