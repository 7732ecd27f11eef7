"""The explicit API's `policy_loss`: posttrain's verl-named policy losses and loss aggregation through
loss_fn_config. Through the client it gives the loss and the gradients of `compute_policy_loss` on the same
log-probs, normalised by the whole request however it is split over workers; bad configs are ValueErrors
at the call. And `SamplingClient.sample`'s arguments that this backend cannot honour are errors, never
silently ignored."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence

from posttrain import client as tinker
from posttrain.algorithms.policy_loss import compute_policy_loss
from posttrain.algorithms.registry import get_policy_loss
from posttrain.client import types
from posttrain.client.batching import check_request, datums_to_batch
from posttrain.data import keys
from posttrain.workers.api_worker import ApiLossSpec, api_loss

TEXTS = ("12+34=46", "7+8=15", "5+60=65")
ADVANTAGES = (1.0, -0.5, 2.0)
PROMPT = 4  # the first 4 positions are the prompt: weight 0
CLIP = {"clip_ratio_low": 0.1, "clip_ratio_high": 0.15}  # narrow, so that some tokens clip


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tinker.ServiceClient]:
    with tinker.ServiceClient(backend="local", root_dir=tmp_path_factory.mktemp("policy_loss")) as svc:
        yield svc


def rl_data(tokenizer, sampler_lps: list[torch.Tensor] | None = None) -> list[types.Datum]:  # noqa: ANN001
    """Datums with weights 0 on the prompt and 1 on the answer, one advantage each, and behaviour
    log-probs `sampler_lps` (the learner's moved by up to +-0.4, so ratios differ from 1; -2 if None)."""
    data = []
    for i, (text, advantage) in enumerate(zip(TEXTS, ADVANTAGES, strict=True)):
        ids = tokenizer.encode(text)
        n = len(ids) - 1
        old = (
            [-2.0] * n
            if sampler_lps is None
            else (sampler_lps[i] + 0.4 * torch.sin(torch.arange(n) * 1.7)).tolist()
        )
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={
                    "target_tokens": ids[1:],
                    "logprobs": old,
                    "advantages": [advantage] * n,
                    "weights": [0.0] * PROMPT + [1.0] * (n - PROMPT),
                },
            )
        )
    return data


def padded(data: list[types.Datum], key: str) -> torch.Tensor:
    return pad_sequence([d.loss_fn_inputs[key].to_torch().float() for d in data], batch_first=True)


def direct_loss(data: list[types.Datum], lps: list[torch.Tensor], mode: str) -> torch.Tensor:
    """posttrain's compute_policy_loss (vanilla, CLIP) on the whole request as one right-padded block."""
    loss, _ = compute_policy_loss(
        get_policy_loss("vanilla"),
        pad_sequence(lps, batch_first=True),
        padded(data, "logprobs"),
        padded(data, "advantages"),
        padded(data, "weights"),
        options=CLIP,
        loss_agg_mode=mode,
    )
    return loss


