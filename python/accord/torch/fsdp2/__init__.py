"""The one boundary between accord.torch and FSDP2's private names.

Every name of FSDP2 that is not public API (torch 2.9 through 2.13) is read or
written in this package and nowhere else in accord, so a torch release that
renames one breaks here, loudly: `probe()` runs at `install` and refuses a
torch whose FSDP2 lacks any of them, naming each. Other modules hold FSDP2's
objects (units, states, groups, parameters) only as opaque handles and act on
them through the functions below; scripts/structure and
tests/python/test_boundary.py check that. What each name means is described
in docs/PARTICIPATION.md ("The FSDP2 boundary").

Nothing is patched process-wide except FSDP2's all-gather entry point (for
the collective-sequence guard), and that patch is reference-counted: the
last `uninstall()` restores FSDP2's own function. Every per-object hook has
one function that installs it and one that removes it.

    probe   the torch version and the private names, checked at install
    state   units, states and groups: reading them, accord's hooks on them
    grads   parameters and gradients: the reduce path accord drives
"""

from accord.torch.fsdp2.grads import (  # noqa: F401
    all_gather_dtype,
    drop_local_grads,
    group_params,
    has_post_accumulate_grad_hooks,
    hold,
    local_grads,
    param_shape,
    reduce_scatter,
    reduce_scatter_as_held,
    sharded_grads_none,
    sharded_param,
    take_grad,
    trainable,
    was_unsharded,
    was_unsharded_group,
    widest_grad_dtype,
    without_reduce,
)
from accord.torch.fsdp2.probe import (  # noqa: F401
    SUPPORTED_TORCH,
    UnsupportedTorchError,
    _import,
    check_torch_version,
    probe,
    torch_version,
)
from accord.torch.fsdp2.state import (  # noqa: F401
    all_gather_owner,
    all_reduce_enabled,
    all_reduces,
    check_set_requires_all_reduce,
    data_parallel_ranks,
    has_run_forward,
    hook_group,
    hooked_by,
    in_backward,
    in_forward,
    in_step,
    is_fsdp_module,
    is_last_backward,
    override_reshard,
    param_groups,
    patch_all_gather,
    reduce_dtype,
    reduces,
    reshard,
    restore_reshard,
    route_all_gathers,
    state_of,
    training_state,
    unhook_group,
    unroute_all_gathers,
    unpatch_all_gather,
    unwrap_final_callback,
    wrap_final_callback,
)
from accord.torch.fsdp2.pipelining import (  # noqa: F401
    patch_stages,
    route_stage,
    unpatch_stages,
    unroute_stage,
)
