"""The FSDP2 parameter groups of an installed model, each with its member
set (the ranks of its mesh, docs/MEMBERS.md 3.1) and its group id."""

from __future__ import annotations

from typing import Dict

import torch

from accord.torch import fsdp2, members
from accord.torch.group import HookedGroup


def job_members(group, agreement):
    """The member set of an FSDP parameter group: its mesh's ranks, when
    the accord job is torch.distributed's world (ranks and world size
    equal); None (every rank of the accord job) otherwise, e.g. one accord
    job per pipeline stage (docs/MEMBERS.md, 3.1)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size() != agreement.world_size or dist.get_rank() != agreement.rank:
        return None
    return members.canonical(fsdp2.data_parallel_ranks(group), agreement.world_size)


def find_groups(model, agreement) -> list:
    """(path id, group, parameter names, members) of every FSDP parameter
    group of `model`, in module order; the path id is `<module path>` or
    `<module path>#i`. Raises ValueError when a group is hooked by another
    installation or there is none."""
    param_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    found = []
    for module_name, module in model.named_modules():
        if not fsdp2.is_fsdp_module(module):
            continue
        groups = fsdp2.param_groups(module)
        for gi, group in enumerate(groups):
            if any(g is group for _, g, _, _ in found):
                continue  # fully_shard([a, b]): one state, listed under each member module
            if fsdp2.hooked_by(group) is not None:
                raise ValueError(f"accord.torch.install: FSDP group of "
                                 f"'{module_name or '<root>'}' is already hooked by another "
                                 f"installation")
            base = module_name or "<root>"
            names = []
            for j, fp in enumerate(fsdp2.group_params(group)):
                n = param_names.get(id(fsdp2.sharded_param(fp)))
                names.append(n if n is not None else f"{module_name}.param{j}")
            found.append((base if len(groups) == 1 else f"{base}#{gi}", group, names,
                          job_members(group, agreement)))
    if not found:
        raise ValueError("accord.torch.install: the model has no FSDP2 parameter groups; call "
                         "fully_shard(...) on it (and its submodules) first")
    return found


def hook_groups(installation, found: list, prefix: str) -> Dict[str, HookedGroup]:
    """A HookedGroup for each of find_groups()'s, by group id
    `<prefix>/<path id><member tag>` (install order: module order)."""
    out = {}
    for path, group, names, mine in found:
        gid = f"{prefix}/{path}{members.tag(mine)}"
        out[gid] = HookedGroup(installation, group, gid, names, path, mine)
    return out
