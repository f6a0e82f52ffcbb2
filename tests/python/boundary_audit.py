"""Fails, at run time, any access to an FSDP2 private object's attribute from
accord code outside the FSDP2 boundary (accord/torch/fsdp2/).

install() wraps attribute lookup on FSDP2's private classes (FSDPParamGroup,
FSDPParam, FSDPState; not FSDPModule, whose subclasses are the user's module
classes, which torch.compile traces and scripts/structure covers): a lookup
whose calling frame is in the accord package but not in the boundary raises
BoundaryViolation (a BaseException, so no `except Exception` hides it).
ACCORD_TEST_BOUNDARY_AUDIT=1 turns it on in every test process
(tests/python/CMakeLists.txt); scripts/structure checks the same statically.
"""

import os
import sys


class BoundaryViolation(BaseException):
    pass


_STATE = {"installed": False}


def install() -> None:
    if _STATE["installed"]:
        return
    import accord
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    root = os.path.dirname(os.path.abspath(accord.__file__)) + os.sep
    boundary = os.path.join(root, "torch", "fsdp2") + os.sep

    def check(owner, name):
        caller = sys._getframe(2).f_code.co_filename
        if caller.startswith(root) and not caller.startswith(boundary):
            raise BoundaryViolation(
                f"{caller} reads {owner}.{name}: FSDP2's private names belong in "
                f"accord/torch/fsdp2/ only")

    for cls in (FSDPParamGroup, FSDPParam, FSDPState):
        original = cls.__getattribute__

        def audited(self, name, _original=original, _owner=cls.__name__):
            if not name.startswith("__"):
                check(_owner, name)
            return _original(self, name)

        cls.__getattribute__ = audited

    _STATE["installed"] = True


def install_if_asked() -> None:
    if os.environ.get("ACCORD_TEST_BOUNDARY_AUDIT") == "1":
        install()
