"""The explicit API on a vision-language model (tiny-vl) with tinker `ImageChunk`s in the model inputs: an image
chunk is its image tokens, the log-probs are the HF model's on the processor's own inputs, the image matters,
training moves the vision tower, sampling sees the image, and what cannot work is a clear ValueError."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from posttrain import client as tinker
from posttrain.client import types
from posttrain.client.batching import datums_to_batch, loss_inputs, merge_batches, split_output
from posttrain.client.model_inputs import ModelInputReader
from posttrain.data import keys
from posttrain.data.mm_dataset import MULTI_MODAL_INPUTS
from posttrain.data.tasks.shapes import corpus
from posttrain.models import load_causal_lm, load_processor, make_tiny_model
from posttrain.models.vl import vision_tower
from posttrain.workers.api_worker import ApiLossSpec, ApiWorkerSpec

QUESTION = (
    "<|vision_end|>How many squares? Answer with one word or number.<|im_end|>\n<|im_start|>assistant\n"
)
ANSWER = "2<|im_end|>"


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("tiny-vl", tmp_path_factory.mktemp("vl") / "model", corpus(500), seed=0)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tinker.ServiceClient]:
    with tinker.ServiceClient(backend="local", root_dir=tmp_path_factory.mktemp("api"), seed=0) as svc:
        yield svc


@pytest.fixture(scope="module")
def lora(service: tinker.ServiceClient, vl_dir: Path) -> tinker.TrainingClient:
    """A LoRA client (its B matrices zero: it computes the base model) on tiny-vl."""
    return service.create_lora_training_client(str(vl_dir), rank=4, seed=0)


def image_bytes(color: str, size: tuple[int, int] = (56, 56), fmt: str = "PNG") -> bytes:
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).rectangle((4, 4, 30, 30), fill=color)
    ImageDraw.Draw(img).rectangle((34, 34, 50, 50), fill=color)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def encode(tokenizer, text: str) -> list[int]:  # noqa: ANN001
    return list(tokenizer.encode(text, add_special_tokens=False))


def prompt_chunks(tokenizer, data: bytes, expected: int | None = None) -> list:  # noqa: ANN001
    """`<|im_start|>user\\n<|vision_start|>` IMAGE `<|vision_end|>question...assistant\\n`, tinker's layout."""
    return [
        types.EncodedTextChunk(tokens=encode(tokenizer, "<|im_start|>user\n<|vision_start|>")),
        types.ImageChunk(data=data, format="png", expected_tokens=expected),
        types.EncodedTextChunk(tokens=encode(tokenizer, QUESTION)),
    ]


def sft_datum(tokenizer, data: bytes, n_image: int) -> types.Datum:  # noqa: ANN001
    """Prompt (image included) and answer; the loss on the answer's tokens only. `n_image`: the image's tokens."""
    chunks = prompt_chunks(tokenizer, data)
    answer = encode(tokenizer, ANSWER)
    chunks[-1] = types.EncodedTextChunk(tokens=[*chunks[-1].tokens, *answer[:-1]])
    prompt_len = len(chunks[0].tokens) + n_image + len(encode(tokenizer, QUESTION))
    n = prompt_len + len(answer) - 1
    targets = [0] * (prompt_len - 1) + answer  # the prompt's targets weigh nothing
    weights = [0.0] * (prompt_len - 1) + [1.0] * len(answer)
    return types.Datum(
        model_input=types.ModelInput(chunks=chunks),
        loss_fn_inputs={"target_tokens": targets[:n], "weights": weights[:n]},
    )


def reference_log_probs(vl_dir: Path, text: str, data: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, log p(id i+1 | ids <= i)) from the HF model called as transformers documents it, on the
    processor's own expansion of `<|image_pad|>` and its own pixels (fp32)."""
    processor = load_processor(vl_dir)
    inputs = processor(text=[text], images=[Image.open(io.BytesIO(data)).convert("RGB")])
    model = load_causal_lm(vl_dir)
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits.float()
    ids = inputs["input_ids"][0]
    return ids, torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[1:, None]).squeeze(-1)


def logprobs(out: types.ForwardBackwardOutput) -> list[torch.Tensor]:
    return [o["logprobs"].to_torch() for o in out.loss_fn_outputs]


