"""The trajectory-group wire format (docs/ARCHITECTURE.md, "Contracts").

One message per prompt group: G samples of one prompt, all sampled with one weight version.
"""
from __future__ import annotations

import io
import math
import zlib
from dataclasses import dataclass, field

import msgpack
import numpy as np

SCHEMA_VERSION = 6
"""2: optional top-k log-probs per response token (header `topk`, arrays topk_ids / topk_logprobs).
3: optional eviction record per sample (header `eviction`, zlib blobs after the arrays; docs/SPEC.md §2.4).
4: optional trainable mask per response token (header `trainable`; multi-turn rollouts, docs/multi-turn.md):
a reader of version 3 would train on environment tokens, so it must refuse the message.
5: the KV quantizer each group was sampled with (header `kv_quant`: compressors.kv_quant.KVQuant.name, e.g. "model",
"bf16", "int8/token_head"): a reader of version 4 would replay a quantized sampler at the model's precision, so it
must refuse the message; the learner dead-letters a group whose quantizer is not its run's (kv_quant_mismatch).
6: optional rounding hints per sample (header `hints`, zlib blobs after the eviction blobs; docs/kv_cache.md "Rounding
hints"): a reader of version 5 would replay a quantized cache with its own codes where the sampler's rounding was
within noise of a boundary, so it must refuse the message."""


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
    kv_protected_fraction: float = 0.0
    """The share of the kept KV slots protection held at the last compression (actors.engines.base.Sample)."""
    topk_ids: np.ndarray | None = None
    """int32 [T, K]: the K most likely tokens of pi_sparse at each response position (None: not sent; all
    samples of a group send the same K or none)."""
    topk_logprobs: np.ndarray | None = None
    """[T, K] their log-probs (<= 0), float16 on the wire (decoded as a float16 view; the learner widens it)."""
    trainable: np.ndarray | None = None
    """uint8 [T]: 1 where the sampler generated the response token (loss, correction and mismatch metrics apply),
    0 where the environment or the chat template put it (a multi-turn rollout's observation and turn-boundary
    tokens: context of the learner's forward, never trained or scored; their logp_sparse is ignored, the actor
    sends 0). None: every response token is trainable (single-turn). A group sends masks for all samples or none
    (a sample without one gets all ones)."""
    eviction_steps: np.ndarray | None = None
    """uint16 [layers, heads, P + T]: the rollout's eviction record over the sample's own tokens
    (actors.engines.base.Sample; what learner.policy_target=sparse replays); zlib-compressed on the wire. None:
    not sent (all samples of a group send one or none)."""
    rounding_hints: np.ndarray | None = None
    """int64 [n], strictly ascending: the sampler's codes where its rounding of a stored K/V element was within
    noise of a code boundary (actors.engines.base.Sample.rounding_hints: flat index into [layers, 2, kv_heads,
    P + T, head_dim] << 16 | code bits), which learner.policy_target=sparse's replay stores instead of its own;
    delta-coded and zlib-compressed on the wire. None: not sent (all samples of a group send them or none)."""


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
    budget_tier: str = ""
    """Difficulty tier whose budget the group was sampled with (hard | medium | easy | new; "" = tiers off).
    Optional on the wire: a message without it decodes to ""."""
    """Unix time (seconds) when the actor published the group."""
    prompt_index: int = -1
    """Position of the prompt in the run's prompt stream (broker.prompts: the i-th prompt handed out is
    prompt i mod the data size), so the learner can checkpoint the data position; -1 when unknown."""
    kv_quant: str = "model"
    """The precision the sampler stored K/V at (compressors.kv_quant.KVQuant.name of compressor.kv_dtype /
    kv_scale: "model", "bf16", "fp8_e4m3/token_head", "fp8_e4m3/layer", "int8/token_head", "int4/token_head"),
    which the learner's replay quantize-dequantizes with (learner/replay.py)."""