def logprobs(out: types.ForwardBackwardOutput) -> list[torch.Tensor]:
    return [o["logprobs"].to_torch() for o in out.loss_fn_outputs]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_policy_loss_gives_compute_policy_losss_loss_and_gradients(
    service: tinker.ServiceClient, tiny_model_dir: Path, mode: str
) -> None:
    """Same start (two LoRA clients, one seed): `policy_loss` through the API and compute_policy_loss as a
    custom loss (differentiated for real) give the same loss, gradient norm and weights after a step."""
    api = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=11)
    custom = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=11)
    tok = api.get_tokenizer()
    learner = logprobs(api.forward(rl_data(tok), "policy_loss").result())
    data = rl_data(tok, learner)

    out = api.forward_backward(data, "policy_loss", {"loss_agg_mode": mode, **CLIP}).result()
    expected = direct_loss(data, logprobs(out), mode).item()
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    ratios = torch.cat(
        [(lp - padded([d], "logprobs")[0]).exp() for lp, d in zip(logprobs(out), data, strict=True)]
    )
    assert ((ratios < 1 - CLIP["clip_ratio_low"]) | (ratios > 1 + CLIP["clip_ratio_high"])).any(), "clips"

    by_hand = custom.forward_backward_custom(data, lambda batch, lps: (direct_loss(batch, lps, mode), {}))
    assert by_hand.result().metrics["loss:sum"] == pytest.approx(out.metrics["loss:sum"], rel=1e-5)
    step = types.AdamParams(learning_rate=1e-2)
    g_api = api.optim_step(step).result().metrics["grad_norm:mean"]
    g_custom = custom.optim_step(step).result().metrics["grad_norm:mean"]
    assert g_api > 0 and g_api == pytest.approx(g_custom, rel=1e-4)
    probe = rl_data(tok)[:1]
    torch.testing.assert_close(
        logprobs(api.forward(probe, "policy_loss").result())[0],
        logprobs(custom.forward(probe, "policy_loss").result())[0],
        atol=1e-5,
        rtol=0,
    )


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_every_workers_split_sums_to_the_whole_requests_loss(tiny_model_dir: Path, mode: str) -> None:
    """The worker's loss over the request split in 2 (3 datums: one padding row) and in 1 are equal: the
    totals are the request's, computed by the client before the split."""
    from posttrain.models import load_tokenizer

    data = rl_data(load_tokenizer(str(tiny_model_dir)))
    spec = ApiLossSpec("policy_loss", check_request(data, "policy_loss", {"loss_agg_mode": mode}))
    assert spec.config["global_tokens"] == sum(d.model_input.length - PROMPT for d in data)
    assert spec.config["global_seqs"] == 3

    def worker_loss(batch) -> float:  # noqa: ANN001
        lp = -torch.rand(batch[keys.INPUT_IDS].shape, generator=torch.Generator().manual_seed(0))
        return float(api_loss(spec, lp, batch, {}))

    whole = datums_to_batch(data, 1)
    split = datums_to_batch(data, 2)
    assert len(split) == 4
    parts = sum(worker_loss(part) for part in split.chunk(2))
    # the same random log-probs per row: rows are sorted alike, and padding rows count nothing
    assert parts == pytest.approx(worker_loss(whole), rel=1e-6)
    assert math.isfinite(parts) and parts != 0.0


def test_bad_policy_loss_calls_are_clear_errors(service: tinker.ServiceClient, tiny_model_dir: Path) -> None:
    tc = service.create_lora_training_client(str(tiny_model_dir), rank=2, seed=12)
    data = rl_data(tc.get_tokenizer())
    with pytest.raises(ValueError, match="unknown policy loss 'grpo'; valid: .*gspo.*vanilla"):
        tc.forward_backward(data, "policy_loss", {"policy_loss": "grpo"})
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'; valid: token-mean"):
        tc.forward_backward(data, "policy_loss", {"loss_agg_mode": "mean"})
    with pytest.raises(ValueError, match="policy loss 'gspo' does not take loss_fn_config tau_pos; valid: "):
        tc.forward_backward(data, "policy_loss", {"policy_loss": "gspo", "tau_pos": 1.0})
    no_weights = [
        types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items() if k != "weights"},
        )
        for d in data
    ]
    with pytest.raises(ValueError, match="'policy_loss' needs loss_fn_inputs weights"):
        tc.forward_backward(no_weights, "policy_loss")
    halves = [
        types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={**d.loss_fn_inputs, "weights": [0.5] * d.model_input.length},
        )
        for d in data
    ]
    with pytest.raises(ValueError, match="datum 0: weights must be the 0/1 response mask"):
        tc.forward_backward(halves, "policy_loss")
    # tinker's own names stay tinker's: "gspo" as a loss name is tinker's gspo, which needs its ratio mask
    with pytest.raises(ValueError, match="'gspo' needs loss_fn_inputs sequence_ratio_mask"):
        tc.forward_backward(no_weights, "gspo")


def test_sample_arguments_it_cannot_honour_are_errors(
    service: tinker.ServiceClient, tiny_model_dir: Path
) -> None:
    sampler = service.create_sampling_client(base_model=str(tiny_model_dir))
    prompt = types.ModelInput.from_ints(sampler.get_tokenizer().encode("1+2="))
    params = types.SamplingParams(max_tokens=3, seed=0)
    with pytest.raises(ValueError, match="topk_sample_logprobs: .* not supported"):
        sampler.sample(prompt, 1, params, topk_sample_logprobs=2)
    # at their defaults they are accepted, as tinker's are
    out = sampler.sample(prompt, 1, params, True, 0, 0, None, 0, None).result()
    assert len(out.sequences) == 1 and out.prompt_logprobs is not None
