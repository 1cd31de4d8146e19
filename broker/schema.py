"""The trajectory-group wire format (shared/ARCHITECTURE.md, "Contracts").

One message per prompt group: G samples of one prompt, all sampled with one weight version.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import msgpack
import numpy as np

SCHEMA_VERSION = 1


@dataclass
class SampleRecord:
    """One response of a group. Arrays are 1-D: `prompt_ids` int32 [P], `response_ids` int32 [T],
    `logp_sparse` float32 [T] (log pi_sparse of each response token, <= 0)."""
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logp_sparse: np.ndarray
    finish_reason: str
    reward: float
    kv_retained_tokens: int = 0
    kv_peak_bytes: int = 0


@dataclass
class TrajectoryGroup:
    """The G samples of one prompt (a GRPO group) with the sampler settings they were drawn with."""
    run_id: str
    group_id: str
    prompt_id: str
    weight_version: int
    temperature: float
    compressor: str
    kv_budget: int
    samples: list[SampleRecord] = field(default_factory=list)
    actor_id: str = ""
    created_at: float = 0.0
    """Unix time (seconds) when the actor published the group."""


class SchemaError(ValueError):
    """A trajectory group that cannot go on (or come off) the wire. `reason` is a short code stored with
    the dead letter (schema_version, not_msgpack, missing_field, bad_field, bad_dtype, bad_shape,
    length_mismatch, too_many_tokens, bad_token_id, message_too_large, logp_not_finite, logp_positive, reward_not_finite,
    no_samples); the message names the field and sample."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# Wire dtypes (little-endian, whatever the host): token ids int32, log-probs float32.
_IDS = np.dtype("<i4")
_LOGP = np.dtype("<f4")
_GROUP_FIELDS = {"run_id": str, "group_id": str, "prompt_id": str, "weight_version": int, "temperature": float,
                 "compressor": str, "kv_budget": int, "actor_id": str, "created_at": float}
_SAMPLE_FIELDS = {"finish_reason": str, "reward": float, "kv_retained_tokens": int, "kv_peak_bytes": int}


def validate_group(group: TrajectoryGroup, max_response_tokens: int = 32768, max_prompt_tokens: int = 32768) -> None:
    """Check a group against the contract (shared/ARCHITECTURE.md, "Trajectory group message"): at least
    one sample; per sample 1-D int32 `prompt_ids` [P] and `response_ids` [T], float32 `logp_sparse` [T]
    with T == len(response_ids), finite and <= 0; P <= max_prompt_tokens, T <= max_response_tokens; a
    finite reward. Vectorised (numpy), cheap next to the transfer. Raises SchemaError."""
    if not group.samples:
        raise SchemaError("no_samples", f"group {group.group_id!r} has no samples")
    for i, s in enumerate(group.samples):
        for name, arr, dtype in (("prompt_ids", s.prompt_ids, _IDS), ("response_ids", s.response_ids, _IDS),
                                 ("logp_sparse", s.logp_sparse, _LOGP)):
            if not isinstance(arr, np.ndarray) or arr.dtype != dtype:
                got = arr.dtype if isinstance(arr, np.ndarray) else type(arr).__name__
                raise SchemaError("bad_dtype", f"samples[{i}].{name}: expected {dtype}, got {got}")
            if arr.ndim != 1:
                raise SchemaError("bad_shape", f"samples[{i}].{name}: expected 1-D, got shape {arr.shape}")
        if len(s.logp_sparse) != len(s.response_ids):
            raise SchemaError("length_mismatch", f"samples[{i}]: len(logp_sparse) = {len(s.logp_sparse)} != "
                                                 f"len(response_ids) = {len(s.response_ids)}")
        if len(s.response_ids) > max_response_tokens or len(s.prompt_ids) > max_prompt_tokens:
            raise SchemaError("too_many_tokens", f"samples[{i}]: prompt {len(s.prompt_ids)} / response "
                                                 f"{len(s.response_ids)} tokens, limits {max_prompt_tokens} / "
                                                 f"{max_response_tokens}")
        for name, ids in (("prompt_ids", s.prompt_ids), ("response_ids", s.response_ids)):
            if len(ids) and ids.min() < 0:
                raise SchemaError("bad_token_id", f"samples[{i}].{name} has negative ids (min {int(ids.min())})")
        if not np.isfinite(s.logp_sparse).all():
            raise SchemaError("logp_not_finite", f"samples[{i}].logp_sparse has NaN or inf")
        if not (s.logp_sparse <= 0).all():
            raise SchemaError("logp_positive", f"samples[{i}].logp_sparse has values > 0 "
                                               f"(max {float(s.logp_sparse.max())})")
        if not math.isfinite(s.reward):
            raise SchemaError("reward_not_finite", f"samples[{i}].reward = {s.reward}")


def _pack_array(arr, dtype: np.dtype) -> list:
    arr = np.ascontiguousarray(arr, dtype=dtype)
    return [dtype.str, list(arr.shape), memoryview(arr).cast("B")]