def test_forward_equals_the_hf_model_on_the_processed_image(lora, vl_dir: Path) -> None:
    tok = lora.get_tokenizer()
    data = image_bytes("red")
    text = f"<|im_start|>user\n<|vision_start|><|image_pad|>{QUESTION}{ANSWER}"
    ids, expected = reference_log_probs(vl_dir, text, data)
    n_image = int((ids == tok.convert_tokens_to_ids("<|image_pad|>")).sum())
    assert n_image == 4  # a 56x56 image: 2x2 merged patches
    datum = sft_datum(tok, data, n_image)
    n = len(datum.loss_fn_inputs["target_tokens"].data)
    # the chunk is the processor's expansion of the image: its image tokens, between the text chunks
    assert ModelInputReader(vl_dir).row(datum.model_input, "datum").tokens == ids[:-1].tolist()
    # every position's target: the next token of the processor's own sequence
    datum.loss_fn_inputs["target_tokens"] = types.TensorData.from_torch(ids[1:].clone())
    out = lora.forward([datum], "cross_entropy").result()
    (got,) = logprobs(out)
    assert got.shape == (n,)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    weights = datum.loss_fn_inputs["weights"].to_torch()
    assert out.metrics["loss:sum"] == pytest.approx(float(-(expected * weights).sum()), rel=1e-5)
    # expected_tokens given and right: accepted, same result
    chunks = list(datum.model_input.chunks)
    chunks[1] = types.ImageChunk(data=data, format="png", expected_tokens=n_image)
    again = types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs=datum.loss_fn_inputs)
    torch.testing.assert_close(logprobs(lora.forward([again], "cross_entropy").result())[0], got)


def test_the_image_changes_the_log_probs_after_it(lora) -> None:
    tok = lora.get_tokenizer()
    red, blue = (sft_datum(tok, image_bytes(c), 4) for c in ("red", "blue"))
    out = logprobs(lora.forward([red, blue], "cross_entropy").result())
    start = len(red.model_input.chunks[0].tokens)  # the first image token is fed at this position
    torch.testing.assert_close(out[0][:start], out[1][:start], atol=0, rtol=0)  # before it: equal
    assert float((out[0][start:] - out[1][start:]).abs().max()) > 1e-3


def test_training_on_an_image_moves_the_vision_tower(
    vl_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("full")
    with tinker.ServiceClient(backend="local", root_dir=root, seed=0) as svc:
        tc = svc.create_training_client(str(vl_dir), seed=0)  # tiny-vl from scratch: its tower trains (auto)
        tok = tc.get_tokenizer()
        data = [sft_datum(tok, image_bytes("red"), 4), sft_datum(tok, image_bytes("green", (112, 56)), 8)]
        before = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
        for _ in range(3):
            tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2))
        after = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
        assert after < before
        path = tc.save_weights_for_sampler("trained").result().path
        folder = svc.backend.resolve(path, "sampler_weights")[1]
    original, trained = (vision_tower(load_causal_lm(d)) for d in (vl_dir, folder))
    moved = [
        name
        for (name, p), (_, q) in zip(original.named_parameters(), trained.named_parameters(), strict=True)
        if not torch.equal(p, q)
    ]
    assert len(moved) == len(list(original.parameters()))  # every weight of the tower got a gradient


def weights_moved(svc: tinker.ServiceClient, base: Path) -> tuple[bool, bool]:
    """(every vision-tower weight moved, the language model moved) after 2 full-weight steps on image datums."""
    tc = svc.create_training_client(str(base), seed=0)
    tok = tc.get_tokenizer()
    data = [sft_datum(tok, image_bytes("red"), 4), sft_datum(tok, image_bytes("green", (112, 56)), 8)]
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2))
    folder = svc.backend.resolve(tc.save_weights_for_sampler("after").result().path, "sampler_weights")[1]
    original, trained = load_causal_lm(base), load_causal_lm(folder)
    tower = [
        not torch.equal(p, q)
        for p, q in zip(vision_tower(original).parameters(), vision_tower(trained).parameters(), strict=True)
    ]
    lm = original.model.language_model.layers[0].mlp.up_proj.weight
    assert all(tower) or not any(tower)  # the tower trains whole or not at all
    return all(tower), not torch.equal(lm, trained.model.language_model.layers[0].mlp.up_proj.weight)


