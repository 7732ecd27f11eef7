"""The official SDK after a refused request: its seq_id is spent, and the model's next calls must still run.
Only `import tinker`; prints one JSON line."""

import json
import sys

import numpy as np
import tinker
from tinker import types

service = tinker.ServiceClient()
training = service.create_lora_training_client(base_model=sys.argv[1], rank=2, seed=0).result()
tokenizer = training.get_tokenizer()


def datum(text: str) -> types.Datum:
    ids = tokenizer.encode(text)
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": np.ones(len(ids) - 1, dtype=np.float32)},
    )


out = {}
# many small datums over the server's tokens_per_request in all: the SDK cuts them into chunks the server
# takes (its client config), each a request of its own
many = training.forward_backward([datum("12+34=46")] * 40, "cross_entropy").result(timeout=120)
out["chunked"] = many.metrics["loss:sum"]
try:  # one datum over tokens_per_request: a 413, which the SDK does not retry
    training.forward_backward([datum("12+34=46 " * 30)], "cross_entropy").result(timeout=60)
    out["big"] = "accepted"
except Exception as exc:  # noqa: BLE001
    out["big"] = f"{type(exc).__name__}: {exc}"
try:  # a kind the server does not serve: a 400
    training.save_weights_and_get_sampling_client(kind="inflight").result(timeout=60)  # type: ignore[call-arg]
    out["inflight"] = "accepted"
except Exception as exc:  # noqa: BLE001
    out["inflight"] = f"{type(exc).__name__}: {exc}"
out["loss"] = (
    training.forward_backward([datum("1+2=3")], "cross_entropy").result(timeout=60).metrics["loss:sum"]
)
out["saved"] = training.save_state("after-refusals").result(timeout=60).path
print(json.dumps(out))