def encode_group(group: TrajectoryGroup, max_response_tokens: int = 32768, max_prompt_tokens: int = 32768) -> bytes:
    """TrajectoryGroup -> msgpack bytes. Token ids are cast to int32 and `logp_sparse` to float32 (any
    integer / float input), arrays travel as [dtype, shape, raw little-endian bytes]; never pickle.
    The group is validated first (`validate_group`), so a bad group fails at the actor, not the learner.
    Raises SchemaError."""
    samples = []
    for i, s in enumerate(group.samples):
        for name in ("prompt_ids", "response_ids", "logp_sparse"):
            arr = np.asarray(getattr(s, name))
            if arr.size == 0:
                continue
            if arr.dtype.kind not in ("f" if name == "logp_sparse" else "iu"):
                raise SchemaError("bad_dtype", f"samples[{i}].{name}: expected "
                                               f"{'floats' if name == 'logp_sparse' else 'integers'}, got {arr.dtype}")
            if arr.dtype.kind in "iu" and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
                raise SchemaError("bad_token_id", f"samples[{i}].{name}: ids must lie in [0, 2**31), "
                                                  f"got [{arr.min()}, {arr.max()}]")
        samples.append(SampleRecord(
            prompt_ids=np.ascontiguousarray(s.prompt_ids, dtype=_IDS),
            response_ids=np.ascontiguousarray(s.response_ids, dtype=_IDS),
            logp_sparse=np.ascontiguousarray(s.logp_sparse, dtype=_LOGP),
            finish_reason=str(s.finish_reason), reward=float(s.reward),
            kv_retained_tokens=int(s.kv_retained_tokens), kv_peak_bytes=int(s.kv_peak_bytes)))
    validate_group(dataclasses.replace(group, samples=samples), max_response_tokens, max_prompt_tokens)
    msg = {name: kind(getattr(group, name)) for name, kind in _GROUP_FIELDS.items()}
    msg["schema_version"] = SCHEMA_VERSION
    msg["samples"] = [
        {"prompt_ids": _pack_array(s.prompt_ids, _IDS), "response_ids": _pack_array(s.response_ids, _IDS),
         "logp_sparse": _pack_array(s.logp_sparse, _LOGP),
         **{name: getattr(s, name) for name in _SAMPLE_FIELDS}}
        for s in samples]
    return msgpack.packb(msg, use_bin_type=True)


def _field(d: dict, name: str, kind: type, where: str):
    if name not in d:
        raise SchemaError("missing_field", f"{where}{name} is missing")
    value = d[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not kind:
        raise SchemaError("bad_field", f"{where}{name}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def _unpack_array(value, dtype: np.dtype, where: str) -> np.ndarray:
    if not (isinstance(value, list) and len(value) == 3 and isinstance(value[2], bytes)):
        raise SchemaError("bad_field", f"{where}: expected [dtype, shape, bytes]")
    if value[0] != dtype.str:
        raise SchemaError("bad_dtype", f"{where}: expected {dtype.str}, got {value[0]!r}")
    shape, data = value[1], value[2]
    if not (isinstance(shape, list) and len(shape) == 1 and type(shape[0]) is int
            and shape[0] * dtype.itemsize == len(data)):
        raise SchemaError("bad_shape", f"{where}: shape {shape!r} does not match {len(data)} bytes of {dtype.str}")
    return np.frombuffer(data, dtype=dtype)


def decode_group(data: bytes, max_message_bytes: int = 64 * 1024 * 1024, max_response_tokens: int = 32768,
                 max_prompt_tokens: int = 32768) -> TrajectoryGroup:
    """msgpack bytes -> TrajectoryGroup, validated: size <= max_message_bytes, schema version, every field
    and its type, dtypes and shapes, then `validate_group`. Arrays are read-only numpy views on the message
    (copy before writing in place). Raises SchemaError; never unpickles anything."""
    if len(data) > max_message_bytes:
        raise SchemaError("message_too_large", f"{len(data)} bytes > max_message_bytes = {max_message_bytes}")
    try:
        msg = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several unrelated exception types on garbage
        raise SchemaError("not_msgpack", f"{type(e).__name__}: {e}") from None
    if not isinstance(msg, dict):
        raise SchemaError("not_msgpack", f"expected a map, got {type(msg).__name__}")
    if msg.get("schema_version") != SCHEMA_VERSION:
        raise SchemaError("schema_version", f"expected {SCHEMA_VERSION}, got {msg.get('schema_version')!r}")
    fields = {name: _field(msg, name, kind, "") for name, kind in _GROUP_FIELDS.items()}
    raw_samples = _field(msg, "samples", list, "")
    samples = []
    for i, s in enumerate(raw_samples):
        where = f"samples[{i}]."
        if not isinstance(s, dict):
            raise SchemaError("bad_field", f"samples[{i}]: expected a map")
        arrays = {name: _unpack_array(_field(s, name, list, where), dtype, where + name)
                  for name, dtype in (("prompt_ids", _IDS), ("response_ids", _IDS), ("logp_sparse", _LOGP))}
        samples.append(SampleRecord(**arrays, **{name: _field(s, name, kind, where)
                                                 for name, kind in _SAMPLE_FIELDS.items()}))
    group = TrajectoryGroup(**fields, samples=samples)
    validate_group(group, max_response_tokens, max_prompt_tokens)
    return group