def test_the_api_vision_tower_setting_reaches_the_engine(
    vl_dir: Path, pretrained_vl_dir: Path, tmp_path: Path
) -> None:
    """`ApiWorkerSpec.vision_tower` (the trainers' model.vision_tower) on the local backend: `frozen` keeps a
    from-scratch tower (which `auto` trains) as it was while the language model trains; `trained` trains a
    pretrained tower (which `auto` freezes)."""
    runs = [
        (vl_dir, "frozen", False),
        (pretrained_vl_dir, "trained", True),
        (pretrained_vl_dir, "auto", False),
    ]
    for base, mode, tower_trains in runs:
        worker = ApiWorkerSpec(vision_tower=mode)
        with tinker.ServiceClient(backend="local", root_dir=tmp_path / mode, seed=0, worker=worker) as svc:
            assert weights_moved(svc, base) == (tower_trains, True), mode


@pytest.mark.slow  # 18-29 s of worker processes on 2 cores; CI runs it with -m slow
def test_the_api_vision_tower_setting_reaches_ray_workers(
    vl_dir: Path, tmp_path: Path, ray_cluster: None
) -> None:
    """The same setting on the `ray` backend (the spec travels to each Ray worker): `frozen` keeps the
    from-scratch tower as it was on 2 workers."""
    worker = ApiWorkerSpec(vision_tower="frozen")
    with tinker.ServiceClient(
        backend="ray", n_workers=2, root_dir=tmp_path, device="cpu", worker=worker
    ) as svc:
        assert weights_moved(svc, vl_dir) == (False, True)


def test_the_api_vision_tower_setting_is_checked(vl_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"ApiWorkerSpec\(vision_tower='sometimes'\) unknown; valid: auto"):
        ApiWorkerSpec(vision_tower="sometimes")
    worker = ApiWorkerSpec(vision_tower="trained")
    with tinker.ServiceClient(backend="local", root_dir=tmp_path, worker=worker) as svc:
        with pytest.raises(ValueError, match="vision_tower='trained'\\) with a LoRA client"):
            svc.create_lora_training_client(str(vl_dir), rank=4)


def test_grpo_step_sample_then_train_on_an_image_prompt(lora, vl_dir: Path) -> None:
    """An RL step through the API: sample an image prompt, score the samples with the trainer (its log-probs
    equal the sampler's), and an importance-sampling forward_backward on them."""
    tok = lora.get_tokenizer()
    prompt = types.ModelInput(chunks=prompt_chunks(tok, image_bytes("red")))
    sampler = lora.save_weights_and_get_sampling_client()
    params = types.SamplingParams(max_tokens=5, seed=3, temperature=1.0)
    response = sampler.sample(prompt, 4, params, include_prompt_logprobs=True).result()
    assert len(response.sequences) == 4
    image_token = tok.convert_tokens_to_ids("<|image_pad|>")
    n_prompt = len(prompt.chunks[0].tokens) + 4 + len(prompt.chunks[2].tokens)
    assert len(response.prompt_logprobs) == n_prompt and response.prompt_logprobs[0] is None
    data = []
    for k, seq in enumerate(response.sequences):
        assert len(seq.tokens) == len(seq.logprobs) > 0 and image_token not in seq.tokens
        full = types.ModelInput(chunks=[*prompt.chunks, types.EncodedTextChunk(tokens=seq.tokens[:-1])])
        data.append(
            types.Datum(
                model_input=full,
                loss_fn_inputs={
                    "target_tokens": [0] * (n_prompt - 1) + list(seq.tokens),
                    "logprobs": [0.0] * (n_prompt - 1) + list(seq.logprobs),
                    "advantages": [0.0] * (n_prompt - 1) + [1.0 if k % 2 else -1.0] * len(seq.tokens),
                },
            )
        )
    out = lora.forward_backward(data, "importance_sampling").result()
    before = logprobs(out)
    for seq, lp in zip(response.sequences, before, strict=True):
        torch.testing.assert_close(lp[n_prompt - 1 :], torch.tensor(seq.logprobs), atol=1e-4, rtol=0)
    assert lora.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm:mean"] > 0
    # the prompt's own log-probs (image included): the same from both calls, and the HF model's (the sampler
    # is a snapshot of the adapter before its first step: the base model)
    scored = sampler.compute_logprobs(prompt).result()
    assert scored[0] is None
    torch.testing.assert_close(torch.tensor(response.prompt_logprobs[1:]), torch.tensor(scored[1:]))
    text = f"<|im_start|>user\n<|vision_start|><|image_pad|>{QUESTION}"
    _, expected = reference_log_probs(vl_dir, text, image_bytes("red"))
    torch.testing.assert_close(torch.tensor(scored[1:]), expected, atol=1e-5, rtol=1e-5)


