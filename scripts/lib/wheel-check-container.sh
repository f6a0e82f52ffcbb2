#!/usr/bin/env bash
# Runs inside the bare container of scripts/wheel-check (Debian 12 with only
# python3, python3-venv and torch in /opt/venv): installs the accord wheel from
# /dist and runs the checks, one "wheel-check: PASS|FAIL name: detail" line
# each. /check holds examples/torchrun_text_only_rank.py. Always exits 0; the
# caller counts the FAIL lines.
set -uo pipefail
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
result() { echo "wheel-check: $1 $2: $3"; }
site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# 1. The machine: no gRPC, protobuf, abseil, gloo, civetweb package, dev or
#    runtime, and no such library anywhere the loader looks.
pkgs=$(dpkg-query -W -f='${Package}\n' | grep -E 'grpc|protobuf|absl|gloo|civetweb' || true)
sys_libs=$(ldconfig -p | grep -E 'libgrpc|libprotobuf|libabsl|libgloo|libcivetweb|libcares|libre2' || true)
if [[ -z $pkgs && -z $sys_libs ]]; then
  result PASS "bare machine" "$(dpkg-query -W | wc -l) Debian packages, none of grpc/protobuf/absl/gloo/civetweb; ldconfig knows no such library; $(python3 --version), pip $(pip --version | cut -d' ' -f2), torch $(python -c 'import torch; print(torch.__version__)' 2>/dev/null)"
else
  result FAIL "bare machine" "found packages [$pkgs] libraries [$sys_libs]"
fi

# 2. The control: the wheel as `pip wheel` made it, before auditwheel
#    repair, installs (linux_x86_64) but cannot load its extension here.
python -m venv --system-site-packages /tmp/control
raw=$(ls /dist-raw/accord-*.whl 2>/dev/null || echo "(none: run scripts/wheel-check without --no-build)")
/tmp/control/bin/pip install -q --no-index --no-cache-dir "$raw" >/dev/null 2>&1
out=$(/tmp/control/bin/python -c 'import accord; print(accord.HAVE_CLIENT)' 2>&1)
missing=$(grep -o 'lib[a-z_+0-9]*\.so[.0-9]*: cannot open shared object file' <<<"$out" | head -1)
if [[ -n $missing ]]; then
  result PASS "control" "the unrepaired $(basename "$raw") fails to import here: $missing"
else
  result FAIL "control" "the unrepaired wheel imported, or failed otherwise: ${out: -300}"
fi
rm -rf /tmp/control

# 3. Install.
wheel=$(ls /dist/accord-*.whl)
if out=$(pip install --no-index --no-cache-dir "$wheel" 2>&1); then
  result PASS "pip install" "$(basename "$wheel") installed into $site ($(du -sh "$site/accord" "$site/accord.libs" | awk '{print $1}' | paste -sd+) on disk)"
else
  result FAIL "pip install" "${out: -400}"
  exit 0
fi

# 4. Every ELF file of the package resolves its libraries: bundled ones from
#    accord.libs, the rest from the system (glibc, libstdc++, libgcc_s, libz:
#    the manylinux policy's libraries).
unresolved="" outside=""
for f in "$site"/accord/_accord*.so "$site"/accord/bin/*; do
  l=$(ldd "$f" 2>&1)
  unresolved+=$(grep 'not found' <<<"$l" | sed "s|^|$(basename "$f"): |")
  # ldd prints the path through $ORIGIN: .../accord/bin/../../accord.libs/...
  outside+=$(grep '=> /' <<<"$l" | grep -v '/accord\.libs/' | awk '{print $1}')$'\n'
done
system=$(sort -u <<<"$outside" | grep . | paste -sd' ')
policy='^(libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|libz|ld-linux-x86-64)\.so'
other=$(sort -u <<<"$outside" | grep . | grep -Ev "$policy" || true)
[[ -z $other ]] || unresolved+="from the system but not manylinux policy libraries: $other"
if [[ -z $unresolved ]]; then
  result PASS "shared libraries" "extension and 4 programs resolve every library; from the system only: $system"
else
  result FAIL "shared libraries" "$unresolved"
fi

# 5. Console scripts and doctor.
ok=1 detail=""
for p in accord-coordinator accord-sidecar accord-relay accordctl; do
  v=$("$p" --version 2>&1 | head -1)
  [[ $v == "$p" ]] || { ok=0; detail+="$p --version: ${v:0:200}; "; }
done
[[ $ok == 1 ]] && result PASS "console scripts" "accord-coordinator, accord-sidecar, accord-relay, accordctl on PATH and run" \
               || result FAIL "console scripts" "$detail"
if out=$(python -m accord doctor 2>&1) && grep -q '^doctor: OK' <<<"$out"; then
  result PASS "doctor" "$(grep -m1 'would use' <<<"$out")"
else
  result FAIL "doctor" "${out: -600}"
fi

# 6. The example under torchrun, embedded mode, nothing set: one agent with 2
#    ranks, then two agents (one rank each) on loopback with c10d rendezvous.
cd "$(mktemp -d)"
t=$(date +%s)
out=$(timeout 300 torchrun --standalone --nproc-per-node=2 /check/torchrun_text_only_rank.py 2>&1)
rc=$?
passed=$(grep '^PASSED: ' <<<"$out")
if [[ $rc == 0 && -n $passed ]] && grep -q '^accord: embedded mode' <<<"$out"; then
  result PASS "torchrun 2 ranks" "$(( $(date +%s) - t )) s, embedded mode: $passed"
else
  result FAIL "torchrun 2 ranks" "exit $rc: $(grep -v -e leaked -e '^ - ' <<<"$out" | tail -30)"
fi
t=$(date +%s)
args=(--nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29517)
timeout 300 torchrun "${args[@]}" /check/torchrun_text_only_rank.py >agent0.log 2>&1 &
a0=$!
timeout 300 torchrun "${args[@]}" /check/torchrun_text_only_rank.py >agent1.log 2>&1
rc1=$?
wait $a0
rc0=$?
passed=$(cat agent0.log agent1.log | grep '^PASSED: ')
if [[ $rc0 == 0 && $rc1 == 0 && -n $passed ]]; then
  result PASS "torchrun 2 agents" "$(( $(date +%s) - t )) s, 2 nodes on loopback, embedded mode: $passed"
else
  result FAIL "torchrun 2 agents" "exit $rc0/$rc1: $(cat agent0.log agent1.log | grep -v -e leaked -e '^ - ' | tail -30)"
fi

# 7. Nothing left behind: no daemon, no socket or temp dir. A rank's daemons
#    die by their death signal and its temp dir goes with its reaper, both
#    asynchronously: poll, bounded (15 s). minbase has no ps: read /proc.
leftovers() {
  local p
  procs="" left=$(ls -d /tmp/accord-* 2>/dev/null || true)
  for p in /proc/[0-9]*; do
    [[ $(tr '\0' ' ' <"$p/cmdline" 2>/dev/null) == *accord/bin/accord-* ]] && procs+="${p#/proc/} "
  done
  [[ -z $procs && -z $left ]]
}
for _ in $(seq 150); do leftovers && break; sleep 0.1; done
leftovers && result PASS "cleanup" "no accord daemon and no /tmp/accord-* left after the jobs" \
          || result FAIL "cleanup" "processes [$procs] files [$left]"
