"""The KL term at `temperature != 1` (#21 item 6), against a real built-in server on the tiny model: the KL compares
the policy and the reference at temperature 1 (SGLang's and the built-in server's reference log-probs are never
tempered), so it is 0 at identical weights for every temperature, a local reference (TRL's model, or the PEFT policy
without its adapter) and a remote one give the same run, and the policy-gradient part of the loss stays TRL's.
Real SGLang as the reference: tests/test_real_sglang_training.py."""

import peft
import pytest
import torch
from trl import GRPOTrainer

from open_r1_ext import RemoteGRPOTrainer
from open_r1_ext.trainer.remote_trainer import RemoteReference
from open_r1_ext.trainer.untempered_logps import at_temperature_one, laid_out
from tests.helpers import reward_len, tiny_config, tiny_dataset


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def lora_config():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_kl_at_temperature_07_is_zero_at_identical_weights_and_a_local_reference_equals_the_server(
        tiny_model, server, tmp_path, lora):
    """Step 1 trains the initial weights, which are the reference's: its KL is 0. Steps 2-3 move the policy: the run
    with TRL's local reference (its reference model, or the PEFT policy with the adapter disabled) and the run with
    the built-in server's reference give the same losses and KL. Before the fix the server's run logged ~3e-3 at
    step 1 (untempered reference against the tempered policy), and the two runs differed."""
    extra = dict(peft_config=lora_config()) if lora else {}
    settings = dict(temperature=0.7, max_steps=3, learning_rate=1e-2 if lora else 1e-3)
    local = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, train_dataset=tiny_dataset(),
                              args=tiny_config(tmp_path / "local", **settings), **extra)
    assert not isinstance(local.ref_model, RemoteReference)
    local.train()
    remote = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, train_dataset=tiny_dataset(),
                               args=tiny_config(tmp_path / "remote", ref_model_url=f"{server.url}/ref", **settings),
                               **extra)
    remote.train()
    kl_local, kl_remote = logged(local, "kl"), logged(remote, "kl")
    assert len(kl_local) == len(kl_remote) == 3
    assert kl_local[0] == pytest.approx(0.0, abs=1e-9) and kl_remote[0] == pytest.approx(0.0, abs=1e-9)
    assert kl_local[-1] > 1e-6  # the policy moved away from the reference: the KL is really compared
    assert kl_remote == pytest.approx(kl_local, rel=1e-3, abs=1e-8)
    assert logged(remote, "loss") == pytest.approx(logged(local, "loss"), abs=1e-5)


def test_a_batch_trained_twice_at_learning_rate_0_keeps_kl_0(tiny_model, server, tmp_path):
    """`num_iterations: 2` trains each generation batch twice: the loss puts the reference back in the batch as it was
    collected (prefetched from the server), so the second pass shifts it once, not twice. At learning rate 0 the
    policy stays the reference: KL 0 at every step."""
    args = tiny_config(tmp_path, temperature=0.7, max_steps=4, num_iterations=2, learning_rate=0.0,
                       ref_model_url=f"{server.url}/ref")
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    trainer.train()
    assert logged(trainer, "kl") == pytest.approx([0.0] * 4, abs=1e-9)


def completion_logps(model, inputs, temperatures) -> list[torch.Tensor]:
    """The policy's log-probs of the completion tokens at each temperature, by one plain forward of the model."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    width = inputs["completion_ids"].size(1)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -width - 1:-1].float()
    targets = inputs["completion_ids"][..., None]
    return [torch.log_softmax(logits / t, dim=-1).gather(2, targets)[..., 0] for t in temperatures]


def test_the_kl_term_compares_the_models_at_temperature_one_and_the_policy_gradient_part_is_trls(
        tiny_model, server, tmp_path):
    """At step 2 (the policy moved), with the prefetched reference of the built-in server and temperature 0.7: the
    logged KL is the k3 estimate between the policy's log-probs at temperature 1 (a plain forward) and the reference;
    the loss is TRL's own loss with beta = 0 (the policy-gradient part at TRL's tempered log-probs) plus beta x KL, and
    so is its gradient (the KL's through the untempered log-probs, TRL's bias correction through the tempered ratio)."""
    args = tiny_config(tmp_path, temperature=0.7, max_steps=2, ref_model_url=f"{server.url}/ref")
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    assert trainer.reference_prefetch is not None
    compute_loss, checked = trainer._compute_loss, []

    def checked_loss(model, inputs):
        loss = compute_loss(model, inputs)
        if trainer.state.global_step != 1:
            return loss
        params = [p for p in model.parameters() if p.requires_grad]
        kl_logged = trainer._metrics["train"]["kl"][-1]
        grad = torch.autograd.grad(loss, params, retain_graph=True)
        mask = inputs["completion_mask"].float()
        untempered, tempered = completion_logps(model, inputs, (1.0, args.temperature))
        diff = inputs["ref_per_token_logps"] - untempered
        # TRL's bias correction (on by default) weighs each token's KL by the policy-gradient ratio: 1, with a gradient
        ratio = torch.exp(tempered - tempered.detach()) if args.use_bias_correction_kl else 1.0
        kl = (((torch.exp(diff) - diff - 1) * ratio * mask).sum() / mask.sum())
        trainer.beta = 0.0  # stock TRL's loss without the KL term: the policy-gradient part alone
        try:
            policy_gradient = GRPOTrainer._compute_loss(trainer, model, inputs)
        finally:
            trainer.beta = args.beta
        want = torch.autograd.grad(policy_gradient + args.beta * kl, params)
        checked.append((kl_logged, kl.item(), loss.item(), (policy_gradient + args.beta * kl).item(),
                        max((a - b).abs().max().item() for a, b in zip(grad, want))))
        return loss

    trainer._compute_loss = checked_loss
    trainer.train()
    (kl_logged, kl_by_hand, loss, want, grad_diff), = checked
    assert kl_logged > 1e-6
    assert kl_logged == pytest.approx(kl_by_hand, rel=1e-4)
    assert loss == pytest.approx(want, abs=1e-6)
    assert grad_diff < 1e-6


def test_at_temperature_one_scores_the_same_hidden_states_as_a_plain_forward(tiny_model, tmp_path):
    """TRL's fused head with `at_temperature_one`: TRL's log-probs unchanged (tempered), the extra ones equal a plain
    forward at temperature 1, laid out as TRL's (padding and prompt columns 0), in chunks of rows too; `replace` makes
    the head return them."""
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, train_dataset=tiny_dataset(),
                                args=tiny_config(tmp_path, temperature=0.5, beta=0.0))
    model = trainer.model
    ids = torch.tensor([[0, 0, 5, 9, 20, 3, 7], [4, 8, 15, 16, 23, 42, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0]])
    keep = 3
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -keep - 1:-1].float()
    targets = ids[:, -keep:, None]
    want = {t: torch.log_softmax(logits / t, -1).gather(2, targets)[..., 0] * mask[:, -keep:] for t in (0.5, 1.0)}
    with torch.no_grad():
        for batch_size in (None, 1):
            with at_temperature_one() as scored:
                tempered, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep, batch_size)
            torch.testing.assert_close(tempered, want[0.5], atol=1e-5, rtol=0)
            torch.testing.assert_close(laid_out(scored, ids, mask, keep, batch_size), want[1.0], atol=1e-5, rtol=0)
        with at_temperature_one(replace=True) as scored:
            replaced, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep)
        assert scored == []
        torch.testing.assert_close(replaced, want[1.0], atol=1e-5, rtol=0)
        untouched, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep)  # closed: TRL's again
    torch.testing.assert_close(untouched, want[0.5], atol=1e-5, rtol=0)
