"""tinker's protobuf wire format, the server's side: decode what the SDK sends, encode what it decodes.

The schema is the SDK's own (`tinker.proto.tinker_public_pb2`, package `tinker_public`); the SDK encodes
`ForwardBackwardRequest` (`tinker.proto.request_conv`) and decodes `ForwardBackwardOutput` and
`SampleResponse` (`tinker.proto.response_conv`); these are the inverse directions, tested as round trips
through the SDK's functions. Text chunks carry int32 little-endian token bytes; tensors are dense bytes or
sparse CSR (values + int64 crow/col indices); a forward/backward output is one ArrayRecord whose fields
are BatchedTensors (all datums' values concatenated, int64 byte offsets per datum).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.response_conv import _tensor_data_from_proto

_DTYPE = {"float32": (pb.DTYPE_FLOAT32, np.float32), "int64": (pb.DTYPE_INT64, np.int64)}


class WireError(ValueError):
    """A body that is not a valid message of the expected kind (answered with 400, naming the problem)."""


@dataclass(frozen=True)
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    data: list[types.Datum]
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None
    forward_only: bool


def _chunk(msg: pb.Chunk) -> types.ModelInputChunk:
    kind = msg.WhichOneof("chunk")
    if kind == "encoded_text":
        return types.EncodedTextChunk(tokens=np.frombuffer(msg.encoded_text.tokens, dtype="<i4").tolist())
    if kind == "image":
        return types.ImageChunk(
            data=msg.image.data,
            format=msg.image.format,  # type: ignore[arg-type]
            expected_tokens=msg.image.expected_tokens if msg.image.HasField("expected_tokens") else None,
        )
    raise WireError(f"model_input chunk of kind {kind!r} is not supported (token and image chunks are)")


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    """A `/forward_backward` body (`tinker_public.ForwardBackwardRequest`) as SDK types."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # noqa: BLE001 - protobuf raises its own DecodeError types
        raise WireError(f"forward_backward body is not a ForwardBackwardRequest message: {exc}") from None
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():  # v2 wins where both are set (the SDK writes both)
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    data = []
    for i, datum in enumerate(msg.data):
        try:
            chunks = [_chunk(c) for c in datum.model_input]
            inputs = {name: _tensor_data_from_proto(t) for name, t in datum.loss_fn_inputs.items()}
        except ValueError as exc:
            raise WireError(f"datum {i}: {exc}") from None
        data.append(types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs=inputs))
    return ForwardBackwardCall(
        model_id=msg.model_id,
        seq_id=int(msg.seq_id),
        data=data,
        loss_fn=msg.loss_fn,
        loss_fn_config=config or None,
        forward_only=bool(msg.forward_only),
    )


def _batched(arrays: list[np.ndarray], dtype: str) -> pb.BatchedTensor:
    proto_dtype, np_dtype = _DTYPE[dtype]
    flat = [np.ascontiguousarray(a, dtype=np_dtype).reshape(-1) for a in arrays]
    sizes = np.array([0, *(a.nbytes for a in flat)], dtype=np.int64)
    return pb.BatchedTensor(
        data=b"".join(a.tobytes() for a in flat),
        offsets=np.cumsum(sizes).astype(np.int64).tobytes(),
        dtype=proto_dtype,
        trailing_shape=list(arrays[0].shape[1:]) if arrays else [],
    )


def encode_forward_backward_output(out: types.ForwardBackwardOutput) -> bytes:
    """`tinker_public.ForwardBackwardOutput`: one ArrayRecord, one BatchedTensor per output field."""
    record = pb.ArrayRecord(num_datums=len(out.loss_fn_outputs))
    names = list(out.loss_fn_outputs[0]) if out.loss_fn_outputs else []
    for name in names:
        tensors = [datum[name] for datum in out.loss_fn_outputs]
        record.fields[name].CopyFrom(_batched([t.to_numpy() for t in tensors], tensors[0].dtype))
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=out.loss_fn_output_type, metrics=out.metrics)
    msg.loss_fn_outputs.append(record)
    return msg.SerializeToString()


def encode_sample_response(response: types.SampleResponse) -> bytes:
    """`tinker_public.SampleResponse`: tokens int32, log-probs float32, prompt log-probs (NaN = none)."""
    msg = pb.SampleResponse()
    for seq in response.sequences:
        out = msg.sequences.add()
        out.stop_reason = pb.STOP_REASON_LENGTH if seq.stop_reason == "length" else pb.STOP_REASON_STOP
        out.tokens = np.asarray(seq.tokens, dtype="<i4").tobytes()
        if seq.logprobs is not None:
            out.logprobs = np.asarray(seq.logprobs, dtype="<f4").tobytes()
    if response.prompt_logprobs_np is not None:
        msg.prompt_logprobs = np.asarray(response.prompt_logprobs_np, dtype="<f4").tobytes()
    topk = response.topk_prompt_logprobs_np
    if topk is not None:
        length, k = topk.token_ids.shape
        msg.topk_prompt_logprobs.CopyFrom(
            pb.TopkLogprobs(
                token_ids=np.asarray(topk.token_ids, dtype="<i4").tobytes(),
                logprobs=np.asarray(topk.logprobs, dtype="<f4").tobytes(),
                k=k,
                length=length,
            )
        )
    if response.target_prompt_logprobs is not None:
        msg.target_prompt_logprobs.CopyFrom(_tensor(response.target_prompt_logprobs))
    if response.prompt_alt_tokens is not None:
        alt = response.prompt_alt_tokens
        msg.prompt_alt_tokens.CopyFrom(
            pb.PromptAltTokens(tokens=_tensor(alt.tokens), logprobs=_tensor(alt.logprobs))
        )
    return msg.SerializeToString()


def _tensor(data: types.TensorData) -> pb.Tensor:
    """A TensorData as `tinker_public.Tensor`, dense or sparse CSR as it is."""
    proto_dtype, np_dtype = _DTYPE[data.dtype]
    if data.sparse_crow_indices is None:
        array = data.to_numpy()
        return pb.Tensor(
            dense=np.ascontiguousarray(array, dtype=np_dtype).tobytes(),
            dtype=proto_dtype,
            shape=list(array.shape),
        )
    csr = pb.SparseCsr(
        values=np.asarray(data.data, dtype=np_dtype).tobytes(),
        crow_indices=np.asarray(data.sparse_crow_indices, dtype="<i8").tobytes(),
        col_indices=np.asarray(data.sparse_col_indices, dtype="<i8").tobytes(),
    )
    return pb.Tensor(sparse_csr=csr, dtype=proto_dtype, shape=list(data.shape or []))
