"""Eviction records on the wire (schema 3, docs/SPEC.md §2.4): exact round trip, refusal of other versions and of
malformed records, and the learner's consumer dead-lettering a group without records when it replays them
(real Redis)."""
from __future__ import annotations

import dataclasses
import io

import msgpack
import numpy as np
import pytest

from broker.config import BrokerConfig
from broker.run_state import key, run_counts
from broker.schema import SCHEMA_VERSION, SchemaError, decode_group, encode_group
from broker.streams import GroupConsumer, GroupProducer, connect
from tests.broker.test_streams import read_all

NEVER = 65535


def with_records(group, layers: int = 3, heads: int = 2, seed: int = 0):
    """The group with a plausible record per sample: keys evicted at multiples of 5 generated tokens, or never."""
    rng = np.random.default_rng(seed)
    samples = []
    for s in group.samples:
        width, T = len(s.prompt_ids) + len(s.response_ids), len(s.response_ids)
        steps = rng.choice([0, 5, NEVER, NEVER], size=(layers, heads, width)).astype(np.uint16)
        steps[steps != NEVER] = np.minimum(steps[steps != NEVER], T)
        samples.append(dataclasses.replace(s, eviction_steps=steps))
    return dataclasses.replace(group, samples=samples)


def test_records_round_trip_exactly_and_shared_rows_stay_one(make_group):
    group = with_records(make_group("g", n_samples=3, response_tokens=9))
    group.samples[1].eviction_steps = group.samples[1].eviction_steps[:, :1].copy()   # shared selection: one row
    back = decode_group(encode_group(group))
    assert SCHEMA_VERSION == 6
    for a, b in zip(group.samples, back.samples):
        assert b.eviction_steps.dtype == np.uint16 and np.array_equal(a.eviction_steps, b.eviction_steps)
    assert back.samples[1].eviction_steps.shape[1] == 1
    bare = decode_group(encode_group(make_group("g", n_samples=3, response_tokens=9)))
    assert all(s.eviction_steps is None for s in bare.samples)


def test_another_schema_version_is_refused_never_read_dense(make_group):
    data = encode_group(with_records(make_group("g")))
    unpacker = msgpack.Unpacker(io.BytesIO(data), raw=False)
    header = unpacker.unpack()
    rest = data[unpacker.tell():]
    for version in (2, 3, 4, 5, 7):
        old = msgpack.packb({**header, "schema_version": version}, use_bin_type=True) + rest
        with pytest.raises(SchemaError, match="schema_version"):
            decode_group(old)


@pytest.mark.parametrize("edit,reason", [
    (lambda g: setattr(g.samples[0], "eviction_steps", None), "bad_shape"),                       # one without
    (lambda g: setattr(g.samples[0], "eviction_steps", g.samples[0].eviction_steps.astype(np.int32)), "bad_dtype"),
    (lambda g: setattr(g.samples[0], "eviction_steps", g.samples[0].eviction_steps[:, :, 1:]), "bad_shape"),
    (lambda g: setattr(g.samples[1], "eviction_steps", g.samples[1].eviction_steps[1:]), "bad_shape"),  # layers
    (lambda g: g.samples[0].eviction_steps.__setitem__((0, 0, 0), 999), "bad_field"),              # after the end
])
def test_malformed_records_are_refused_at_the_actor_or_the_learner(make_group, edit, reason):
    group = with_records(make_group("g", response_tokens=6))
    edit(group)
    with pytest.raises(SchemaError) as err:
        decode_group(encode_group(group))
    assert err.value.reason == reason


def test_consumer_that_replays_dead_letters_a_group_without_records(redis_server, make_group):
    cfg = BrokerConfig(url=redis_server.url)
    client = connect(cfg)
    consumer = GroupConsumer(client, cfg, "run", "learner-0", require_eviction_record=True)
    producer = GroupProducer(client, cfg, "run")
    producer.publish(with_records(make_group("with")))
    producer.publish(make_group("without"))
    producer.publish(with_records(make_group("with-2")))
    assert [d.group.group_id for d in read_all(consumer, 2)] == ["with", "with-2"]
    (_, dead), = client.xrange(key("run", cfg.dead_letter_stream))
    assert dead[b"reason"] == b"no_eviction_record"
    assert run_counts(client, "run")["dead_lettered"] == 1
    # the dense learner takes the same group as it is
    plain = GroupConsumer(client, cfg, "run2", "learner-0")
    GroupProducer(client, cfg, "run2").publish(make_group("without", run_id="run2"))
    assert [d.group.group_id for d in read_all(plain, 1)] == ["without"]
