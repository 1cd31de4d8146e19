"""`ray` for the compose services (`python3 docker/ray_node.py start ...`, `... status`): the arguments go to the
`ray` command unchanged, plus `--node-ip-address=$SPARSE_RL_RAY_NODE_IP` for `start` when that variable is set.

With the node IP 127.0.0.1 (every container on the host's network, as in tests/deploy/test_compose.py) Ray
would replace it by the machine's routable address (ray._private.services.resolve_ip_for_localhost, for a
worker node that joins a head) and then listen on every interface; here it stays 127.0.0.1, so the node's
servers (GCS, raylet, agents, workers) listen on the loopback address only. `status` then finds the head on
127.0.0.1 too. Unset (compose's default bridge network), Ray finds the container's address itself.
"""
import os
import sys

import ray._private.services as services
from ray.scripts.scripts import main

node_ip = os.environ.get("SPARSE_RL_RAY_NODE_IP", "")
if node_ip and sys.argv[1:2] == ["start"]:
    sys.argv.append(f"--node-ip-address={node_ip}")
if node_ip == "127.0.0.1":
    services.node_ip_address_from_perspective = lambda address=None: node_ip
sys.argv[0] = "ray"
sys.exit(main())
