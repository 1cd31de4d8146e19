"""The trajectory-group wire format: exact round trips and one rejection per validation rule."""
from __future__ import annotations

import io
import math

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.schema import (SCHEMA_VERSION, SampleRecord, SchemaError, TrajectoryGroup, decode_group,
                           encode_group)

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
                        kv_retained_tokens=draw(st.integers(0, 2**40)), kv_peak_bytes=draw(st.integers(0, 2**50)))


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
        assert (t.finish_reason, t.reward, t.kv_retained_tokens, t.kv_peak_bytes) == \
               (s.finish_reason, s.reward, s.kv_retained_tokens, s.kv_peak_bytes)


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
