"""A producer or consumer in its own process, for the crash tests of test_streams.py (run as a script).

    _worker.py produce URL RUN_ID PREFIX N
    _worker.py consume URL RUN_ID NAME BATCHES BATCH_SIZE
The consumer commits BATCHES batches (printing `committed <ids>`), reads one more batch, prints
`holding <ids>` and sleeps until killed.
"""
import sys
import time

from conftest import make_group  # tests/broker/conftest.py (this directory is sys.path[0])

from broker.config import BrokerConfig
from broker.streams import GroupConsumer, GroupProducer, connect

role, url, run_id = sys.argv[1:4]
cfg = BrokerConfig(url=url, high_watermark=10_000)
client = connect(cfg)
if role == "produce":
    prefix, n = sys.argv[4], int(sys.argv[5])
    producer = GroupProducer(client, cfg, run_id)
    for i in range(n):
        producer.publish(make_group(f"{prefix}-{i}", run_id=run_id, seed=i))
else:
    consumer = GroupConsumer(client, cfg, run_id, sys.argv[4])
    batches, batch_size = int(sys.argv[5]), int(sys.argv[6])
    for _ in range(batches):
        deliveries = []
        while not deliveries:
            deliveries = consumer.read(batch_size, block_ms=200)
        consumer.commit(deliveries)
        print("committed", *[d.group.group_id for d in deliveries], flush=True)
    deliveries = []
    while not deliveries:
        deliveries = consumer.read(batch_size, block_ms=200)
    print("holding", *[d.group.group_id for d in deliveries], flush=True)
    time.sleep(600)
