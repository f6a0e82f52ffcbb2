"""The accord client from Python: connect, register, submit, wait."""

from __future__ import annotations

import os
from typing import Optional

from accord import _accord

Client = _accord.Client
DecisionFuture = _accord.DecisionFuture


def connect(
    socket_path: Optional[str] = None,
    job_id: Optional[str] = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    local_rank: Optional[int] = None,
    token: Optional[str] = None,
    connect_timeout_s: float = 30.0,
) -> Client:
    """Connects this rank to its node's sidecar.

    Arguments left out come from the environment: ACCORD_SOCKET, ACCORD_JOB_ID,
    ACCORD_TOKEN, and torchrun's RANK, WORLD_SIZE and LOCAL_RANK.
    """

    def env(name: str, value, default=None, conv=str):
        if value is not None:
            return value
        raw = os.environ.get(name)
        if raw is None:
            if default is None:
                raise ValueError(
                    f"accord.connect: {name} is not set; pass it as an argument or set the "
                    f"environment variable"
                )
            return default
        return conv(raw)

    return Client.connect(
        socket_path=env("ACCORD_SOCKET", socket_path),
        job_id=env("ACCORD_JOB_ID", job_id),
        rank=env("RANK", rank, conv=int),
        world_size=env("WORLD_SIZE", world_size, conv=int),
        local_rank=env("LOCAL_RANK", local_rank, default=0, conv=int),
        token=env("ACCORD_TOKEN", token, default=""),
        connect_timeout_s=connect_timeout_s,
    )