class SchemaError(ValueError):
    """A trajectory group that cannot go on (or come off) the wire. `reason` is a short code stored with
    the dead letter (schema_version, not_msgpack, missing_field, bad_field, bad_dtype, bad_shape,
    length_mismatch, too_many_tokens, bad_token_id, message_too_large, logp_not_finite, logp_positive (both
    also for topk_logprobs), reward_not_finite, no_samples; the consumer adds run_id_mismatch, no_eviction_record
    and kv_quant_mismatch); the message names field and sample."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# Wire layout of one group: a msgpack map (the header), then the arrays' raw little-endian bytes back to
# back (prompt_ids, response_ids, logp_sparse of all samples), described by the header. Columnar, so that
# validation is a few numpy reductions per group; the arrays are copied once when encoding and are numpy
# views on the message when decoding. Header entries:
#   schema_version, the TrajectoryGroup scalars (_GROUP_FIELDS; kv_quant from version 5),
#   prompt_lens [G], response_lens [G]        sample i owns the i-th slice of each array
#   prompt_ids, response_ids, logp_sparse     [dtype str, shape [n]] of the samples' arrays concatenated
#   finish_reason, reward, kv_retained_tokens, kv_peak_bytes   lists of G values (_SAMPLE_FIELDS)
#   kv_protected_fraction                     list of G values (_OPTIONAL_SAMPLE_FIELDS; absent: 0.0)
#   topk                                      K (0 = no top-k arrays); with K > 0 also
#   topk_ids, topk_logprobs                   [dtype str, [n * K]]: row-major [T, K] per sample, concatenated
#   trainable                                 0 (every response token trainable) or ["|u1", [n]]: uint8 per
#                                             response token, 1 = sampled, 0 = environment / template token
#   eviction                                  0 (no records) or [layers, heads [G], blob bytes [G]]: after the
#                                             arrays, per sample zlib(uint16 [layers, heads, P + T] row-major)
#   hints                                     0 (no rounding hints) or blob bytes [G]: after the eviction blobs,
#                                             per sample `hint_blob`: zlib(the indices' differences, uint64 [n],
#                                             then the code bits, uint16 [n], each byte-shuffled)
# Bytes per response token: 4 (id) + 4 (logp_sparse), plus 6 K with top-k (int32 id + float16 log-prob per
# entry: 120 at K = 20), so a top-20 message is about 16x larger per token (TOPK_BYTES_PER_ENTRY).
_ARRAYS = {"prompt_ids": np.dtype("<i4"), "response_ids": np.dtype("<i4"), "logp_sparse": np.dtype("<f4")}
_TOPK_ARRAYS = {"topk_ids": np.dtype("<i4"), "topk_logprobs": np.dtype("<f2")}
_MASK_ARRAYS = {"trainable": np.dtype("|u1")}
_LENS = {"prompt_ids": "prompt_lens", "response_ids": "response_lens", "logp_sparse": "response_lens",
         "topk_ids": "response_lens", "topk_logprobs": "response_lens", "trainable": "response_lens"}
TOKEN_BYTES = 8
"""Wire bytes per response token without top-k: int32 id + float32 logp_sparse."""
TOPK_BYTES_PER_ENTRY = 6
"""Wire bytes per top-k entry of a response token: int32 id + float16 log-prob."""
_FP16_LOWEST = float(np.finfo(np.float16).min)
_GROUP_FIELDS = {"run_id": str, "group_id": str, "prompt_id": str, "weight_version": int, "temperature": float,
                 "compressor": str, "kv_budget": int, "actor_id": str, "created_at": float, "kv_quant": str}
_OPTIONAL_GROUP_FIELDS = {"budget_tier": (str, ""), "prompt_index": (int, -1)}
"""Header fields added after schema version 1: written always, read with their default when absent."""
_SAMPLE_FIELDS = {"finish_reason": str, "reward": float, "kv_retained_tokens": int, "kv_peak_bytes": int}
_OPTIONAL_SAMPLE_FIELDS = {"kv_protected_fraction": (float, 0.0)}
"""Per-sample header lists added within schema version 4: written always, read with their default when absent."""


def _sample_at(lens: list[int], flat_index: int) -> int:
    """Index of the sample holding element `flat_index` of a concatenated array."""
    return int(np.searchsorted(np.cumsum(lens), flat_index, side="right"))


def _validate(lens: dict[str, list[int]], arrays: dict[str, np.ndarray], rewards: list[float],
              max_response_tokens: int, max_prompt_tokens: int, topk: int = 0) -> None:
    """The content rules, on all G samples at once: token counts under the limits, token ids >= 0 (top-k ids
    too), logp_sparse and topk_logprobs finite and <= 0, rewards finite. Raises SchemaError naming the first
    bad sample."""
    for name, limit in (("prompt_lens", max_prompt_tokens), ("response_lens", max_response_tokens)):
        if max(lens[name]) > limit:
            i = int(np.argmax(lens[name]))
            raise SchemaError("too_many_tokens", f"samples[{i}]: {lens[name][i]} {name.split('_')[0]} tokens > {limit}")
    per_token = {"topk_ids": topk, "topk_logprobs": topk}  # elements per response token (1 for the others)
    for name in ("prompt_ids", "response_ids", "topk_ids")[:3 if topk else 2]:
        ids = arrays[name]
        if ids.size and ids.min() < 0:
            i = _sample_at(lens[_LENS[name]], int(np.argmin(ids)) // per_token.get(name, 1))
            raise SchemaError("bad_token_id", f"samples[{i}].{name} has negative ids (min {int(ids.min())})")
    for name in ("logp_sparse", "topk_logprobs")[:2 if topk else 1]:
        logp = arrays[name]
        if not logp.size:
            continue
        lo, hi = logp.min(), logp.max()  # both NaN if any element is NaN
        if not (np.isfinite(lo) and np.isfinite(hi)):
            i = _sample_at(lens["response_lens"], int(np.argmin(np.isfinite(logp))) // per_token.get(name, 1))
            raise SchemaError("logp_not_finite", f"samples[{i}].{name} has NaN or inf")
        if hi > 0:
            i = _sample_at(lens["response_lens"], int(np.argmax(logp)) // per_token.get(name, 1))
            raise SchemaError("logp_positive", f"samples[{i}].{name} has values > 0 (max {float(hi)})")
    mask = arrays.get("trainable")
    if mask is not None and mask.size and mask.max() > 1:
        i = _sample_at(lens["response_lens"], int(np.argmax(mask)))
        raise SchemaError("bad_field", f"samples[{i}].trainable holds {int(mask.max())}: expected 0 or 1")
    for i, reward in enumerate(rewards):
        if not math.isfinite(reward):
            raise SchemaError("reward_not_finite", f"samples[{i}].reward = {reward}")


def _wire_array(a, dtype: np.dtype, where: str) -> np.ndarray:
    """`a` as a contiguous 1-D array of the wire dtype. Token ids may come as any integer dtype with values in
    [0, 2**31), logp_sparse as any float dtype. Raises SchemaError (bad_shape, bad_dtype, bad_token_id)."""
    a = np.asarray(a)
    if a.ndim != 1:
        raise SchemaError("bad_shape", f"{where}: expected 1-D, got shape {a.shape}")
    if a.dtype != dtype and a.size:
        if a.dtype.kind not in ("f" if dtype.kind == "f" else "iu"):
            raise SchemaError("bad_dtype", f"{where}: expected {dtype}, got {a.dtype}")
        if a.dtype.kind in "iu" and not np.can_cast(a.dtype, dtype) and (a.min() < 0 or a.max() >= 2**31):
            raise SchemaError("bad_token_id", f"{where}: ids must lie in [0, 2**31), got [{a.min()}, {a.max()}]")
    return np.ascontiguousarray(a, dtype=dtype)


def _views(data: bytes, offset: int, counts: dict[str, int]) -> dict[str, np.ndarray]:
    """Read-only views on the arrays stored back to back in data[offset:], counts[name] elements each (in the
    order of `counts`)."""
    arrays = {}
    for name in counts:
        dtype = {**_ARRAYS, **_TOPK_ARRAYS, **_MASK_ARRAYS}[name]
        arrays[name] = np.frombuffer(data, dtype=dtype, count=counts[name], offset=offset)
        offset += counts[name] * dtype.itemsize
    return arrays


def encode_group(group: TrajectoryGroup, max_response_tokens: int = 32768, max_prompt_tokens: int = 32768) -> bytes:
    """TrajectoryGroup -> message bytes (msgpack header + raw arrays, layout above); never pickle. Token ids may
    come as any integer dtype in [0, 2**31) and are sent as int32, `logp_sparse` as any float dtype, sent as
    float32. The same rules as decode_group are checked first, so a bad group fails at the actor, not at the
    learner. The arrays are copied once, into the message. Raises SchemaError."""
    if not group.samples:
        raise SchemaError("no_samples", f"group {group.group_id!r} has no samples")
    topk = _topk_width(group.samples)
    masked = any(s.trainable is not None for s in group.samples)
    wire = {**_ARRAYS, **(_TOPK_ARRAYS if topk else {}), **(_MASK_ARRAYS if masked else {})}
    arrays = {name: [] for name in wire}  # name -> the samples' arrays in the wire dtype
    for i, s in enumerate(group.samples):
        for name, dtype in _ARRAYS.items():
            a = getattr(s, name)
            if not (type(a) is np.ndarray and a.dtype == dtype and a.ndim == 1 and a.flags.c_contiguous):
                a = _wire_array(a, dtype, f"samples[{i}].{name}")  # convert or reject
            arrays[name].append(a)
        for name, dtype in _TOPK_ARRAYS.items() if topk else ():
            a = np.asarray(getattr(s, name))
            if a.shape != (len(arrays["response_ids"][i]), topk):
                raise SchemaError("length_mismatch", f"samples[{i}].{name} has shape {a.shape}, expected "
                                                     f"[len(response_ids), topk] = "
                                                     f"[{len(arrays['response_ids'][i])}, {topk}]")
            if name == "topk_logprobs" and a.dtype.kind == "f":  # below float16's range: its lowest value (p ~ 0)
                a = np.maximum(a, _FP16_LOWEST)
            arrays[name].append(_wire_array(a.reshape(-1), dtype, f"samples[{i}].{name}"))
        if masked:
            arrays["trainable"].append(_trainable(s, len(arrays["response_ids"][i]), i))
    lens = {"prompt_lens": [len(a) for a in arrays["prompt_ids"]],
            "response_lens": [len(a) for a in arrays["response_ids"]]}
    if [len(a) for a in arrays["logp_sparse"]] != lens["response_lens"]:
        i = next(i for i, a in enumerate(arrays["logp_sparse"]) if len(a) != lens["response_lens"][i])
        raise SchemaError("length_mismatch", f"samples[{i}]: len(logp_sparse) = {len(arrays['logp_sparse'][i])} "
                                             f"!= len(response_ids) = {lens['response_lens'][i]}")
    columns = {name: [kind(getattr(s, name)) for s in group.samples] for name, kind in _SAMPLE_FIELDS.items()}
    optional = {name: [kind(getattr(s, name)) for s in group.samples]
                for name, (kind, _) in _OPTIONAL_SAMPLE_FIELDS.items()}
    counts = {name: sum(lens[_LENS[name]]) * (topk if name in _TOPK_ARRAYS else 1) for name in wire}
    msg = {name: kind(getattr(group, name)) for name, kind in _GROUP_FIELDS.items()}
    msg.update({name: kind(getattr(group, name)) for name, (kind, _) in _OPTIONAL_GROUP_FIELDS.items()})
    msg.update(schema_version=SCHEMA_VERSION, topk=topk, **lens, **columns, **optional)
    msg.update({name: [dtype.str, [counts[name]]] for name, dtype in wire.items()})
    msg.setdefault("trainable", 0)
    eviction, blobs = _eviction_blobs(group.samples, lens)
    msg["eviction"] = eviction
    msg["hints"], hint_blobs = _hint_blobs(group.samples)
    blobs = blobs + hint_blobs
    header = msgpack.packb(msg, use_bin_type=True)
    data = b"".join([header, *(a for parts in arrays.values() for a in parts), *blobs])
    _validate(lens, _views(data, len(header), counts), columns["reward"], max_response_tokens, max_prompt_tokens,
              topk)
    return data


def _trainable(s: SampleRecord, n: int, i: int) -> np.ndarray:
    """Sample i's trainable mask as uint8 [n] (all ones when it has none). Raises SchemaError (length_mismatch,
    bad_field)."""
    if s.trainable is None:
        return np.ones(n, dtype=np.uint8)
    a = np.asarray(s.trainable)
    if a.shape != (n,):
        raise SchemaError("length_mismatch", f"samples[{i}].trainable has shape {a.shape}, expected "
                                             f"[len(response_ids)] = [{n}]")
    if a.dtype.kind not in "biu" or (a.size and (a.min() < 0 or a.max() > 1)):
        raise SchemaError("bad_field", f"samples[{i}].trainable: expected 0/1 values, got dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.uint8)


EVICTION_ZLIB_LEVEL = 6
"""zlib level of the eviction blobs (bench/replay.py measures the bytes per group)."""


def _all_or_none(samples: list[SampleRecord], field: str) -> bool:
    """Whether the group's samples carry the optional array `field` (eviction_steps, rounding_hints): True when all
    do, False when none does. Raises SchemaError (bad_shape) naming the first sample without it when some do."""
    have = [getattr(s, field) is not None for s in samples]
    if any(have) and not all(have):
        raise SchemaError("bad_shape", f"samples[{have.index(False)}] has no {field}: all samples of a group "
                                       "send one or none")
    return any(have)


def _eviction_blobs(samples: list[SampleRecord], lens: dict[str, list[int]]) -> tuple:
    """The header entry `eviction` and the samples' compressed records (layout above). Raises SchemaError
    (bad_shape, bad_dtype) when some samples carry a record and others not, or a record's shape is not
    [layers, heads, P + T] with one layer count per group."""
    if not _all_or_none(samples, "eviction_steps"):
        return 0, []
    layers = {np.shape(s.eviction_steps)[0] if np.ndim(s.eviction_steps) == 3 else -1 for s in samples}
    heads, blobs = [], []
    for i, s in enumerate(samples):
        a = np.asarray(s.eviction_steps)
        if a.dtype != np.uint16:
            raise SchemaError("bad_dtype", f"samples[{i}].eviction_steps: expected uint16, got {a.dtype}")
        if a.ndim != 3 or len(layers) != 1 or a.shape[2] != lens["prompt_lens"][i] + lens["response_lens"][i]:
            raise SchemaError("bad_shape", f"samples[{i}].eviction_steps has shape {a.shape}, expected [layers, heads, "
                                           f"P + T = {lens['prompt_lens'][i] + lens['response_lens'][i]}], one layer "
                                           "count per group")
        heads.append(int(a.shape[1]))
        blobs.append(zlib.compress(np.ascontiguousarray(a, dtype="<u2").tobytes(), EVICTION_ZLIB_LEVEL))
    return [layers.pop(), heads, [len(b) for b in blobs]], blobs


def _decode_eviction(msg: dict, data: bytes, offset: int, lens: dict[str, list[int]], end: int) -> list:
    """The samples' eviction records (uint16 [layers, heads, P + T] each) from the blobs at data[offset:end], or Nones
    when the group sends none. Raises SchemaError (bad_shape) on a header that does not match the blobs."""
    entry = msg.get("eviction", 0)
    n = len(lens["prompt_lens"])
    if entry == 0:
        if offset != end:
            raise SchemaError("bad_shape", f"the message holds {end} bytes before its hints, the header accounts for "
                                           f"{offset}")
        return [None] * n
    if not (isinstance(entry, list) and len(entry) == 3 and type(entry[0]) is int and entry[0] > 0
            and all(isinstance(x, list) and len(x) == n for x in entry[1:])):
        raise SchemaError("bad_shape", f"eviction: expected [layers, heads [{n}], bytes [{n}]], got {entry!r}")
    layers, heads, sizes = entry
    if offset + sum(sizes) != end:
        raise SchemaError("bad_shape", f"the message holds {end} bytes before its hints, the header accounts for "
                                       f"{offset + sum(sizes)}")
    out = []
    for i, (h, size) in enumerate(zip(heads, sizes)):
        width = lens["prompt_lens"][i] + lens["response_lens"][i]
        try:
            raw = zlib.decompress(data[offset:offset + size])
        except zlib.error as e:
            raise SchemaError("bad_shape", f"samples[{i}].eviction_steps: {e}") from None
        if len(raw) != 2 * layers * h * width:
            raise SchemaError("bad_shape",
                              f"samples[{i}].eviction_steps: {len(raw)} bytes for [{layers}, {h}, {width}]")
        steps = np.frombuffer(raw, dtype="<u2").reshape(layers, h, width)
        late = (steps != 65535) & (steps > lens["response_lens"][i])
        if late.any():
            raise SchemaError("bad_field", f"samples[{i}].eviction_steps: a key evicted after the response ended "
                                           f"({int(steps[late].max())} > {lens['response_lens'][i]} tokens)")
        out.append(steps)
        offset += size
    return out


def _hint_blobs(samples: list[SampleRecord]) -> tuple:
    """The header entry `hints` and the samples' compressed rounding hints (layout above). Raises SchemaError
    (bad_shape, bad_dtype, bad_field) when some samples carry hints and others not, or a sample's are not a 1-D
    integer array of non-negative, strictly ascending values."""
    if not _all_or_none(samples, "rounding_hints"):
        return 0, []
    blobs = []
    for i, s in enumerate(samples):
        a = np.asarray(s.rounding_hints)
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise SchemaError("bad_dtype", f"samples[{i}].rounding_hints: expected int64 [n], got {a.dtype} {a.shape}")
        _check_hints(a.astype(np.int64), i)
        blobs.append(hint_blob(a))
    return [len(b) for b in blobs], blobs


def hint_blob(hints: np.ndarray) -> bytes:
    """One sample's rounding hints (int64 [n], ascending: index << 16 | code bits) as they travel: zlib, at
    EVICTION_ZLIB_LEVEL, of the indices' differences (the first from 0) as uint64 [n] little-endian, then the code
    bits as uint16 [n], each byte-shuffled (byte 0 of every value, then byte 1, ...: the zero high bytes of small
    differences compress away; 1.65 B per hint at the main job's shape against 2.65 unshuffled, bench/
    replay_kv_quant.py). Its length is the sample's hint bytes on the wire."""
    hints = np.asarray(hints, dtype=np.int64)
    planes = [np.diff(hints >> 16, prepend=0).astype("<u8"), (hints & 0xFFFF).astype("<u2")]
    return zlib.compress(b"".join(_shuffled(a) for a in planes), EVICTION_ZLIB_LEVEL)


