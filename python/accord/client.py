"""The accord client from Python: connect, register, submit, wait."""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional, Tuple

from accord import _accord
from accord import embedded

Client = _accord.Client
DecisionFuture = _accord.DecisionFuture

_log = logging.getLogger("accord")
_announced = False


def _param(name: str, value, dist_value, conv=int) -> Tuple[Optional[object], str]:
    """(value, where it came from): the argument, the environment variable,
    or torch.distributed."""
    if value is not None:
        return value, f"the {name.lower()} argument"
    raw = os.environ.get(name)
    if raw is not None and raw != "":
        try:
            return conv(raw), name
        except ValueError:
            raise ValueError(f"accord.connect: {name}={raw!r} is not an integer") from None
    if dist_value is not None:
        return dist_value, "torch.distributed"
    return None, ""


def _job_id(job_id: Optional[str]) -> Tuple[Optional[str], str]:
    if job_id is not None:
        return job_id, "the job_id argument"
    if os.environ.get("ACCORD_JOB_ID"):
        return os.environ["ACCORD_JOB_ID"], "ACCORD_JOB_ID"
    # torchrun's default --rdzv-id is "none": every job would share it.
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return run_id, "TORCHELASTIC_RUN_ID (torchrun's run id)"
    return None, ""


def _check_against_dist(dist, rank: int, rank_src: str, world: int, world_src: str):
    """Values read from RANK / WORLD_SIZE must be the process group's."""
    if dist is None:
        return
    for name, value, src, actual, getter in (
        ("WORLD_SIZE", world, world_src, dist.get_world_size(), "dist.get_world_size()"),
        ("RANK", rank, rank_src, dist.get_rank(), "dist.get_rank()"),
    ):
        if src == name and value != actual:
            raise ValueError(
                f"accord.connect: {name}={value} (environment) disagrees with torch.distributed: "
                f"{getter} is {actual}; the environment does not describe this process group. "
                f"Unset {name} or pass {name.lower()}= explicitly"
            )


def _announce(rank: int, boot: "embedded.Bootstrap", choice: "embedded.ModeChoice"):
    """One line on rank 0 per process: the mode and where its metrics are."""
    global _announced
    if rank != 0 or _announced or choice.mode == embedded.ARGUMENT:
        return
    _announced = True
    if boot.mode == embedded.EMBEDDED:
        metrics = ", ".join(f"{k} {v}" for k, v in boot.metrics.items() if v) or "off"
        line = (
            f"accord: embedded mode ({choice.reason}): job {boot.job_id}, coordinator "
            f"{boot.coordinator} started by rank 0, one sidecar per node; metrics: {metrics}; "
            f"accordctl --coordinator={boot.coordinator} --token=$(cat {boot.token_file})"
        )
    elif boot.mode == embedded.DEPLOYED:
        line = (
            f"accord: deployed sidecar at {boot.socket_path} ({choice.reason}), job "
            f"{boot.job_id}; metrics: the deployment's (accord-sidecar --metrics_port, 9091 by "
            f"default)"
        )
    else:
        line = (
            f"accord: sidecar from ACCORD_SOCKET={boot.socket_path}, job {boot.job_id}; "
            f"metrics: that deployment's (accord-sidecar --metrics_port, 9091 by default)"
        )
    if _log.hasHandlers() and _log.isEnabledFor(logging.INFO):
        _log.info(line)
    else:
        print(line, file=sys.stderr, flush=True)


