"""`python -m accord doctor`: what is installed, which mode accord.connect()
would choose and why, and whether a deployed sidecar answers. Starts nothing.
Exit status 1 when something accord.connect() would need is missing."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from typing import Tuple

PROGRAMS = ("accord-coordinator", "accord-sidecar", "accord-relay", "accordctl")


def _torch_report() -> dict:
    try:
        import torch
    except ImportError:
        return {"version": None, "accord.torch": "torch is not installed (pip install torch)"}
    out = {"version": torch.__version__}
    try:
        import accord.torch as accord_torch
    except Exception as e:  # noqa: BLE001 - any import failure is reported, not raised
        out["accord.torch"] = f"cannot import accord.torch: {type(e).__name__}: {e}"
        return out
    check = getattr(accord_torch, "check_torch_version", None)
    if check is None:
        out["accord.torch"] = "imported (this version has no check_torch_version)"
        return out
    try:
        check()
        out["accord.torch"] = "supports this torch"
    except Exception as e:  # noqa: BLE001 - UnsupportedTorchError, whatever its module
        out["accord.torch"] = f"unsupported: {e}"
        return out
    # FSDP2's private names, probed where this version keeps the probe.
    try:
        from accord.torch import fsdp2  # type: ignore[attr-defined]

        fsdp2.probe()
        out["fsdp2"] = "the private FSDP2 names accord uses are present"
    except (ImportError, AttributeError):
        pass
    except Exception as e:  # noqa: BLE001
        out["fsdp2"] = f"probe failed: {e}"
    return out


def _connect_report(programs: dict) -> Tuple[dict, bool]:
    """What accord.connect() with nothing passed would do here, and whether
    it can."""
    from accord import embedded

    ok = True
    choice = embedded.choose_mode()
    mode = {"mode": choice.mode, "why": choice.reason}
    if choice.socket_path:
        answers, why = embedded.probe_socket(choice.socket_path)
        mode["socket"] = choice.socket_path
        mode["socket answers"] = answers
        if not answers:
            mode["socket problem"] = why
            ok = False
    if choice.mode == embedded.EMBEDDED:
        missing = [n for n in ("accord-coordinator", "accord-sidecar") if not programs[n]["bundled"]
                   and not programs[n]["on PATH"]]
        mode["needs"] = ["torch.distributed initialized before accord.connect()",
                         "RANK, WORLD_SIZE and LOCAL_RANK (torchrun sets them)"]
        if missing:
            mode["missing"] = missing
            ok = False
    mode["environment"] = {k: os.environ[k] for k in (
        "ACCORD_SOCKET", "ACCORD_JOB_ID", "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE",
        "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE") if k in os.environ}
    job = os.environ.get("ACCORD_JOB_ID") or (
        os.environ.get("TORCHELASTIC_RUN_ID")
        if os.environ.get("TORCHELASTIC_RUN_ID", "none") != "none" else None)
    mode["job id"] = job or "drawn by rank 0 and shared through the torch.distributed store"
    return mode, ok


def _print_report(report: dict, ok: bool) -> None:
    a, mode = report["accord"], report["connect()"]
    print(f"accord {a['version']} at {a['location']} (Python {report['python']}, "
          f"{report['platform']})")
    print(f"  extension: HAVE_CLIENT={a['HAVE_CLIENT']} HAVE_KERNELS={a['HAVE_KERNELS']} "
          f"HAVE_CLUSTER={a['HAVE_CLUSTER']}")
    print("programs:")
    for name, p in report["programs"].items():
        print(f"  {name:<20} bundled: {p['bundled'] or 'not found'}; on PATH: "
              f"{p['on PATH'] or 'no'}")
    t = report["torch"]
    print(f"torch: {t['version'] or 'not installed'}; accord.torch: {t['accord.torch']}")
    if "fsdp2" in t:
        print(f"  FSDP2: {t['fsdp2']}")
    print(f"accord.connect() with nothing passed would use: {mode['mode']}")
    print(f"  why: {mode['why']}")
    if "socket" in mode:
        print(f"  socket {mode['socket']}: "
              f"{'answers' if mode['socket answers'] else mode['socket problem']}")
    for need in mode.get("needs", []):
        print(f"  needs: {need}")
    if mode.get("missing"):
        print(f"  MISSING: {', '.join(mode['missing'])}")
    print(f"  job id: {mode['job id']}")
    if mode["environment"]:
        print("  environment: " + " ".join(f"{k}={v}" for k, v in mode["environment"].items()))
    d = report["deployed sidecar"]
    print(f"deployed sidecar on {d['socket']}: {'answers' if d['answers'] else d['detail']}")
    print("doctor: OK" if ok else "doctor: PROBLEMS above")


def doctor(as_json: bool = False) -> int:
    report: dict = {"python": sys.version.split()[0], "platform": platform.platform()}
    try:
        import accord
        from accord import embedded
        from accord.cluster import daemon_path
    except ImportError as e:
        print(f"accord: cannot import the package or its extension: {e}", file=sys.stderr)
        return 1
    report["accord"] = {
        "version": accord.__version__,
        "location": os.path.dirname(os.path.abspath(accord.__file__)),
        "HAVE_CLIENT": accord.HAVE_CLIENT,
        "HAVE_KERNELS": accord.HAVE_KERNELS,
        "HAVE_CLUSTER": accord.HAVE_CLUSTER,
    }
    programs = {}
    for name in PROGRAMS:
        try:
            bundled = daemon_path(name, use_path=False)
        except FileNotFoundError:
            bundled = None
        programs[name] = {"bundled": bundled, "on PATH": shutil.which(name)}
    report["programs"] = programs
    report["torch"] = _torch_report()
    report["connect()"], ok = _connect_report(programs)
    answers, why = embedded.probe_socket(embedded.DEFAULT_SOCKET)
    report["deployed sidecar"] = {"socket": embedded.DEFAULT_SOCKET, "answers": answers,
                                  "detail": why}
    ok = ok and accord.HAVE_CLIENT
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report, ok)
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m accord")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="report the installation and what accord.connect() would do")
    d.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return doctor(as_json=args.json)
    return 2


if __name__ == "__main__":
    sys.exit(main())