def _shuffled(a: np.ndarray) -> bytes:
    """A 1-D array's bytes, byte-shuffled: byte 0 of every value, then byte 1, ... (the inverse is `_unshuffled`)."""
    return np.ascontiguousarray(a.view(np.uint8).reshape(len(a), a.itemsize).T).tobytes()


def _unshuffled(raw: bytes, dtype: str, n: int) -> np.ndarray:
    """The inverse of `_shuffled`: n values of `dtype` from their shuffled bytes."""
    size = np.dtype(dtype).itemsize
    return np.ascontiguousarray(np.frombuffer(raw, np.uint8).reshape(size, n).T).view(dtype)[:, 0]


def _check_hints(hints: np.ndarray, i: int) -> None:
    """SchemaError bad_field unless sample i's rounding hints (int64 [n]) are >= 0 and strictly ascending."""
    if hints.size and (hints[0] < 0 or (np.diff(hints) <= 0).any()):
        raise SchemaError("bad_field", f"samples[{i}].rounding_hints: expected non-negative, strictly ascending values")


def _decode_hints(msg: dict, data: bytes, n: int) -> tuple[list, int]:
    """The samples' rounding hints (int64 [n_i] each, or Nones when the group sends none) and where their blobs
    start: the last bytes of the message. Raises SchemaError (bad_shape, bad_field) on a header that does not match
    the blobs or hints that are not strictly ascending."""
    entry = msg.get("hints", 0)
    if entry == 0:
        return [None] * n, len(data)
    if not (isinstance(entry, list) and len(entry) == n and all(type(x) is int and x >= 0 for x in entry)):
        raise SchemaError("bad_shape", f"hints: expected blob bytes [{n}], got {entry!r}")
    offset = start = len(data) - sum(entry)
    if start < 0:
        raise SchemaError("bad_shape", f"hints: {sum(entry)} bytes of blobs in a message of {len(data)}")
    out = []
    for i, size in enumerate(entry):
        try:
            raw = zlib.decompress(data[offset:offset + size])
        except zlib.error as e:
            raise SchemaError("bad_shape", f"samples[{i}].rounding_hints: {e}") from None
        if len(raw) % 10:
            raise SchemaError("bad_shape", f"samples[{i}].rounding_hints: {len(raw)} bytes, not 10 per hint")
        count = len(raw) // 10
        index = np.cumsum(_unshuffled(raw[:8 * count], "<u8", count)).view(np.int64)
        if count and (index[-1] >= 2 ** 47 or index[-1] < 0):
            raise SchemaError("bad_field", f"samples[{i}].rounding_hints: an index past 2^47")
        hints = (index << 16) | _unshuffled(raw[8 * count:], "<u2", count).astype(np.int64)
        _check_hints(hints, i)
        out.append(hints)
        offset += size
    return out, start