def _bootstrap(dist, choice, job, job_src, rank, world_size, local_rank, timeout_s):
    """Where the sidecar is and the job id: agreed through torch.distributed's
    store when it is initialized (starting the embedded daemons there), else
    from the arguments and the environment alone."""
    if dist is not None and (choice.mode != embedded.ARGUMENT or job is None):
        if choice.mode == embedded.EMBEDDED and local_rank is None and world_size > 1:
            raise ValueError(
                "accord.connect (embedded mode): LOCAL_RANK is not set, so this rank cannot tell "
                "whether it starts its node's sidecar; run under torchrun (it sets LOCAL_RANK), "
                "set LOCAL_RANK, or pass local_rank="
            )
        return embedded.bootstrap(choice, job, job_src, rank, world_size, local_rank or 0,
                                  timeout_s)
    if choice.mode == embedded.EMBEDDED:
        raise ValueError(
            f"accord.connect: no sidecar to connect to ({choice.reason}), and embedded mode "
            f"needs torch.distributed initialized to share the daemons' addresses: call "
            f"torch.distributed.init_process_group(...) before accord.connect(), or set "
            f"ACCORD_SOCKET to a running sidecar's socket"
        )
    if job is None:
        raise ValueError(
            "accord.connect: ACCORD_JOB_ID is not set; pass job_id, set ACCORD_JOB_ID, run under "
            "torchrun (TORCHELASTIC_RUN_ID), or initialize torch.distributed so that the ranks "
            "agree on one"
        )
    return embedded.Bootstrap(mode=choice.mode, job_id=job, socket_path=choice.socket_path)


def _with_socket_hint(e: "_accord.Error", choice, path: str) -> "_accord.Error":
    """A failed connection to a named or deployed socket, with why nothing
    answers there."""
    if choice.mode in (embedded.ENV, embedded.DEPLOYED):
        answers, why = embedded.probe_socket(path)
        if not answers:
            hint = (", or unset ACCORD_SOCKET to let the job start its own daemons"
                    if choice.mode == embedded.ENV else "")
            return _accord.make_error(e.code, f"{e.message} [{choice.reason}: {why}; start "
                                              f"accord-sidecar --socket={path}{hint}]")
    return e


def connect(
    socket_path: Optional[str] = None,
    job_id: Optional[str] = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    local_rank: Optional[int] = None,
    token: Optional[str] = None,
    connect_timeout_s: float = 30.0,
    reconnect_grace_s: float = 10.0,
) -> Client:
    """Connects this rank to its node's sidecar.

    Arguments left out come from the environment. The socket: ACCORD_SOCKET,
    else the deployed sidecar's /run/accord/sidecar.sock when one answers
    there, else embedded mode: with torch.distributed initialized, the job
    starts its own coordinator (on rank 0) and one sidecar per node
    (docs/EMBEDDED.md). The job id: ACCORD_JOB_ID, else torchrun's
    TORCHELASTIC_RUN_ID, else one that rank 0 draws and shares through the
    torch.distributed store. RANK, WORLD_SIZE and LOCAL_RANK as torchrun sets
    them (or torch.distributed's rank and world size); ACCORD_TOKEN.

    reconnect_grace_s: how long the client reconnects to a restarted sidecar
    and resumes before every call fails (docs/RELIABILITY.md, "Sidecar
    restart"). Embedded mode does not reconnect: its sidecar dies with the
    rank that started it, and nobody restarts it.
    """
    dist = embedded.initialized_dist()
    rank, rank_src = _param("RANK", rank, dist.get_rank() if dist else None)
    world_size, world_src = _param("WORLD_SIZE", world_size,
                                   dist.get_world_size() if dist else None)
    for name, value in (("RANK", rank), ("WORLD_SIZE", world_size)):
        if value is None:
            raise ValueError(
                f"accord.connect: {name} is not set; pass it as an argument, set the environment "
                f"variable (torchrun does), or initialize torch.distributed first"
            )
    _check_against_dist(dist, rank, rank_src, world_size, world_src)
    local_rank, _ = _param("LOCAL_RANK", local_rank, None)
    job, job_src = _job_id(job_id)
    choice = embedded.choose_mode(socket_path)
    boot = _bootstrap(dist, choice, job, job_src, rank, world_size, local_rank,
                      connect_timeout_s)
    if boot.mode == embedded.EMBEDDED:
        token = boot.token
    elif token is None:
        token = os.environ.get("ACCORD_TOKEN", "")
    try:
        client = Client.connect(
            socket_path=boot.socket_path,
            job_id=boot.job_id,
            rank=rank,
            world_size=world_size,
            local_rank=local_rank or 0,
            token=token,
            connect_timeout_s=connect_timeout_s,
            reconnect_grace_s=0.0 if boot.mode == embedded.EMBEDDED else reconnect_grace_s,
        )
    except _accord.Error as e:
        raise _with_socket_hint(e, choice, boot.socket_path) from None
    _announce(rank, boot, choice)
    return client
