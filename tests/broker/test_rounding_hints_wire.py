"""Rounding hints on the wire (schema 6, broker/schema.py `hints`; docs/kv_cache.md "Rounding hints"): an exact round
trip (a sample with none too), their bytes, the refusal of a version-5 message carrying them and of malformed hints."""
from __future__ import annotations

import dataclasses
import io
import zlib

import msgpack
import numpy as np
import pytest

from broker.schema import SCHEMA_VERSION, SchemaError, decode_group, encode_group, hint_blob
from tests.broker.test_eviction_record import with_records


def with_hints(group, seed: int = 0):
    """The group (with eviction records) with hints per sample: ascending packed int64 values (index << 16 | bits)
    over a 3-layer, 2-head, head_dim-8 K/V of the sample's tokens; sample 1 with none."""
    rng = np.random.default_rng(seed)
    samples = []
    for i, s in enumerate(group.samples):
        elements = 3 * 2 * 2 * (len(s.prompt_ids) + len(s.response_ids)) * 8
        index = np.sort(rng.choice(elements, size=0 if i == 1 else 40, replace=False))
        samples.append(dataclasses.replace(s, rounding_hints=(index << 16) | rng.integers(0, 2 ** 16, len(index))))
    return dataclasses.replace(group, samples=samples)


def test_hints_round_trip_exactly_after_the_eviction_records(make_group):
    group = with_hints(with_records(make_group("g", n_samples=3, response_tokens=9)))
    data = encode_group(group)
    back = decode_group(data)
    assert SCHEMA_VERSION == 6
    for a, b in zip(group.samples, back.samples):
        assert b.rounding_hints.dtype == np.int64 and np.array_equal(a.rounding_hints, b.rounding_hints)
        assert np.array_equal(a.eviction_steps, b.eviction_steps)
    assert len(back.samples[1].rounding_hints) == 0
    bare = dataclasses.replace(group, samples=[dataclasses.replace(s, rounding_hints=None) for s in group.samples])
    blobs = [hint_blob(s.rounding_hints) for s in group.samples]
    assert data.endswith(b"".join(blobs))                       # the hint blobs close the message
    raw = zlib.decompress(blobs[0])   # 40 index differences (8 B, shuffled), then 40 code bits (2 B, shuffled)
    first = group.samples[0].rounding_hints
    assert len(raw) == 400
    assert np.frombuffer(raw[:40], np.uint8).tolist() == (np.diff(first >> 16, prepend=0) & 0xFF).tolist()
    assert np.frombuffer(raw[320:360], np.uint8).tolist() == (first & 0xFF).tolist()
    assert all(s.rounding_hints is None for s in decode_group(encode_group(bare)).samples)
    assert len(data) - len(encode_group(bare)) >= sum(map(len, blobs))


def test_a_version_5_message_is_refused(make_group):
    data = encode_group(with_hints(with_records(make_group("g"))))
    unpacker = msgpack.Unpacker(io.BytesIO(data), raw=False)
    header = unpacker.unpack()
    old = msgpack.packb({**header, "schema_version": 5}, use_bin_type=True) + data[unpacker.tell():]
    with pytest.raises(SchemaError, match="schema_version"):
        decode_group(old)


def _corrupt_blob(data: bytes) -> bytes:
    """The message with its last byte (inside the last hint blob) changed."""
    return data[:-1] + bytes([data[-1] ^ 0xFF])


@pytest.mark.parametrize("edit,reason", [
    (lambda g: setattr(g.samples[0], "rounding_hints", None), "bad_shape"),                          # one without
    (lambda g: setattr(g.samples[0], "rounding_hints", g.samples[0].rounding_hints[::-1].copy()), "bad_field"),
    (lambda g: setattr(g.samples[0], "rounding_hints", np.repeat(g.samples[0].rounding_hints, 2)), "bad_field"),
    (lambda g: setattr(g.samples[0], "rounding_hints", -g.samples[0].rounding_hints[::-1]), "bad_field"),
    (lambda g: setattr(g.samples[0], "rounding_hints", g.samples[0].rounding_hints.astype(np.float64)), "bad_dtype"),
    (lambda g: setattr(g.samples[0], "rounding_hints", g.samples[0].rounding_hints[None]), "bad_dtype"),
])
def test_malformed_hints_are_refused_at_the_actor(make_group, edit, reason):
    group = with_hints(with_records(make_group("g", n_samples=3, response_tokens=6)))
    edit(group)
    with pytest.raises(SchemaError) as err:
        encode_group(group)
    assert err.value.reason == reason


def test_a_damaged_blob_or_header_is_refused_at_the_learner(make_group):
    data = encode_group(with_hints(with_records(make_group("g", n_samples=3, response_tokens=6))))
    with pytest.raises(SchemaError) as err:
        decode_group(_corrupt_blob(data))
    assert err.value.reason == "bad_shape"
    unpacker = msgpack.Unpacker(io.BytesIO(data), raw=False)
    header = unpacker.unpack()
    for hints in ([1, 2], [10 ** 9] * 3, "x"):
        edited = msgpack.packb({**header, "hints": hints}, use_bin_type=True) + data[unpacker.tell():]
        with pytest.raises(SchemaError) as err:
            decode_group(edited)
        assert err.value.reason == "bad_shape", hints
