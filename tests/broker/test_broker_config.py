"""BrokerConfig checks its limits on construction, naming each bad one as `BrokerConfig.<field>`."""
from __future__ import annotations

import pytest

from broker.config import BrokerConfig


@pytest.mark.parametrize("kwargs, message", [
    (dict(high_watermark=0), "BrokerConfig.high_watermark=0: expected >= 1"),
    (dict(max_staleness=-1), "BrokerConfig.max_staleness=-1: expected >= 0"),
    (dict(backpressure_poll_s=0.0), "BrokerConfig.backpressure_poll_s=0.0: expected > 0"),
    (dict(retry_s=-1.0), "BrokerConfig.retry_s=-1.0: expected 0 <= retry_s <= 600 (seconds, 0 = no retry)"),
    (dict(retry_s=601), "BrokerConfig.retry_s=601: expected 0 <= retry_s <= 600 (seconds, 0 = no retry)"),
    (dict(max_message_bytes=0, block_ms=-1),
     "BrokerConfig.max_message_bytes=0: expected >= 1; "
     "BrokerConfig.block_ms=-1: expected >= 0 (0 = block until a group arrives)"),
])
def test_bad_limit_is_named(kwargs, message):
    with pytest.raises(ValueError) as err:
        BrokerConfig(**kwargs)
    assert str(err.value) == message


def test_edges_are_allowed():
    BrokerConfig(high_watermark=1, max_staleness=0, block_ms=0, retry_s=0)
    BrokerConfig(retry_s=600)
    assert BrokerConfig().retry_s == 30.0
