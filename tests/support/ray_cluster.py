"""A local Ray cluster for the tests: ``nodes`` one-CPU nodes, every one on 127.0.0.1."""
from __future__ import annotations

import contextlib

# The variable that keeps a cluster on 127.0.0.1: otherwise Ray maps the loopback address to the host's
# network address, where these nodes do not listen. The nodes and the processes that join them read it.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@contextlib.contextmanager
def local_ray_cluster(nodes: int = 2, *, join_here: bool = False):
    """Yields the started ``ray.cluster_utils.Cluster``. ``join_here``: this process may join it too
    (``RAY_ADDRESS`` names it and Ray's loopback switch is set here, until the cluster stops)."""
    import pytest
    import ray
    import ray._private.ray_constants as ray_constants
    from ray.cluster_utils import Cluster

    patch = pytest.MonkeyPatch()
    for k, v in LOOPBACK_ENV.items():
        patch.setenv(k, v)
    if join_here:
        patch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)       # (read when Ray was imported)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1",
                                                            "include_dashboard": False})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes(timeout=120)
        if join_here:
            patch.setenv("RAY_ADDRESS", cluster.address)
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
        patch.undo()
