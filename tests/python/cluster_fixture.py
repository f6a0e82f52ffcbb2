"""A real accord cluster (coordinator + sidecars from this build) for tests."""

import itertools

import accord

_jobs = itertools.count()


def cluster_info(cluster, world_size, name):
    """What fsdp_scenarios.make_agreement needs for one job on `cluster`."""
    sockets, local_ranks = [], []
    for r in range(world_size):
        s, lr = cluster.socket_for(r, world_size)
        sockets.append(s)
        local_ranks.append(lr)
    return {
        "job_id": f"{name}-{world_size}-{next(_jobs)}",
        "sockets": sockets,
        "local_ranks": local_ranks,
    }


def start_cluster(num_sidecars=2, sidecars_per_relay=0):
    return accord.LocalCluster(num_sidecars=num_sidecars, sidecars_per_relay=sidecars_per_relay)
