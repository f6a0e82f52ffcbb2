#!/usr/bin/env bash
# Regenerates the hand-written seeds of the fuzz corpora from text protos.
# Findings from fuzzing runs are added to the same folders by scripts/fuzz.
set -euo pipefail
cd "$(dirname "$0")"
P=../../proto
enc() { # selector world type text out
  { printf "\\x$(printf %02x "$1")\\x$(printf %02x "$2")"; printf '%s' "$4" | protoc -I$P --encode=accord.v1.$3 accord/v1/accord.proto; } > "$5"
}
enc 1 4 RankMessage 'registration { group_id: "g" params { name: "w" dim0: 8 numel: 64 } params { name: "b" dim0: 8 numel: 8 } policy { reduce_dtype: FLOAT32 } }' corpus/wire_decode/rank_registration
enc 5 4 RankMessage 'manifests { manifests { group_id: "g" step: 3 used_bits: "\x01" uniform_dtype: BFLOAT16 } }' corpus/wire_decode/rank_manifest_uniform
enc 5 4 RankMessage 'manifests { manifests { group_id: "g" step: 3 used_bits: "\x03" dtype_masks: "\x10\x20" } }' corpus/wire_decode/rank_manifest_masks
enc 5 4 RankMessage 'manifests { manifests { group_id: "g" step: 4 repeat: true cache_key: 12345 } }' corpus/wire_decode/rank_manifest_repeat
enc 5 4 RankMessage 'hello { job_id: "j" rank: 1 world_size: 4 }' corpus/wire_decode/rank_hello
enc 4 4 NodeMessage 'manifests { manifests { group_id: "g" step: 3 used_bits: "\x01" uniform_dtype: FLOAT32 rank_bits: "\x0f" } }' corpus/wire_decode/node_manifest
enc 4 4 NodeMessage 'registration { registration { group_id: "g" params { name: "w" dim0: 3 numel: 12 } } ranks: 0 ranks: 1 }' corpus/wire_decode/node_registration
enc 1 8 RankMessage 'registration { group_id: "g@ranks1..5/4" params { name: "w" dim0: 8 numel: 64 } members { start: 1 count: 2 stride: 4 } }' corpus/wire_decode/rank_registration_members_arithmetic
enc 4 8 NodeMessage 'registration { registration { group_id: "g@m" params { name: "w" dim0: 3 numel: 12 } members { ranks: 0 ranks: 1 ranks: 5 } } ranks: 0 ranks: 1 }' corpus/wire_decode/node_registration_members_list
enc 1 8 RankMessage 'registration { group_id: "g" params { name: "w" dim0: 8 numel: 64 } members { ranks: 0 ranks: 2 ranks: 4 } }' corpus/wire_decode/rank_registration_members_not_canonical
enc 4 9 NodeMessage 'manifests { manifests { group_id: "g" step: 1 used_bits: "\x01\x00" uniform_dtype: INT32 rank_bits: "\xff\x01" } }' corpus/wire_decode/node_manifest_int
printf '\x04\x03\x08\x04\x02\x01\x00\x85\x07\x10\x10\x20\x00\x10\x10\x00\x00\x00\x33\x02' > corpus/merge_decide/mixed
printf '\x08\x01\x02\x00\x05' > corpus/merge_decide/single
printf '\x02\x02\x03\x03\x01\x01\xe4\x00\x02\x04\x04\x02\x99\x01' > corpus/merge_decide/fp8
# rank_stream: scripts of sidecar events (see rank_stream_fuzz.cc for the format).
python3 - <<'PY'
open('corpus/rank_stream/two_ranks_steps', 'wb').write(bytes([1, 3,
  0x00, 0x10, 0x02, 0x00, 0x00, 0x12, 0x00, 0x01,
  0x02, 0x01, 0x00, 0x02, 0x12, 0x01, 0x00, 0x02, 0x06, 0x00, 0x00, 0x05,
  0x02, 0x02, 0x00, 0x00, 0x00, 0x00, 0x01, 0x12, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00,
  0x06, 0x02, 0x00, 0x00, 0x00, 0x00, 0x03,
  0x02, 0x02, 0x00, 0x00, 0x01, 0x01, 0x07, 0x00, 0x12, 0x02, 0x00, 0x00, 0x01, 0x00, 0x00,
  0x07, 0x06, 0x02, 0x00, 0x00, 0x00, 0x01, 0x00, 0x01, 0x11]))
open('corpus/rank_stream/refusals', 'wb').write(bytes([3, 1,
  0x00, 0x10, 0x20, 0x02, 0x00, 0x00, 0x12, 0x00, 0x00, 0x22, 0x40, 0x01,
  0x02, 0x01, 0x01, 0x02, 0x03, 0x06, 0x01, 0x00, 0x10,
  0x02, 0x02, 0x01, 0x01, 0x05, 0x02, 0x01, 0x02, 0x03, 0x01, 0x11, 0x21]))
PY
