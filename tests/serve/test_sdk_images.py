"""The official tinker SDK sends image chunks to `posttrain serve` of tiny-vl: forward_backward (protobuf), an
optimizer step, save_weights_and_get_sampling_client and sample (JSON) give the local backend's answers on the
same inputs. Processing the images keeps the server's event loop free for other tenants."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from posttrain import client as tinker
from posttrain.client import types
from posttrain.client.model_inputs import ModelInputReader
from posttrain.data.tasks.shapes import make_problem, png_bytes
from posttrain.models import load_tokenizer

from ..client.test_image_chunks import ANSWER, QUESTION, encode
from .conftest import KEYS, Running

ALICE, BOB = list(KEYS)
SCRIPT = Path(__file__).with_name("sdk_image_script.py")
LR, SEED, MAX_TOKENS = 1e-2, 5, 4


def shapes_png(seed: int, size: int) -> bytes:
    """A shapes-task image (coloured squares), as the task's own PNG bytes."""
    img, _, _ = make_problem(np.random.default_rng(seed), "count", size=size)
    return png_bytes(img)


class Unsized(bytes):
    """Image bytes sent without expected_tokens (as the SDK does unless told): the server counts them."""


class Inputs:
    """The same datums and prompt as JSON chunk specs for the SDK script and as posttrain's types."""

    def __init__(self, vl_dir: Path, folder: Path) -> None:
        self.reader = ModelInputReader(vl_dir)
        self.tok = load_tokenizer(vl_dir)
        self.folder = folder
        self.files: dict[bytes, str] = {}

    def image(self, data: bytes) -> dict[str, Any]:
        key = bytes(data)
        if key not in self.files:
            self.files[key] = str(self.folder / f"image{len(self.files)}.png")
            Path(self.files[key]).write_bytes(key)
        if isinstance(data, Unsized):
            return {"png": self.files[key]}
        chunk = types.ModelInput(chunks=[types.ImageChunk(data=key, format="png")])
        return {"png": self.files[key], "expected_tokens": len(self.reader.row(chunk, "image").tokens)}

    def chunks(self, parts: list[str | bytes]) -> list[dict[str, Any]]:
        """Text parts as token chunks, bytes as image chunks: expected_tokens set (as tinker's cookbook does),
        or left out for `Unsized` bytes."""
        return [self.image(p) if isinstance(p, bytes) else {"tokens": encode(self.tok, p)} for p in parts]

    def datum(self, parts: list[str | bytes]) -> dict[str, Any]:
        """An SFT datum: the parts, then ANSWER; the loss on the answer's tokens only."""
        answer = encode(self.tok, ANSWER)
        chunks = self.chunks(parts)
        chunks.append({"tokens": answer[:-1]})
        tokens = self.reader.row(model_input(chunks), "datum").tokens
        n = len(tokens)
        return {
            "chunks": chunks,
            "target_tokens": [*tokens[1:], answer[-1]],
            "weights": [0.0] * (n - len(answer)) + [1.0] * len(answer),
        }


def model_input(chunks: list[dict[str, Any]]) -> types.ModelInput:
    """A chunk spec as posttrain's (tinker's) types, as the SDK script builds it."""
    out: list[types.ModelInputChunk] = []
    for chunk in chunks:
        if "tokens" in chunk:
            out.append(types.EncodedTextChunk(tokens=chunk["tokens"]))
        else:
            data = Path(chunk["png"]).read_bytes()
            out.append(
                types.ImageChunk(data=data, format="png", expected_tokens=chunk.get("expected_tokens"))
            )
    return types.ModelInput(chunks=out)


def run_locally(vl_dir: Path, root: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """What the SDK script does, on posttrain's local backend."""
    data = [
        types.Datum(
            model_input=model_input(d["chunks"]),
            loss_fn_inputs={"target_tokens": d["target_tokens"], "weights": d["weights"]},
        )
        for d in spec["data"]
    ]
    with tinker.ServiceClient(backend="local", root_dir=root) as local:
        training = local.create_lora_training_client(str(vl_dir), rank=4, seed=0)
        fb = training.forward_backward(data, "cross_entropy").result()
        step = training.optim_step(types.AdamParams(learning_rate=LR)).result()
        after = training.forward(data, "cross_entropy").result()
        sampler = training.save_weights_and_get_sampling_client()
        params = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=SEED)
        samples = sampler.sample(model_input(spec["prompt"]), 2, params).result()
    return {
        "loss": fb.metrics["loss:sum"],
        "logprobs": [o["logprobs"].tolist() for o in fb.loss_fn_outputs],
        "grad_norm": step.metrics["grad_norm:mean"],
        "after_loss": after.metrics["loss:sum"],
        "after_logprobs": [o["logprobs"].tolist() for o in after.loss_fn_outputs],
        "samples": [list(s.tokens) for s in samples.sequences],
        "sample_logprobs": [list(s.logprobs) for s in samples.sequences],
    }


