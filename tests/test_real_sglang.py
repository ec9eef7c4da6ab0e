"""Real SGLang 0.5.23 on this machine's CPU, driven by the project's client: the install (`make sglang-venv`) and the
`SGLangServer` runner work, and the reference log-probs it serves are the tiny model's own. On the protocol suite's
shared server (`shared_sglang`): a start of its own would cost ~20-30 s."""

import torch
from transformers import AutoModelForCausalLM

from open_r1_ext.sglang_client import SGLangClient


def test_real_sglang_serves_the_reference_log_probs_of_a_local_forward(shared_sglang, tiny_model):
    client = SGLangClient(shared_sglang.url)
    assert client.server_info()["version"] == "0.5.23"
    sequences = [[5, 17, 42, 9, 100, 3], [7, 8]]
    served = client.ref_logprobs(sequences)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    for ids, got in zip(sequences, served):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-3, rtol=0)  # float32 both; SGLang's kernels sum in another order
