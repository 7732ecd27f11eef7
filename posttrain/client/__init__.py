"""The explicit training API, with tinker 0.38's names and semantics, in this process or on Ray.

tinker's own types are used as they are (`types.ModelInput`, `Datum`, `TensorData`, `SamplingParams`,
`AdamParams`, `ForwardBackwardOutput`, `SampleResponse`, ...), so code written against the tinker SDK ports
by changing `import tinker` to `from posttrain import client as tinker`. `ServiceClient(backend="http",
base_url=..., api_key=...)` runs the same calls on a `posttrain serve` server (posttrain/client/http.py).
"""

from tinker import types
from tinker.lib.public_interfaces.api_future import APIFuture
from tinker.types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    ModelInput,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    TensorData,
)

from posttrain.client.http_transport import HttpApiError, RetryPolicy
from posttrain.client.sampling import SamplingClient
from posttrain.client.service import ServiceClient
from posttrain.client.training import TrainingClient

__all__ = [
    "APIFuture",
    "AdamParams",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "HttpApiError",
    "ModelInput",
    "RetryPolicy",
    "SampleResponse",
    "SampledSequence",
    "SamplingClient",
    "SamplingParams",
    "ServiceClient",
    "TensorData",
    "TrainingClient",
    "types",
]
