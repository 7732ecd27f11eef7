"""The explicit API (posttrain.client) with tinker's names: every verb, local and on 2 Ray workers, tenants that
never see each other's updates, custom losses, saved states, and the errors of bad calls."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from posttrain import client as tinker
from posttrain.client import types

ADAM = types.AdamParams(learning_rate=3e-3)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tinker.ServiceClient]:
    with tinker.ServiceClient(backend="local", root_dir=tmp_path_factory.mktemp("api")) as svc:
        yield svc


def sft_datum(tokenizer, text: str) -> types.Datum:  # noqa: ANN001
    ids = tokenizer.encode(text)
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )


def rl_datum(tokenizer, text: str, advantage: float, sampler_lp: list[float] | None = None) -> types.Datum:  # noqa: ANN001
    ids = tokenizer.encode(text)
    n = len(ids) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": ids[1:],
            "logprobs": sampler_lp if sampler_lp is not None else [-2.0] * n,
            "advantages": [advantage] * n,
        },
    )


def logprobs(out: types.ForwardBackwardOutput) -> list[torch.Tensor]:
    return [o["logprobs"].to_torch() for o in out.loss_fn_outputs]


def test_every_verb_on_the_local_backend(service: tinker.ServiceClient, tiny_model_dir: Path) -> None:
    tc = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=0)
    tok = tc.get_tokenizer()
    data = [sft_datum(tok, "12+34=46"), sft_datum(tok, "7+8=15")]
    info = tc.get_info()
    assert info.is_lora and info.lora_rank == 4 and info.model_id == tc.model_id
    before = tc.forward(data, "cross_entropy").result()
    # submitted back to back: the step sees the gradients, the forward after it sees the step
    fb = tc.forward_backward(data, "cross_entropy")
    step = tc.optim_step(ADAM)
    after = tc.forward(data, "cross_entropy")
    assert fb.result().metrics["loss:sum"] == pytest.approx(before.metrics["loss:sum"], rel=1e-6)
    assert step.result().metrics["grad_norm:mean"] > 0
    assert after.result().metrics["loss:sum"] < before.metrics["loss:sum"]
    # per datum: the log-probs of its targets, with the targets' shape; the loss is their negated sum
    for datum, lp in zip(data, logprobs(before), strict=True):
        assert lp.shape == (datum.model_input.length,)
    assert sum(-lp.sum() for lp in logprobs(before)) == pytest.approx(before.metrics["loss:sum"], rel=1e-5)
    for loss in ("importance_sampling", "ppo", "cispo", "gspo"):
        rl = [rl_datum(tok, "12+34=46", 1.0)]
        if loss == "gspo":
            rl = [
                types.Datum(
                    model_input=rl[0].model_input,
                    loss_fn_inputs={
                        **rl[0].loss_fn_inputs,
                        "sequence_ratio_mask": [1.0] * rl[0].model_input.length,
                    },
                )
            ]
        assert tc.forward_backward(rl, loss).result().metrics["loss:sum"] != 0.0
    tc.forward_backward([rl_datum(tok, "1+1=2", 1.0)], "dro", {"beta": 0.05}).result()
    tc.optim_step(ADAM).result()
    # the sampler holds the weights it was made with, and agrees with the trainer's log-probs
    sampler = tc.save_weights_and_get_sampling_client()
    ids = tok.encode("12+34=46")
    trained = logprobs(tc.forward([sft_datum(tok, "12+34=46")], "cross_entropy").result())[0]
    sampled = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    assert sampled[0] is None
    torch.testing.assert_close(torch.tensor(sampled[1:]), trained, atol=1e-5, rtol=0)
    response = sampler.sample(
        types.ModelInput.from_ints(ids[:4]),
        num_samples=3,
        sampling_params=types.SamplingParams(max_tokens=5, seed=7),
        include_prompt_logprobs=True,
    ).result()
    assert len(response.sequences) == 3
    assert len({tuple(s.tokens) for s in response.sequences}) > 1, "seeded samples differ from each other"
    for seq in response.sequences:
        assert len(seq.tokens) == len(seq.logprobs) and seq.stop_reason in ("length", "stop")
    assert response.prompt_logprobs[0] is None and len(response.prompt_logprobs) == 4
    again = sampler.sample(
        types.ModelInput.from_ints(ids[:4]), 3, types.SamplingParams(max_tokens=5, seed=7)
    ).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in response.sequences], "a seed repeats"
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    assert sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result() == sampled, "a snapshot"
    # at another temperature the log-probs are the tempered softmax's
    hot = sampler.compute_logprobs(types.ModelInput.from_ints(ids), temperature=2.0).result()
    assert hot[1:] != sampled[1:]


def test_saved_states_round_trip_weights_and_optimizer(
    service: tinker.ServiceClient, tiny_model_dir: Path
) -> None:
    tc = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=1)
    tok = tc.get_tokenizer()
    data = [sft_datum(tok, "5+5=10")]
    tc.forward_backward(data, "cross_entropy")
    tc.optim_step(ADAM)
    saved = tc.save_state("one").result()
    assert saved.path == f"tinker://{tc.model_id}/weights/one"
    with pytest.raises(ValueError, match="exists already: pass overwrite=True"):  # tinker's default
        tc.save_state("one").result()
    assert tc.save_state("one", overwrite=True).result().path == saved.path  # the same weights again
    reference = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    # the next step from the saved state: with its optimizer state, equal to the original's next step
    tc.forward_backward(data, "cross_entropy")
    tc.optim_step(ADAM)
    next_loss = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    with_optim = service.create_training_client_from_state_with_optimizer(saved.path)
    weights_only = service.create_training_client_from_state(saved.path)
    for client in (with_optim, weights_only):
        assert client.forward(data, "cross_entropy").result().metrics["loss:sum"] == reference
        client.forward_backward(data, "cross_entropy")
        client.optim_step(ADAM)
    assert with_optim.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
        next_loss, abs=1e-5
    )
    fresh = weights_only.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert abs(fresh - next_loss) > 1e-4, "a fresh optimizer takes another step than the restored one"
    # load_state onto an existing client; sampler weights on disk give the same log-probs as in-process
    weights_only.load_state_with_optimizer(saved.path).result()
    assert weights_only.forward(data, "cross_entropy").result().metrics["loss:sum"] == reference
    path = tc.save_weights_for_sampler("s").result().path
    ids = tok.encode("5+5=10")
    on_disk = service.create_sampling_client(model_path=path)
    in_process = tc.save_weights_and_get_sampling_client()
    a = on_disk.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    b = in_process.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    torch.testing.assert_close(torch.tensor(a[1:]), torch.tensor(b[1:]), atol=1e-5, rtol=0)


def test_two_lora_clients_never_change_each_other(
    service: tinker.ServiceClient, tiny_model_dir: Path
) -> None:
    a = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=2)
    b = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=2)
    tok = a.get_tokenizer()
    data_a, data_b = [sft_datum(tok, "1+2=3")], [sft_datum(tok, "9+9=18")]
    probe = [sft_datum(tok, "4+4=8")]
    for _ in range(2):  # interleaved: a's call, b's call, a's step, b's step
        a.forward_backward(data_a, "cross_entropy")
        b_before = logprobs(b.forward(probe, "cross_entropy").result())[0]
        b.forward_backward(data_b, "cross_entropy")
        a.optim_step(ADAM).result()
        assert torch.equal(logprobs(b.forward(probe, "cross_entropy").result())[0], b_before)
        a_before = logprobs(a.forward(probe, "cross_entropy").result())[0]
        b.optim_step(ADAM).result()
        assert torch.equal(logprobs(a.forward(probe, "cross_entropy").result())[0], a_before)
    la = logprobs(a.forward(probe, "cross_entropy").result())[0]
    lb = logprobs(b.forward(probe, "cross_entropy").result())[0]
    assert not torch.allclose(la, lb), "trained on different data, the adapters differ"
    worker = service.backend.group.dispatcher.worker  # the local backend's one in-process worker
    assert worker.models[a.model_id].base is worker.models[b.model_id].base is worker.base  # one base model
    with pytest.raises(ValueError, match="full-weight training client cannot share a backend"):
        service.create_training_client(str(tiny_model_dir))


def test_a_diverged_adapter_never_reaches_another_in_a_shared_pass(
    service: tinker.ServiceClient, tiny_model_dir: Path
) -> None:
    """Calls of two adapters waiting together run as one pass; B's adapter turned NaN must leave A's loss,
    log-probs and gradients as A alone has them (rows of different adapters never share a packed row: masked
    attention still multiplies 0 x NaN)."""
    import threading

    a = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=3)
    b = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=4)
    tok = a.get_tokenizer()
    probe = [sft_datum(tok, "12+30=42"), sft_datum(tok, "5+5=10")]
    alone = a.forward(probe, "cross_entropy").result()
    worker = service.backend.group.dispatcher.worker
    with torch.no_grad():
        for value in worker.models[b.model_id].adapter.lora_b.values():
            value.fill_(float("nan"))
    passes_before = sum(n for size, n in service.backend.calls.shared_passes.items() if size > 1)
    gate = threading.Event()
    service.backend.submit(gate.wait)  # the next calls wait together, so they share one pass
    shared_a = a.forward(probe, "cross_entropy")
    shared_b = b.forward(probe, "cross_entropy")
    gate.set()
    together, poisoned = shared_a.result(), shared_b.result()
    assert sum(n for size, n in service.backend.calls.shared_passes.items() if size > 1) == passes_before + 1
    assert math.isnan(poisoned.metrics["loss:sum"])
    assert together.metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], rel=1e-6)
    for got, want in zip(logprobs(together), logprobs(alone), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_a_training_pass_frees_the_samplers_kv_cache(
    service: tinker.ServiceClient, tiny_model_dir: Path
) -> None:
    """tinker's default max_tokens (None: up to the context) sizes a sample's cache for the whole context;
    a training pass must not run beside it (it was held until the next sample, at 7B scale tens of GB)."""
    tc = service.create_lora_training_client(str(tiny_model_dir), rank=2)
    tok = tc.get_tokenizer()
    sampler = tc.save_weights_and_get_sampling_client()
    long_prompt = (tok.encode("12+34=46 ") * 400)[:1000]  # room for a few tokens: the cache is the context's
    sampler.sample(types.ModelInput.from_ints(long_prompt), 4, types.SamplingParams(seed=0)).result()
    worker = service.backend.group.dispatcher.worker
    engine = worker.samplers._shared
    assert engine.cache_bytes() > 0
    tc.forward_backward([sft_datum(tok, "1+2=3")], "cross_entropy").result()
    assert engine.cache_bytes() == 0


def test_a_sampler_on_saved_sampler_weights_is_an_adapter_on_the_shared_engine(
    service: tinker.ServiceClient, tiny_model_dir: Path
) -> None:
    """tinker-cookbook's save_weights_for_sampler -> create_sampling_client(path): a frozen adapter on the one
    shared base engine (batched with every other tenant's samples), not a whole model copy per sampler; it
    samples as the in-memory snapshot of the same weights does."""
    tc = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=5)
    tok = tc.get_tokenizer()
    tc.forward_backward([sft_datum(tok, "3+4=7")], "cross_entropy")
    tc.optim_step(ADAM).result()
    snapshot = tc.save_weights_and_get_sampling_client()
    path = tc.save_weights_for_sampler("for-sampling").result().path
    opened = service.create_sampling_client(model_path=path)
    prompt = types.ModelInput.from_ints(tok.encode("3+4="))
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=9)
    want = snapshot.sample(prompt, 3, params).result()
    got = opened.sample(prompt, 3, params).result()
    assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
    for a, b in zip(got.sequences, want.sequences, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    samplers = service.backend.group.dispatcher.worker.samplers
    sampler = samplers.samplers[opened.sampler_id]
    assert sampler.adapter is not None and sampler.engine is samplers._shared


def test_the_shared_sampling_engine_serves_one_base_only(tiny_model_dir: Path, tmp_path: Path) -> None:
    """An adapter on the shared engine samples from that engine's base: a request for another base gets
    none (the caller then makes an engine of its own), or a LoRA on base A would sample from base B."""
    import shutil

    from posttrain.workers.api_samplers import ApiSamplers, SamplerSettings

    other = tmp_path / "other-base"
    shutil.copytree(tiny_model_dir, other)
    samplers = ApiSamplers(SamplerSettings("native", "cpu", "float32", 8, "sdpa", 0))
    engine, _ = samplers._shared_engine(str(tiny_model_dir))
    assert samplers._shared_engine(str(tiny_model_dir))[0] is engine
    assert samplers._shared_engine(str(other)) is None


def test_adam_params_torch_would_refuse_are_errors_naming_them(
    service: tinker.ServiceClient, tiny_model_dir: Path
) -> None:
    tc = service.create_lora_training_client(str(tiny_model_dir), rank=2)
    bad = {
        "learning_rate": -0.01,
        "beta2": 1.0,
        "beta1": 1.5,
        "eps": -1.0,
        "weight_decay": -5.0,
    }
    for name, value in bad.items():
        with pytest.raises(ValueError, match=f"AdamParams {name}="):
            tc.optim_step(types.AdamParams(**{"learning_rate": 1e-3, name: value}))
    with pytest.raises(ValueError, match="learning_rate=nan"):
        tc.optim_step(types.AdamParams(learning_rate=float("nan")))
    step = tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert step.metrics["skipped_nonfinite:sum"] == 0.0  # told, when a non-finite gradient skips a step


def test_adapters_train_in_float32_on_a_bfloat16_base(tiny_model_dir: Path, tmp_path: Path) -> None:
    from posttrain.workers.api_worker import ApiWorkerSpec

    with tinker.ServiceClient(
        backend="local", root_dir=tmp_path, worker=ApiWorkerSpec(dtype="bfloat16")
    ) as svc:
        tc = svc.create_lora_training_client(str(tiny_model_dir), rank=2)
        tok = tc.get_tokenizer()
        tc.forward_backward([sft_datum(tok, "1+2=3")], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-5)).result()
        model = svc.backend.group.dispatcher.worker.models[tc.model_id]
        assert next(model.base.model.parameters()).dtype == torch.bfloat16
        params = list(model.adapter.parameters())
        assert params and all(p.dtype == torch.float32 for p in params)
        moments = [s["exp_avg"] for s in model.optimizer.state.values()]
        assert moments and all(m.dtype == torch.float32 for m in moments)


def test_train_mlp_on_a_mixture_of_experts_base_is_refused(tiny_moe_dir: Path, tmp_path: Path) -> None:
    with tinker.ServiceClient(backend="local", root_dir=tmp_path) as svc:
        with pytest.raises(Exception, match="train_mlp=True on .* mixture-of-experts"):
            svc.create_lora_training_client(str(tiny_moe_dir), rank=2)
        tc = svc.create_lora_training_client(str(tiny_moe_dir), rank=2, train_mlp=False)
        assert tc.get_info().lora_rank == 2


def test_a_custom_cross_entropy_equals_the_built_in_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Loss and gradients: the same step from the same start gives the same weights."""
    with tinker.ServiceClient(backend="local", root_dir=tmp_path) as service:
        custom = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=3)
        built_in = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=3)
        tok = custom.get_tokenizer()
        data = [sft_datum(tok, "3+4=7"), sft_datum(tok, "10+20=30")]
        probe = [sft_datum(tok, "6+1=7")]

        def cross_entropy(batch: list[types.Datum], lps: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
            weights = [d.loss_fn_inputs["weights"].to_torch() for d in batch]
            loss = sum(-(lp * w).sum() for lp, w in zip(lps, weights, strict=True))
            return loss, {"tokens:sum": float(sum(w.sum() for w in weights))}

        out_custom = custom.forward_backward_custom(data, cross_entropy).result()
        out_built_in = built_in.forward_backward(data, "cross_entropy").result()
        assert out_custom.metrics["loss:sum"] == pytest.approx(out_built_in.metrics["loss:sum"], rel=1e-6)
        assert out_custom.metrics["tokens:sum"] == sum(d.model_input.length for d in data)
        g_custom = custom.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics["grad_norm:mean"]
        g_built_in = (
            built_in.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics["grad_norm:mean"]
        )
        assert g_custom == pytest.approx(g_built_in, rel=1e-5)
        torch.testing.assert_close(
            logprobs(custom.forward(probe, "cross_entropy").result())[0],
            logprobs(built_in.forward(probe, "cross_entropy").result())[0],
            atol=1e-5,
            rtol=0,
        )


def test_bad_calls_are_clear_errors(service: tinker.ServiceClient, tiny_model_dir: Path) -> None:
    tc = service.create_lora_training_client(str(tiny_model_dir), rank=2)
    tok = tc.get_tokenizer()
    good = sft_datum(tok, "2+2=4")
    with pytest.raises(ValueError, match="unknown loss function 'grpo'; valid: .*cross_entropy"):
        tc.forward_backward([good], "grpo")
    with pytest.raises(ValueError, match="ttl_seconds: checkpoints here do not expire"):
        tc.save_state("kept", ttl_seconds=60)
    bad_key = types.Datum(
        model_input=good.model_input,
        loss_fn_inputs={**good.loss_fn_inputs, "mask": good.loss_fn_inputs["weights"]},
    )
    with pytest.raises(ValueError, match="mask"):
        tc.forward_backward([bad_key], "cross_entropy")
    with pytest.raises(ValueError, match="advantages"):
        tc.forward_backward([good], "importance_sampling")
    short = types.Datum(
        model_input=good.model_input,
        loss_fn_inputs={"target_tokens": good.loss_fn_inputs["target_tokens"], "weights": [1.0, 1.0]},
    )
    with pytest.raises(ValueError, match="weights has 2"):
        tc.forward_backward([short], "cross_entropy")
    with pytest.raises(ValueError, match="No data provided"):
        tc.forward([], "cross_entropy")
    with pytest.raises(ValueError, match="does not take loss_fn_config clip_epsilon; valid: clip_high"):
        tc.forward_backward([rl_datum(tok, "2+2=4", 1.0)], "ppo", {"clip_epsilon": 0.2})
    with pytest.raises(ValueError, match="rank=1000 is outside"):
        service.create_lora_training_client(str(tiny_model_dir), rank=1000)
    with pytest.raises(ValueError, match="no such checkpoint"):
        service.create_sampling_client(model_path=f"tinker://{tc.model_id}/sampler_weights/never-saved")
    with pytest.raises(ValueError, match="not a tinker://"):
        tc.load_state("tinker://../../etc/weights/x")
    with pytest.raises(ValueError, match="checkpoint name"):
        tc.save_state("../outside")
    with pytest.raises(ValueError, match="Either model_path or base_model"):
        service.create_sampling_client()
    with pytest.raises(ValueError, match="user_metadata.*strings"):
        service.create_lora_training_client(str(tiny_model_dir), rank=2, user_metadata={"n": 3})  # type: ignore[dict-item]


def test_user_metadata_is_kept_with_the_training_run(
    service: tinker.ServiceClient, tiny_model_dir: Path
) -> None:
    tc = service.create_lora_training_client(str(tiny_model_dir), rank=2, user_metadata={"team": "rl"})
    facts = service.backend.read_run(tc.model_id)
    assert facts == {"base_model": str(tiny_model_dir), "lora_rank": 2, "user_metadata": {"team": "rl"}}
    saved = tc.save_state("kept").result()
    again = service.create_training_client_from_state_as(tc.model_id + "0", saved.path)  # another run
    assert service.backend.read_run(again.model_id)["user_metadata"] == {}


@pytest.mark.parametrize("loss", ["cross_entropy", "ppo"])
def test_the_same_script_on_local_and_two_ray_workers_gives_the_same_losses(
    tiny_model_dir: Path, tmp_path: Path, ray_cluster: None, loss: str
) -> None:
    def script(service: tinker.ServiceClient) -> list[float]:
        tc = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=5)
        tok = tc.get_tokenizer()
        texts = ["1+2=3", "11+22=33", "5+6=11"]  # 3 datums on 2 workers: one padding row
        data = (
            [sft_datum(tok, t) for t in texts]
            if loss == "cross_entropy"
            else [rl_datum(tok, t, a) for t, a in zip(texts, (1.0, -0.5, 0.25), strict=True)]
        )
        losses = []
        for _ in range(3):
            losses.append(tc.forward_backward(data, loss).result().metrics["loss:sum"])
            tc.optim_step(ADAM).result()
        losses.append(tc.forward(data, loss).result().metrics["loss:sum"])
        sampler = tc.save_weights_and_get_sampling_client()
        lp = sampler.compute_logprobs(types.ModelInput.from_ints(tok.encode("1+2=3"))).result()
        return losses + lp[1:]

    with tinker.ServiceClient(backend="local", root_dir=tmp_path / "local") as local:
        on_local = script(local)
    with tinker.ServiceClient(backend="ray", n_workers=2, root_dir=tmp_path / "ray", device="cpu") as ray:
        assert ray.backend.world_size == 2
        on_ray = script(ray)
    torch.testing.assert_close(torch.tensor(on_ray), torch.tensor(on_local), atol=1e-4, rtol=1e-5)