def test_two_adapters_in_one_shared_pass_keep_their_images(service, lora, vl_dir: Path) -> None:
    """Requests of two LoRA tenants merged into one pass over the base carry each row's images."""
    other = service.create_lora_training_client(str(vl_dir), rank=4, seed=1)
    tok = lora.get_tokenizer()
    reader = ModelInputReader(vl_dir)
    first = [sft_datum(tok, image_bytes("red"), 4), sft_datum(tok, image_bytes("blue", (112, 56)), 8)]
    second = [sft_datum(tok, image_bytes("green"), 4)]
    batches = [datums_to_batch(d, 1, reader.rows([x.model_input for x in d])) for d in (first, second)]
    merged = merge_batches(batches)
    assert [bool(m) for m in merged[MULTI_MODAL_INPUTS]] == [True, True, True]
    out = service.backend.group.forward_routed(
        [lora.model_id, other.model_id], merged, [ApiLossSpec("cross_entropy")] * 2
    )
    alone = [logprobs(c.forward(d, "cross_entropy").result()) for c, d in ((lora, first), (other, second))]
    expected = [lp for group in alone for lp in group]
    order = [int(r) for r in torch.cat([b[keys.API_ROW] for b in batches]).tolist()]
    offsets = [0, 0, len(first)]
    for i, row in enumerate(order):
        lp = expected[offsets[i] + row]
        torch.testing.assert_close(out[keys.API_LOGPROBS][i, : lp.numel()], lp, atol=1e-5, rtol=1e-5)


def test_an_expected_tokens_mismatch_names_the_datum_and_both_counts(lora) -> None:
    tok = lora.get_tokenizer()
    good = sft_datum(tok, image_bytes("red"), 4)
    chunks = prompt_chunks(tok, image_bytes("red", (112, 56)), expected=4)  # 8 tokens
    bad = types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs={"target_tokens": [0] * 30})
    with pytest.raises(ValueError, match=r"datum 1: chunk 1: .*expected_tokens=4.* 8 tokens"):
        lora.forward([good, bad], "cross_entropy")


def test_inputs_that_cannot_work_are_refused_at_the_call(lora, service, tiny_model_dir: Path) -> None:
    tok = lora.get_tokenizer()
    datum = sft_datum(tok, image_bytes("red"), 4)
    # a URL or path is never fetched
    pointer = types.ImageAssetPointerChunk(format="png", location="https://example.com/a.png")
    chunks = [datum.model_input.chunks[0], pointer, datum.model_input.chunks[2]]
    pointed = types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs=datum.loss_fn_inputs)
    with pytest.raises(ValueError, match=r"datum 0: chunk 1: an ImageAssetPointerChunk .*never fetched"):
        lora.forward([pointed], "cross_entropy")
    with pytest.raises(ValueError, match="prompt: chunk 1: an ImageAssetPointerChunk"):
        lora.save_weights_and_get_sampling_client().sample(
            types.ModelInput(chunks=chunks), 1, types.SamplingParams(max_tokens=2)
        )
    # bytes that are not the declared format
    jpeg = types.ImageChunk(data=image_bytes("red", fmt="JPEG"), format="png")
    mislabelled = types.ModelInput(chunks=[datum.model_input.chunks[0], jpeg, datum.model_input.chunks[2]])
    with pytest.raises(ValueError, match="format='png' but its bytes are JPEG"):
        lora.forward(
            [types.Datum(model_input=mislabelled, loss_fn_inputs=datum.loss_fn_inputs)], "cross_entropy"
        )
    # two images back to back would read as one image to the model's position ids
    red = types.ImageChunk(data=image_bytes("red"), format="png")
    adjacent = types.ModelInput(chunks=[datum.model_input.chunks[0], red, red, datum.model_input.chunks[2]])
    with pytest.raises(ValueError, match=r"datum 0: chunk 2: an ImageChunk right after another"):
        lora.forward(
            [types.Datum(model_input=adjacent, loss_fn_inputs=datum.loss_fn_inputs)], "cross_entropy"
        )
    with pytest.raises(ValueError, match=r"prompt: chunk 2: an ImageChunk right after another"):
        lora.save_weights_and_get_sampling_client().sample(adjacent, 1, types.SamplingParams(max_tokens=2))
    nothing = types.EncodedTextChunk(tokens=[])  # an empty token chunk between them separates nothing
    hidden = types.ModelInput(
        chunks=[datum.model_input.chunks[0], red, nothing, red, datum.model_input.chunks[2]]
    )
    with pytest.raises(ValueError, match=r"datum 0: chunk 3: an ImageChunk right after another"):
        lora.forward([types.Datum(model_input=hidden, loss_fn_inputs=datum.loss_fn_inputs)], "cross_entropy")
    # the image token written as text
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    as_text = types.ModelInput(
        chunks=[types.EncodedTextChunk(tokens=[pad]), types.ImageChunk(data=image_bytes("red"), format="png")]
    )
    with pytest.raises(ValueError, match="datum 0: chunk 0: a token chunk holds the image token"):
        lora.forward(
            [types.Datum(model_input=as_text, loss_fn_inputs={"target_tokens": [0] * 5})], "cross_entropy"
        )
    with pytest.raises(ValueError, match=r"prompt: chunk 0: a token chunk holds the image token"):
        lora.save_weights_and_get_sampling_client().sample(
            types.ModelInput.from_ints([pad, pad]), 1, types.SamplingParams(max_tokens=2)
        )
    # a text-only model has no vision tower
    with tinker.ServiceClient(backend="local", root_dir=service.backend.root) as text_svc:
        text = text_svc.create_lora_training_client(str(tiny_model_dir), rank=2, seed=0)
        image = types.ModelInput(chunks=[types.ImageChunk(data=image_bytes("red"), format="png")])
        with pytest.raises(
            ValueError, match=rf"datum 0: .*ImageChunk.*{tiny_model_dir}.*has no vision tower"
        ):
            text.forward(
                [types.Datum(model_input=image, loss_fn_inputs={"target_tokens": [0] * 4})], "cross_entropy"
            )
        with pytest.raises(ValueError, match="has no vision tower"):
            text.save_weights_and_get_sampling_client().sample(image, 1, types.SamplingParams(max_tokens=2))


