"""The KV quantizer on the wire (schema 5, broker/schema.py `kv_quant`): it round-trips, a version-4 reader's message
is refused, and the learner's consumer dead-letters a group sampled with another quantizer than its run's, never
replaying it with the wrong one (real Redis)."""
from __future__ import annotations

import dataclasses
import io

import msgpack
import pytest

from broker.config import BrokerConfig
from broker.run_state import key, run_counts
from broker.schema import SCHEMA_VERSION, SchemaError, decode_group, encode_group
from broker.streams import GroupConsumer, GroupProducer, connect
from tests.broker.test_streams import read_all


def test_the_quantizer_round_trips_and_a_version_4_message_is_refused(make_group):
    group = dataclasses.replace(make_group("g"), kv_quant="int8/token_head")
    assert SCHEMA_VERSION == 6
    assert decode_group(encode_group(group)).kv_quant == "int8/token_head"
    assert decode_group(encode_group(make_group("g"))).kv_quant == "model"
    data = encode_group(group)
    unpacker = msgpack.Unpacker(io.BytesIO(data), raw=False)
    header = unpacker.unpack()
    rest = data[unpacker.tell():]
    old = {k: v for k, v in header.items() if k != "kv_quant"}
    with pytest.raises(SchemaError, match="schema_version"):     # a version-4 message: no quantizer said
        decode_group(msgpack.packb({**old, "schema_version": 4}, use_bin_type=True) + rest)
    with pytest.raises(SchemaError) as err:                      # version 5 without it
        decode_group(msgpack.packb(old, use_bin_type=True) + rest)
    assert err.value.reason == "missing_field"


def test_consumer_dead_letters_a_group_of_another_quantizer(redis_server, make_group):
    cfg = BrokerConfig(url=redis_server.url)
    client = connect(cfg)
    consumer = GroupConsumer(client, cfg, "run", "learner-0", kv_quant="fp8_e4m3/token_head")
    producer = GroupProducer(client, cfg, "run")
    producer.publish(dataclasses.replace(make_group("fp8"), kv_quant="fp8_e4m3/token_head"))
    producer.publish(dataclasses.replace(make_group("int8"), kv_quant="int8/token_head"))
    producer.publish(make_group("model"))
    producer.publish(dataclasses.replace(make_group("fp8-2"), kv_quant="fp8_e4m3/token_head"))
    assert [d.group.group_id for d in read_all(consumer, 2)] == ["fp8", "fp8-2"]
    dead = [f for _, f in client.xrange(key("run", cfg.dead_letter_stream))]
    assert [f[b"reason"] for f in dead] == [b"kv_quant_mismatch"] * 2
    assert b"'int8/token_head'" in dead[0][b"detail"] and b"'fp8_e4m3/token_head'" in dead[0][b"detail"]
    assert run_counts(client, "run")["dead_lettered"] == 2
