"""The official tinker SDK sends image chunks to `posttrain serve`: only `import tinker`. Reads a JSON spec (the
server, the key, the datums and the prompt as token lists and PNG files), trains one step on the datums,
samples the prompt from the trained weights, and prints one JSON line of what came back.

A spec chunk is `{"tokens": [...]}` (an EncodedTextChunk) or `{"png": path, "expected_tokens": n}` (an
ImageChunk of that file's bytes; `expected_tokens` may be left out)."""

import json
import sys
from pathlib import Path

import tinker
from tinker import types


def model_input(chunks: list[dict]) -> types.ModelInput:
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


spec = json.loads(Path(sys.argv[1]).read_text())
service = tinker.ServiceClient(base_url=spec["base_url"], api_key=spec["api_key"])
training = service.create_lora_training_client(base_model=spec["base_model"], rank=4, seed=0)
data = [
    types.Datum(
        model_input=model_input(d["chunks"]),
        loss_fn_inputs={"target_tokens": d["target_tokens"], "weights": d["weights"]},
    )
    for d in spec["data"]
]
fb = training.forward_backward(data, "cross_entropy").result()
step = training.optim_step(types.AdamParams(learning_rate=spec["lr"])).result()
after = training.forward(data, "cross_entropy").result()
sampler = training.save_weights_and_get_sampling_client()
params = types.SamplingParams(max_tokens=spec["max_tokens"], temperature=1.0, seed=spec["seed"])
samples = sampler.sample(model_input(spec["prompt"]), num_samples=2, sampling_params=params).result()
print(
    json.dumps(
        {
            "loss": fb.metrics["loss:sum"],
            "logprobs": [o["logprobs"].tolist() for o in fb.loss_fn_outputs],
            "grad_norm": step.metrics["grad_norm:mean"],
            "after_loss": after.metrics["loss:sum"],
            "after_logprobs": [o["logprobs"].tolist() for o in after.loss_fn_outputs],
            "samples": [list(s.tokens) for s in samples.sequences],
            "sample_logprobs": [list(s.logprobs or []) for s in samples.sequences],
        }
    )
)
