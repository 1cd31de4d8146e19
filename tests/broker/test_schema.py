"""The trajectory-group wire format: exact round trips and one rejection per validation rule."""
from __future__ import annotations

import io
import math

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.schema import (
    SCHEMA_VERSION,
    SampleRecord,
    SchemaError,
    TrajectoryGroup,
    decode_group,
    encode_group,
    group_wire_bytes,
)

text = st.text(max_size=20)
finite = st.floats(allow_nan=False, allow_infinity=False)


@st.composite
def samples(draw):
    n_prompt = draw(st.integers(0, 40))
    n_response = draw(st.one_of(st.integers(0, 40), st.just(32768)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if n_response <= 40:  # small responses: hypothesis picks the values (0.0, -0.0, tiny, huge negatives)
        logp = np.array(draw(st.lists(st.floats(max_value=0.0, allow_nan=False, allow_infinity=False, width=32),
                                      min_size=n_response, max_size=n_response)), dtype=np.float32)
    else:
        logp = -rng.exponential(2.0, n_response).astype(np.float32)
    return SampleRecord(prompt_ids=rng.integers(0, 2**31 - 1, n_prompt, dtype=np.int32),
                        response_ids=rng.integers(0, 2**31 - 1, n_response, dtype=np.int32),
                        logp_sparse=logp, finish_reason=draw(text), reward=draw(finite),
                        kv_retained_tokens=draw(st.integers(0, 2**40)), kv_peak_bytes=draw(st.integers(0, 2**50)),
                        kv_protected_fraction=draw(st.floats(0.0, 1.0)))


groups = st.builds(TrajectoryGroup, run_id=text, group_id=text, prompt_id=text,
                   weight_version=st.integers(0, 2**40), temperature=finite, compressor=text,
                   kv_budget=st.integers(0, 2**31), samples=st.lists(samples(), min_size=1, max_size=4),
                   actor_id=text, created_at=finite)


@settings(max_examples=60, deadline=None)
@given(groups)
def test_round_trip_is_exact(group):
    back = decode_group(encode_group(group))
    for name in ("run_id", "group_id", "prompt_id", "weight_version", "temperature", "compressor", "kv_budget",
                 "actor_id", "created_at"):
        assert getattr(back, name) == getattr(group, name), name
    assert len(back.samples) == len(group.samples)
    for s, t in zip(group.samples, back.samples):
        assert t.prompt_ids.dtype == np.int32 and t.response_ids.dtype == np.int32
        assert t.logp_sparse.dtype == np.float32
        for name in ("prompt_ids", "response_ids", "logp_sparse"):  # bitwise, so -0.0 and tiny values count
            assert getattr(t, name).tobytes() == getattr(s, name).tobytes(), name
        assert (t.finish_reason, t.reward, t.kv_retained_tokens, t.kv_peak_bytes, t.kv_protected_fraction) == \
               (s.finish_reason, s.reward, s.kv_retained_tokens, s.kv_peak_bytes, s.kv_protected_fraction)


def test_a_message_without_the_protected_fraction_reads_0(make_group):
    """kv_protected_fraction came within schema version 4: a header without it (an older writer) reads 0.0."""
    group = make_group("g", n_samples=2, response_tokens=3)
    group.samples[0].kv_protected_fraction = 0.25
    data = encode_group(group)
    unpacker = msgpack.Unpacker(io.BytesIO(data), raw=False)
    header = unpacker.unpack()
    assert header["kv_protected_fraction"] == [0.25, 0.0]
    assert [s.kv_protected_fraction for s in decode_group(data).samples] == [0.25, 0.0]
    del header["kv_protected_fraction"]
    old = msgpack.packb(header, use_bin_type=True) + data[unpacker.tell():]
    assert [s.kv_protected_fraction for s in decode_group(old).samples] == [0.0, 0.0]


def test_wire_layout_is_a_msgpack_header_then_raw_little_endian_arrays(make_group):
    group = make_group("g", n_samples=2, response_tokens=3)
    data = encode_group(group)
    unpacker = msgpack.Unpacker(io.BytesIO(data), raw=False)
    header = unpacker.unpack()
    assert header["prompt_ids"] == ["<i4", [14]] and header["response_ids"] == ["<i4", [6]]
    assert header["logp_sparse"] == ["<f4", [6]]
    assert header["prompt_lens"] == [7, 7] and header["response_lens"] == [3, 3]
    assert header["schema_version"] == SCHEMA_VERSION
    expected = b"".join(np.concatenate([getattr(s, name) for s in group.samples]).astype(dtype).tobytes()
                        for name, dtype in (("prompt_ids", "<i4"), ("response_ids", "<i4"), ("logp_sparse", "<f4")))
    assert data[unpacker.tell():] == expected


def test_encode_casts_int64_ids_and_float64_logp(make_group):
    group = make_group("g")
    s = group.samples[0]
    s.response_ids, s.logp_sparse = s.response_ids.astype(np.int64), s.logp_sparse.astype(np.float64)
    back = decode_group(encode_group(group)).samples[0]
    assert back.response_ids.dtype == np.int32 and back.logp_sparse.dtype == np.float32
    assert back.response_ids.tolist() == s.response_ids.tolist()


def _mutate(s, **changes):
    for k, v in changes.items():
        setattr(s, k, v)


ENCODE_CASES = {  # what the producer refuses, before anything reaches Redis
    "length_mismatch": lambda g: _mutate(g.samples[0], logp_sparse=np.zeros(4, np.float32)),
    "logp_not_finite": lambda g: g.samples[1].logp_sparse.__setitem__(2, np.nan),
    "logp_positive": lambda g: g.samples[0].logp_sparse.__setitem__(0, 0.5),
    "too_many_tokens": lambda g: _mutate(g.samples[0], response_ids=np.zeros(32769, np.int32),
                                         logp_sparse=np.zeros(32769, np.float32)),
    "bad_dtype": lambda g: _mutate(g.samples[0], response_ids=np.arange(5, dtype=np.float32)),
    "bad_token_id": lambda g: _mutate(g.samples[0], prompt_ids=np.array([1, 2**31], np.int64)),
    "bad_shape": lambda g: _mutate(g.samples[0], response_ids=np.zeros((5, 1), np.int32)),
    "reward_not_finite": lambda g: _mutate(g.samples[0], reward=math.inf),
    "no_samples": lambda g: _mutate(g, samples=[]),
}


@pytest.mark.parametrize("reason", ENCODE_CASES)
def test_encode_rejects_bad_groups_naming_the_field(reason, make_group):
    group = make_group("g")
    ENCODE_CASES[reason](group)
    with pytest.raises(SchemaError) as e:
        encode_group(group)
    assert e.value.reason == reason


def test_decode_rejects_oversized_message(make_group):
    data = encode_group(make_group("g"))
    with pytest.raises(SchemaError) as e:
        decode_group(data, max_message_bytes=len(data) - 1)
    assert e.value.reason == "message_too_large"
    assert decode_group(data, max_message_bytes=len(data)).group_id == "g"


def _with_topk(group, k: int, seed: int = 1):
    """Give every sample of `group` top-k arrays: ids int64 [T, k], log-probs float64 [T, k] (<= 0)."""
    rng = np.random.default_rng(seed)
    for s in group.samples:
        T = len(s.response_ids)
        s.topk_ids = rng.integers(0, 50000, (T, k))
        s.topk_logprobs = -np.sort(rng.exponential(3.0, (T, k)))[:, ::-1]
    return group


def test_topk_round_trip_float16_and_bytes_per_token(make_group):
    """Top-k log-probs travel as int32 ids + float16 log-probs: exactly 6 K more bytes per response token (120 at
    K = 20; the header grows by a few bytes), ids exact, log-probs to float16 rounding (relative 2**-11)."""
    plain = make_group("g", n_samples=3, response_tokens=40)
    base = len(encode_group(plain))
    group = _with_topk(make_group("g", n_samples=3, response_tokens=40), 20)
    data = encode_group(group)
    tokens = 3 * 40
    assert 120 * tokens <= len(data) - base <= 120 * tokens + 64   # + the two arrays' descriptors in the header
    back = decode_group(data)
    for s, t in zip(group.samples, back.samples):
        assert t.topk_ids.dtype == np.int32 and t.topk_ids.shape == (40, 20)
        assert t.topk_logprobs.dtype == np.float16 and t.topk_logprobs.shape == (40, 20)
        assert np.array_equal(t.topk_ids, s.topk_ids)
        assert np.allclose(t.topk_logprobs.astype(np.float64), s.topk_logprobs, rtol=2**-11, atol=1e-7)
    assert all(t.topk_ids is None for t in decode_group(encode_group(plain)).samples)
    unpacker = msgpack.Unpacker(io.BytesIO(data), raw=False)
    header = unpacker.unpack()
    assert header["topk"] == 20 and header["topk_logprobs"] == ["<f2", [tokens * 20]]
    # the preflight's size of a group (deploy/preflight.py: the broker queue at its high watermark)
    assert len(data) - unpacker.tell() == group_wire_bytes(3, 7, 40, topk=20)
    # below float16's range (p ~ 0) is sent as float16's lowest value, not -inf
    group.samples[0].topk_logprobs[0, -1] = -1e6
    assert decode_group(encode_group(group)).samples[0].topk_logprobs[0, -1] == np.finfo(np.float16).min


TOPK_CASES = {
    "logp_not_finite": lambda g: g.samples[1].topk_logprobs.__setitem__((2, 3), np.nan),
    "logp_positive": lambda g: g.samples[0].topk_logprobs.__setitem__((0, 0), 0.5),
    "bad_token_id": lambda g: g.samples[1].topk_ids.__setitem__((1, 1), -3),
    "length_mismatch": lambda g: _mutate(g.samples[0], topk_ids=g.samples[0].topk_ids[:-1],
                                         topk_logprobs=g.samples[0].topk_logprobs[:-1]),
    "bad_shape": lambda g: _mutate(g.samples[1], topk_ids=g.samples[1].topk_ids[:, :3],
                                   topk_logprobs=g.samples[1].topk_logprobs[:, :3]),   # another K in one group
}


@pytest.mark.parametrize("reason", TOPK_CASES)
def test_topk_rules_name_the_field(reason, make_group):
    group = _with_topk(make_group("g"), 4)
    TOPK_CASES[reason](group)
    with pytest.raises(SchemaError) as e:
        encode_group(group)
    assert e.value.reason == reason
    assert reason == "bad_shape" or "topk" in str(e.value)