@pytest.mark.slow  # the default suite's time on 2 cores (CI runs it with -m slow)
def test_two_ray_workers_give_the_local_log_probs_and_train(
    service, vl_dir: Path, tmp_path: Path, ray_cluster: None
) -> None:
    """On 2 Ray workers (FSDP: each rank's vision blocks are gathered collectively, so every rank's passes
    run the vision tower): one image datum (the other rank gets a padding row that counts nothing) and three,
    the local backend's log-probs, and a training step; then a request mixing image and text-only datums,
    one worker's rows text only, trains as on the local backend."""
    fresh = service.create_lora_training_client(str(vl_dir), rank=4, seed=0)  # untrained, as on Ray
    tok = fresh.get_tokenizer()
    data = [sft_datum(tok, image_bytes(c), 4) for c in ("red", "blue", "green")]
    local = logprobs(fresh.forward(data, "cross_entropy").result())
    with tinker.ServiceClient(backend="ray", n_workers=2, root_dir=tmp_path, device="cpu") as ray:
        tc = ray.create_lora_training_client(str(vl_dir), rank=4, seed=0)
        for part in (data[:1], data):
            got = logprobs(tc.forward(part, "cross_entropy").result())
            for a, b in zip(got, local, strict=False):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        loss = tc.forward_backward(data[:1], "cross_entropy").result().metrics["loss:sum"]
        assert loss == pytest.approx(
            float(-(local[0] * data[0].loss_fn_inputs["weights"].to_torch()).sum()), rel=1e-5
        )
        assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm:mean"] > 0
        check_mixed_request(service, ray, vl_dir, data[:2], lora=True)
    # full weights: the from-scratch tower trains, so its backward's gradient collectives must pair up too
    # (a full-weight client has its backend to itself)
    with (
        tinker.ServiceClient(backend="local", root_dir=tmp_path / "full_local", seed=0) as local_full,
        tinker.ServiceClient(
            backend="ray", n_workers=2, root_dir=tmp_path / "full_ray", device="cpu"
        ) as ray_full,
    ):
        check_mixed_request(local_full, ray_full, vl_dir, data[:2], lora=False)


def text_datum(tokenizer, text: str) -> types.Datum:  # noqa: ANN001
    """A text-only datum whose every next token carries loss."""
    ids = encode(tokenizer, text)
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )


