"""accord: agreement on gradient reduce-scatter layout and dtype across ranks.

Compiled core (accord._accord): dtypes and the lossless lattice, Decide, the
client (connect / register / submit / wait), the CPU pack/unpack kernels and the
local cluster launcher. The PyTorch FSDP2 adapter is `accord.torch` (imported on
demand; it needs torch).
"""

from accord import _accord
from accord._accord import (  # noqa: F401
    Decision,
    Error,
    decide,
    dtype_size,
    is_lossless,
    join,
    layout_fingerprint,
    layout_row_numel,
    parse_dtype,
)
from accord.agreement import Agreement, ClientAgreement, as_agreement  # noqa: F401
from accord.errors import error_code, is_local_timeout  # noqa: F401

__version__ = "0.1.0"

HAVE_CLIENT = _accord.HAVE_CLIENT
HAVE_KERNELS = _accord.HAVE_KERNELS
HAVE_CLUSTER = _accord.HAVE_CLUSTER

if HAVE_CLIENT:
    from accord.client import Client, DecisionFuture, connect  # noqa: F401
if HAVE_KERNELS:
    from accord.kernels import pack_cpu, unpack_cpu  # noqa: F401
from accord.cluster import LocalCluster, daemon_path  # noqa: F401,E402