def _topk_width(samples: list[SampleRecord]) -> int:
    """K of the samples' top-k arrays (0: none sent). Raises SchemaError bad_shape when a sample has one of
    topk_ids / topk_logprobs without the other, or the samples differ in K."""
    widths = set()
    for i, s in enumerate(samples):
        if (s.topk_ids is None) != (s.topk_logprobs is None):
            raise SchemaError("bad_shape", f"samples[{i}]: topk_ids and topk_logprobs go together (one is None)")
        widths.add(0 if s.topk_ids is None or np.ndim(s.topk_ids) != 2 else int(np.shape(s.topk_ids)[1]))
    if len(widths) > 1:
        raise SchemaError("bad_shape", f"the samples send top-k of widths {sorted(widths)}: one K per group (or none)")
    return widths.pop()


def group_wire_bytes(samples: int, prompt_tokens: int, response_tokens: int, topk: int = 0,
                     record_rows: int = 0) -> int:
    """Bytes of the arrays of one encoded group of `samples` samples, each of `prompt_tokens` + `response_tokens`
    tokens, with top-k width `topk` (the msgpack header, ~100 bytes + ~30 per sample, is not counted):
    4 bytes per prompt token, TOKEN_BYTES + TOPK_BYTES_PER_ENTRY x topk per response token, and with eviction
    records of `record_rows` = layers x KV heads rows, at most 2 bytes per row and token (uint16 before zlib,
    which the bound does not count on: bench/replay.py measures what it saves)."""
    per_sample = 4 * prompt_tokens + response_tokens * (TOKEN_BYTES + TOPK_BYTES_PER_ENTRY * topk)
    return samples * (per_sample + 2 * record_rows * (prompt_tokens + response_tokens))


