"""Dynamic LoRA (#16 item 3, server half): `SGLangClient.load_lora_adapter` / `unload_lora_adapter` /
`generate(..., lora_path=...)` against SGLang 0.5.23's answers (`tests/fake_sglang.py`, a fake SGLang server: SGLang
needs CUDA) and against the real built-in server with the tiny model and a tiny PEFT adapter made here."""

from __future__ import annotations

import pytest

from open_r1_ext.sglang_client import SGLangClient, ServerRequestError
from tests.fake_sglang import FakeSGLang


# ------------------------------------------------------------------------------------------ SGLang 0.5.23 (fake)
def test_client_loads_generates_with_and_unloads_an_adapter_as_sglang_answers(tmp_path):
    adapter = tmp_path / "step-3"
    adapter.mkdir()
    with FakeSGLang(enable_lora=True, api_key="user", admin_api_key="admin") as fake:
        client = SGLangClient(fake.url, api_key="user", admin_api_key="admin")
        loaded = client.load_lora_adapter("policy-v3", str(adapter))
        assert loaded["success"] and loaded["loaded_adapters"] == {"policy-v3": str(adapter)}
        client.generate([[1, 2], [3, 4]], {"max_new_tokens": 2}, n=2, lora_path="policy-v3")
        client.ref_logprobs([[1, 2, 3]])
        assert client.unload_lora_adapter("policy-v3")["loaded_adapters"] == {}
        bodies = {path: (body, auth) for method, path, body, auth in fake.calls if method == "POST"}
        # the admin routes get the admin key (SGLang refuses the user key there once an admin key is set)
        assert bodies["/load_lora_adapter"] == ({"lora_name": "policy-v3", "lora_path": str(adapter), "pinned": False},
                                                "Bearer admin")
        assert bodies["/unload_lora_adapter"] == ({"lora_name": "policy-v3"}, "Bearer admin")
        generate = [body for method, path, body, _ in fake.calls if path == "/generate"]
        assert generate[0]["lora_path"] == ["policy-v3"] * 4  # every item names the adapter
        assert "lora_path" not in generate[1]  # the reference pass: the base model


def test_client_raises_sglang_s_message_when_a_lora_call_fails(tmp_path):
    with FakeSGLang() as fake:  # started without --enable-lora
        with pytest.raises(ServerRequestError, match="LoRA is not enabled. Please set `--enable-lora`") as err:
            SGLangClient(fake.url).load_lora_adapter("v1", str(tmp_path))
        assert err.value.status_code == 400
        with pytest.raises(ServerRequestError, match="LoRA is not enabled"):
            SGLangClient(fake.url).generate([[1]], {"max_new_tokens": 1}, lora_path="v1")
    with FakeSGLang(enable_lora=True) as fake:
        client = SGLangClient(fake.url)
        client.load_lora_adapter("v1", str(tmp_path))
        with pytest.raises(ServerRequestError, match="refused the LoRA adapter v1 .*because it is already loaded"):
            client.load_lora_adapter("v1", str(tmp_path))
        with pytest.raises(ServerRequestError, match="LoRA with name v2 does not exist"):
            client.unload_lora_adapter("v2")
        with pytest.raises(ServerRequestError, match="never been loaded: v2"):
            client.generate([[1]], {"max_new_tokens": 1}, lora_path="v2")