def check_mixed_request(
    local: tinker.ServiceClient,
    ray: tinker.ServiceClient,
    vl_dir: Path,
    images: list[types.Datum],
    lora: bool,
) -> None:
    """Image and text-only datums in one request (before: refused on several workers): its rows split so that
    one worker's are text only (that worker runs the vision tower on a blank image, engine/vision_pass.py);
    forward_backward, a step and forward give the local backend's loss, gradient norm and log-probs. `lora`:
    LoRA clients (frozen tower), else full-weight clients (the tower trains)."""
    clients = [
        c.create_lora_training_client(str(vl_dir), rank=4, seed=0)
        if lora
        else c.create_training_client(str(vl_dir), seed=0)
        for c in (local, ray)
    ]
    tok = clients[0].get_tokenizer()
    texts = [text_datum(tok, t) for t in ("How many squares? 2", "How many squares are there? 3")]
    mixed = [images[0], texts[0], images[1], texts[1]]
    batch = datums_to_batch(mixed, 2, ModelInputReader(vl_dir).rows([d.model_input for d in mixed]))
    halves = [[bool(row) for row in part[MULTI_MODAL_INPUTS]] for part in batch.chunk(2)]
    assert sorted(halves) == [[False, False], [True, True]]  # one worker's rows hold no image
    results = []
    for client in clients:
        fb = client.forward_backward(mixed, "cross_entropy").result()
        step = client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        after = client.forward(mixed, "cross_entropy").result()
        results.append((fb, step.metrics["grad_norm:mean"], after))
    (fb1, norm1, after1), (fb2, norm2, after2) = results
    for out1, out2 in ((fb1, fb2), (after1, after2)):
        for a, b in zip(logprobs(out2), logprobs(out1), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"lora={lora}")
        assert out2.metrics["loss:sum"] == pytest.approx(out1.metrics["loss:sum"], rel=1e-5), lora
    assert norm2 == pytest.approx(norm1, rel=1e-5) and norm1 > 0, lora
    assert after2.metrics["loss:sum"] < fb2.metrics["loss:sum"]
    if lora:
        check_shared_pass(ray, vl_dir, clients[1], mixed[0::2], mixed[1::2])


def check_shared_pass(
    ray: tinker.ServiceClient,
    vl_dir: Path,
    client: tinker.TrainingClient,
    images: list[types.Datum],
    texts: list[types.Datum],
) -> None:
    """An image request of `client` and a text-only request of another adapter in one shared pass over the base
    on 2 workers (before: kept apart), one worker's rows text only: each request's log-probs are its own pass's."""
    other = ray.create_lora_training_client(str(vl_dir), rank=4, seed=1)
    requests = [(client, images), (other, texts)]
    reader = ModelInputReader(vl_dir)
    batches = [datums_to_batch(d, 2, reader.rows([x.model_input for x in d])) for _, d in requests]
    merged = merge_batches(batches)
    halves = [[bool(row) for row in part[MULTI_MODAL_INPUTS]] for part in merged.chunk(2)]
    assert halves == [[True, True], [False, False]]  # the second worker's rows: the text-only request's
    losses = [ApiLossSpec("cross_entropy", inputs=loss_inputs(b)) for b in batches]
    out = ray.backend.group.forward_routed([c.model_id for c, _ in requests], merged, losses)
    for (owner, data), batch, shared in zip(
        requests, batches, split_output(out, merged, batches), strict=True
    ):
        alone = logprobs(owner.forward(data, "cross_entropy").result())
        for row, datum in enumerate(batch[keys.API_ROW].tolist()[: len(data)]):
            n = alone[datum].numel()
            torch.testing.assert_close(shared[keys.API_LOGPROBS][row, :n], alone[datum], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("size", [(300, 200), (640, 480), (123, 457), (1000, 37)])
def test_an_image_is_as_many_tokens_as_the_models_processor_makes_it(
    vl_dir: Path, size: tuple[int, int]
) -> None:
    """A client counts expected_tokens with the model's processor, which resizes the image once; a second
    resize before it (into the same bounds) gave other counts for these sizes (15 tokens against 12, ...)."""
    processor = load_processor(vl_dir)
    data = image_bytes("red", size)
    grid = processor.image_processor(images=[Image.open(io.BytesIO(data)).convert("RGB")])["image_grid_thw"]
    expected = int(torch.as_tensor(grid).prod()) // processor.image_processor.merge_size**2
    reader = ModelInputReader(str(vl_dir))
    chunk = types.ModelInput(chunks=[types.ImageChunk(data=data, format="png", expected_tokens=expected)])
    assert (
        reader.length(types.ModelInput(chunks=[types.ImageChunk(data=data, format="png")]), "x") == expected
    )
    assert len(reader.row(chunk, "x").tokens) == expected  # accepted: the processor's count
