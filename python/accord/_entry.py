"""Console scripts (pyproject.toml [project.scripts]): each execs the program
of the same name shipped inside the package (accord/bin), so that
`accord-coordinator`, `accord-sidecar`, `accord-relay` and `accordctl` are on
PATH after `pip install`."""

from __future__ import annotations

import os
import sys


def _exec(name: str):
    # Imported late: `accord` loads the extension, which a bare `--help` of a
    # daemon does not need, but daemon_path lives there.
    from accord.cluster import daemon_path

    try:
        # Not PATH: this script is on PATH under the same name.
        path = daemon_path(name, use_path=False)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        sys.exit(127)
    os.execv(path, [path] + sys.argv[1:])


def coordinator():
    _exec("accord-coordinator")


def sidecar():
    _exec("accord-sidecar")


def relay():
    _exec("accord-relay")


def accordctl():
    _exec("accordctl")