def test_the_tinker_sdk_sends_images_and_gets_the_local_answers(
    vl_server: Running, vl_dir: Path, tmp_path: Path
) -> None:
    inputs = Inputs(vl_dir, tmp_path)
    small, other, large = shapes_png(0, 56), shapes_png(1, 56), shapes_png(2, 84)  # 4, 4 and 9 image tokens
    opening = "<|im_start|>user\n<|vision_start|>"
    spec = {
        "base_url": vl_server.url,
        "api_key": ALICE,
        "base_model": vl_server.model_name,
        "lr": LR,
        "seed": SEED,
        "max_tokens": MAX_TOKENS,
        "data": [
            inputs.datum([opening, Unsized(small), QUESTION]),
            inputs.datum(
                [opening, large, "<|vision_end|>and<|vision_start|>", other, QUESTION]
            ),  # two images
            inputs.datum(["<|im_start|>user\nNo image here." + QUESTION]),  # text only, in the same request
        ],
        "prompt": inputs.chunks([opening, Unsized(large), QUESTION]),
    }
    assert [c.get("expected_tokens") for c in spec["data"][1]["chunks"] if "png" in c] == [9, 4]
    assert [c.get("expected_tokens") for c in spec["prompt"] if "png" in c] == [None]
    for d in spec["data"]:  # what the server counts, unsized images included, is the datum's length
        assert inputs.reader.length(model_input(d["chunks"]), "datum") == len(d["target_tokens"])
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "TINKER_TELEMETRY": "0"}
    done = subprocess.run(
        [sys.executable, "-W", "ignore", str(SCRIPT), str(tmp_path / "spec.json")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    sdk = json.loads(done.stdout.strip().splitlines()[-1])
    local = run_locally(vl_dir, tmp_path / "local", spec)
    for key in ("logprobs", "after_logprobs"):
        assert [len(r) for r in sdk[key]] == [len(d["target_tokens"]) for d in spec["data"]]
        for got, expected in zip(sdk[key], local[key], strict=True):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    for key in ("loss", "grad_norm", "after_loss"):
        assert sdk[key] == pytest.approx(local[key], rel=1e-5), key
    assert sdk["after_loss"] < sdk["loss"]  # the step trained on the images' datums
    assert sdk["samples"] == local["samples"] and all(len(s) == MAX_TOKENS for s in sdk["samples"])
    for got, expected in zip(sdk["sample_logprobs"], local["sample_logprobs"], strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=1e-5)


DELAY_S = 2.0  # how long each image takes to process in the test below


def test_processing_images_leaves_the_event_loop_to_other_tenants(
    vl_server: Running, vl_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While one tenant's images are processed (made slow here), another tenant's request is answered at once:
    the processing runs in worker threads, for forward_backward and for sample."""
    remote = tinker.ServiceClient(backend="http", base_url=vl_server.url, api_key=ALICE)
    try:
        training = remote.create_lora_training_client(vl_server.model_name, rank=4, seed=0)
        spec = Inputs(vl_dir, tmp_path).datum(
            ["<|im_start|>user\n<|vision_start|>", shapes_png(3, 56), QUESTION]
        )
        datum = types.Datum(
            model_input=model_input(spec["chunks"]),
            loss_fn_inputs={"target_tokens": spec["target_tokens"], "weights": spec["weights"]},
        )
        training.forward([datum], "cross_entropy").result()  # the adapter is loaded
        sampler = training.save_weights_and_get_sampling_client()
        original = ModelInputReader._process
        processing = threading.Event()

        def slow(self: ModelInputReader, chunk: types.ImageChunk, where: str) -> Any:
            processing.set()
            time.sleep(DELAY_S)
            return original(self, chunk, where)

        monkeypatch.setattr(ModelInputReader, "_process", slow)
        calls = {
            "forward_backward": lambda: training.forward_backward([datum], "cross_entropy").result(),
            "sample": lambda: sampler.sample(
                datum.model_input, 1, types.SamplingParams(max_tokens=2, seed=0)
            ).result(),
        }
        for name, call in calls.items():
            processing.clear()
            answers: list[Any] = []  # the call's result, once it succeeded
            worker = threading.Thread(target=lambda out=answers, fn=call: out.append(fn()))
            worker.start()
            assert processing.wait(30), name
            with vl_server.client(BOB) as bob:
                start = time.monotonic()
                assert bob.get("/api/v1/get_server_capabilities").status_code == 200
                waited = time.monotonic() - start
            worker.join(60)
            assert not worker.is_alive() and answers, name
            assert waited < DELAY_S / 2, f"{name}: another tenant waited {waited:.2f} s for the loop"
    finally:
        remote.close()


def test_an_unsized_image_that_cannot_be_read_is_refused_naming_it(vl_dir: Path) -> None:
    reader = ModelInputReader(vl_dir)
    junk = types.ModelInput(
        chunks=[types.EncodedTextChunk(tokens=[1]), types.ImageChunk(data=b"not a png", format="png")]
    )
    with pytest.raises(ValueError, match="prompt: chunk 1: cannot read image"):
        reader.length(junk, "prompt")