def _field(msg: dict, name: str, kind: type):
    if name not in msg:
        raise SchemaError("missing_field", f"{name} is missing")
    value = msg[name]
    if kind is float and type(value) is int:
        value = float(value)
    if type(value) is not kind:
        raise SchemaError("bad_field", f"{name}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def _column(msg: dict, name: str, kind: type, n: int) -> list:
    values = _field(msg, name, list)
    if len(values) != n:
        raise SchemaError("bad_shape", f"{name}: {len(values)} values for {n} samples")
    types = set(map(type, values))
    if kind is float and int in types:
        values = [float(v) if type(v) is int else v for v in values]
        types = set(map(type, values))
    if types - {kind}:
        bad = next(t for t in types if t is not kind)
        raise SchemaError("bad_field", f"{name}: expected {kind.__name__} values, got {bad.__name__}")
    return values


def _array_counts(msg: dict, offset: int, size: int) -> tuple[dict[str, int], int]:
    """Element counts of the arrays described in the header msg, checked against the message: dtypes, and
    offset (where the arrays start) + their bytes <= size (the message's length); and where the arrays end (the
    eviction blobs follow: `_decode_eviction` checks the rest)."""
    counts = {}
    topk = _field(msg, "topk", int)
    if topk < 0:
        raise SchemaError("bad_field", f"topk: expected >= 0, got {topk}")
    masked = msg.get("trainable", 0) != 0
    for name, dtype in {**_ARRAYS, **(_TOPK_ARRAYS if topk else {}), **(_MASK_ARRAYS if masked else {})}.items():
        value = _field(msg, name, list)
        if not (len(value) == 2 and type(value[1]) is list and len(value[1]) == 1 and type(value[1][0]) is int
                and value[1][0] >= 0):
            raise SchemaError("bad_shape", f"{name}: expected [dtype, [n]], got {value!r}")
        if value[0] != dtype.str:
            raise SchemaError("bad_dtype", f"{name}: expected {dtype.str}, got {value[0]!r}")
        counts[name] = value[1][0]
        offset += counts[name] * dtype.itemsize
        if offset > size:
            raise SchemaError("bad_shape", f"{name}: shape [{counts[name]}] runs past the {size} bytes of the message")
    return counts, offset


def decode_group(data: bytes, max_message_bytes: int = 64 * 1024 * 1024, max_response_tokens: int = 32768,
                 max_prompt_tokens: int = 32768) -> TrajectoryGroup:
    """Message bytes (layout above) -> TrajectoryGroup, validated: size <= max_message_bytes, schema version, every
    field and its type, dtypes, shapes and len(logp_sparse) == len(response_ids) per sample, then the content
    rules (token limits, ids >= 0, logp_sparse and topk_logprobs finite and <= 0, finite rewards); top-k arrays
    come back as [T, K] views (topk_logprobs float16), trainable masks as uint8 [T] (None when the group sends
    none), eviction records as uint16 [layers, heads, P + T], rounding hints as int64 [n]. The arrays are read-only
    numpy views on the message (copy before writing in place). Raises SchemaError; never unpickles."""
    if len(data) > max_message_bytes:
        raise SchemaError("message_too_large", f"{len(data)} bytes > max_message_bytes = {max_message_bytes}")
    unpacker = msgpack.Unpacker(io.BytesIO(data), raw=False, read_size=16384)  # reads the header only
    try:
        msg = unpacker.unpack()
    except Exception as e:  # msgpack raises several unrelated exception types on garbage
        raise SchemaError("not_msgpack", f"{type(e).__name__}: {e}") from None
    if not isinstance(msg, dict):
        raise SchemaError("not_msgpack", f"expected a map, got {type(msg).__name__}")
    if msg.get("schema_version") != SCHEMA_VERSION:
        raise SchemaError("schema_version", f"expected {SCHEMA_VERSION}, got {msg.get('schema_version')!r}")
    fields = {name: _field(msg, name, kind) for name, kind in _GROUP_FIELDS.items()}
    fields.update({name: _field(msg, name, kind) if name in msg else default
                   for name, (kind, default) in _OPTIONAL_GROUP_FIELDS.items()})
    n = len(_field(msg, "finish_reason", list))
    if n == 0:
        raise SchemaError("no_samples", f"group {fields['group_id']!r} has no samples")
    columns = {name: _column(msg, name, kind, n) for name, kind in _SAMPLE_FIELDS.items()}
    optional = {name: _column(msg, name, kind, n) if name in msg else [default] * n
                for name, (kind, default) in _OPTIONAL_SAMPLE_FIELDS.items()}
    lens = {name: _column(msg, name, int, n) for name in ("prompt_lens", "response_lens")}
    if min(lens["prompt_lens"] + lens["response_lens"]) < 0:
        raise SchemaError("bad_shape", "prompt_lens / response_lens hold a negative length")
    counts, end = _array_counts(msg, unpacker.tell(), len(data))
    hints, hints_start = _decode_hints(msg, data, n)
    evictions = _decode_eviction(msg, data, end, lens, hints_start)
    topk = msg["topk"]
    for name, count in counts.items():
        expected = sum(lens[_LENS[name]]) * (topk if name in _TOPK_ARRAYS else 1)
        if count != expected:
            raise SchemaError("length_mismatch" if name in ("logp_sparse", "trainable", *_TOPK_ARRAYS) else "bad_shape",
                              f"{name} holds {count} values, {_LENS[name]} (x topk for top-k) give {expected}")
    arrays = _views(data, unpacker.tell(), counts)
    _validate(lens, arrays, columns["reward"], max_response_tokens, max_prompt_tokens, topk)
    prompt_ids, response_ids, logp_sparse = arrays["prompt_ids"], arrays["response_ids"], arrays["logp_sparse"]
    samples, p0, r0 = [], 0, 0
    for p, r, eviction_steps, rounding_hints, protected, finish_reason, reward, kv_retained_tokens, kv_peak_bytes \
            in zip(lens["prompt_lens"], lens["response_lens"], evictions, hints, optional["kv_protected_fraction"],
                   *(columns[name] for name in _SAMPLE_FIELDS)):
        top = {name: arrays[name][r0 * topk:(r0 + r) * topk].reshape(r, topk) for name in _TOPK_ARRAYS} if topk else {}
        if "trainable" in arrays:
            top["trainable"] = arrays["trainable"][r0:r0 + r]
        samples.append(SampleRecord(
            prompt_ids=prompt_ids[p0:p0 + p], response_ids=response_ids[r0:r0 + r], logp_sparse=logp_sparse[r0:r0 + r],
            finish_reason=finish_reason, reward=reward, kv_retained_tokens=kv_retained_tokens,
            kv_peak_bytes=kv_peak_bytes, kv_protected_fraction=protected, eviction_steps=eviction_steps,
            rounding_hints=rounding_hints, **top))
        p0, r0 = p0 + p, r0 + r
    return TrajectoryGroup(**fields, samples=samples)
