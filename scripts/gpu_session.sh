#!/usr/bin/env bash
# One device call's worth of GPU checks (the lead's batched H200 run). Usage on the GPU machine:
#   scripts/gpu_session.sh tests   # every gpu-marked test + verify on CUDA  -> $OUT/gpu_tests.log
#   scripts/gpu_session.sh bench   # decode variants, host cost, mixed steps -> $OUT/*.json, *.md
#   scripts/gpu_session.sh all     # both, with shorter limits (fits one 10-minute device call)
#   scripts/gpu_session.sh next    # the fourth session's open checks, most important first
#                                  # (-v: a time cap still leaves which tests passed/failed)
#   scripts/gpu_session.sh fifth   # multi-step graphs, CUDA verify + fp8 (full tracebacks),
#                                  # cascade sweep + mixed steps, prefill rows, ncu evidence
#   scripts/gpu_session.sh sixth   # the whole gpu suite (-v, per-test timeout with stacks),
#                                  # per-kernel time split (profile_kernels.py), cascade rows,
#                                  # small-batch decode launch variants
#   scripts/gpu_session.sh seventh # fp8 write bytes (full message), cascade + mixed rows,
#                                  # then the whole gpu suite (-v) in what is left
#   scripts/gpu_session.sh eighth  # the seventh call's failures, with their reasons
#   scripts/gpu_session.sh ninth   # a 90-second check of the KV-write fixes (logs in $OUT)
#   scripts/gpu_session.sh eleventh # the pending gpu tests (-n 6), then the mixed rows with
#                                  # each kind of step's median time and the graph replays
#   scripts/gpu_session.sh twelfth # the mixed rows again, then the whole gpu suite (-n 8, -v,
#                                  # failures to $OUT/failures.log as they happen)
#   scripts/gpu_session.sh thirteenth # the 3 gpu tests the twelfth call left (the warp-
#                                  # specialised dense prefill configurations, extend bf16),
#                                  # one at a time with durations (logs in $OUT), then
#                                  # small-batch decode launch variants (chunked lookup) and
#                                  # the MLA launch sweep
#   scripts/gpu_session.sh fourteenth # PDL and dense-prefill gpu tests, decode variants (PDL
#                                  # on/off, chunked lookup, longer splits), the prefill
#                                  # sweep, the MLA sweep replayed, decode + fp8 tables
#   scripts/gpu_session.sh fifteenth # PDL modes, new prefill/decode defaults (gpu tests),
#                                  # decode page-lookup variants, prefill and MLA sweeps
#   scripts/gpu_session.sh sixteenth # the new defaults (dense prefill 64x64, MLA 16 heads,
#                                  # 1x4k lookup): gpu tests, decode/MLA/fp8 and prefill tables
#   scripts/gpu_session.sh seventeenth # the new defaults under capture: graph replays,
#                                  # CUDA verify (Triton), engine graphs, cascade
#   scripts/gpu_session.sh eighteenth # next: the rows still short of #14's targets:
#                                  # prefill 1x16k / 8x2k configurations replayed, the MLA
#                                  # 16-head split counts, the whole gpu suite
#   scripts/gpu_session.sh nineteenth # lazy rescaling of the dense prefill: gpu tests, every
#                                  # prefill row with the lazy configurations replayed, then
#                                  # ncu source-level stall sampling of the fused reduction
#   scripts/gpu_session.sh twentieth # the Gluon dense prefill: gpu tests (-x, tracebacks),
#                                  # then every prefill row against the Triton default, replayed
#   scripts/gpu_session.sh twentyfirst # the Gluon default: the whole gpu suite (-n 8,
#                                  # failures to $OUT/failures.log), then the prefill rows
#   scripts/gpu_session.sh twentythird # the prefill gpu tests (warp-specialised Gluon incl.),
#                                  # then the Gluon / warp-specialised sweep rows
#   scripts/gpu_session.sh twentyfourth # prefill gpu tests, the sweep with the default
#                                  # (warp-specialised) rows, bench_attention prefill rows,
#                                  # dense extend rows
#   scripts/gpu_session.sh twentyfifth # prefill gpu tests, bench_attention prefill rows
#                                  # (with ours-dense), sweep rows against the plain forms
#   scripts/gpu_session.sh twentysixth # MLA gpu tests (the Gluon kernel), bench_attention MLA
#   scripts/gpu_session.sh twentyeighth  # gpu tests of the launch options (value pairs,
#                                  # page-id prefetch, carried page lookup) and their kernels
#   scripts/gpu_session.sh thirtyfirst   # the gpu test files pending since the window change
#   scripts/gpu_session.sh twentyninth   # their timings: decode variants (planned, graph),
#                                  # fp8 rows byte reads against value pairs (+ options)
#   scripts/gpu_session.sh thirtieth     # MLA rows (fp8 value pairs), paged prefill rows
#                                  # with the carried page lookup
#   scripts/gpu_session.sh thirtysecond  # the decode fix and fp8 pairs default: paged gpu
#                                  # tests, decode/fp8 table vs cuDNN, decode without splits
#   scripts/gpu_session.sh thirtythird   # one-wave decode on the carried lookup: tests, table
#   scripts/gpu_session.sh thirtyfourth  # the gpu test files the other calls did not run
#   scripts/gpu_session.sh thirtyfifth   # 1x32k at 168 registers: split counts (1x32k, 16x4k,
#                                  # 1x4k), MLA 16-head tiles for three programs per SM, ncu
#   scripts/gpu_session.sh thirtysixth   # the carried lookup on split launches at 166/111
#                                  # registers (64-/32-key tiles), 2-4 programs per SM
#   scripts/gpu_session.sh thirtyseventh # decode on NHD and HND cache storage, pages 16/64
#   scripts/gpu_session.sh thirtyeighth  # the carried lookup's page ids in one load per tile
#   scripts/gpu_session.sh thirtyninth   # 64-key carried lookup: unsplit page 16, split page 64
#   scripts/gpu_session.sh fortieth      # slot-index K/V addressing (FLAT_SLOTS)
#   scripts/gpu_session.sh fortyfirst    # slot addressing by default: gpu tests, decode table
#   scripts/gpu_session.sh fortysecond   # query-head chunks at small batch, ncu of the default
#   scripts/gpu_session.sh fortythird    # fp8 ratio on the new bf16 default, gpu test files
#   scripts/gpu_session.sh fortyfourth   # small-batch split shapes on slot addressing
#   scripts/gpu_session.sh fortyfifth    # 2- and 1-warp programs, more of them per SM
#   scripts/gpu_session.sh fortysixth    # the Gluon decode kernel: gpu tests, tile shapes
#                                  # against the Triton default and cuDNN
#   scripts/gpu_session.sh fortyseventh  # its first page ids without the key count, 128-key
#                                  # tiles, two programs per SM (hung at the first row: no
#                                  # output; fortyeighth runs each variant on its own)
#   scripts/gpu_session.sh fortyeighth   # each variant of fortyseventh alone, under a cap
#   scripts/gpu_session.sh fortyninth    # the Gluon decode as the library's default on sm_90:
#                                  # gpu tests, the decode table against cuDNN, variants
#   scripts/gpu_session.sh suite K N     # part K of N of the whole gpu suite (files balanced
#                                  # by test count; junit in $OUT/suite_K.xml): 2 parts fit
#                                  # two 10-minute calls (the whole ran ~760 s at -n 8)
#   scripts/gpu_session.sh fiftieth      # the whole gpu suite on the Gluon decode default
#   scripts/gpu_session.sh fiftyfirst    # the files of its 3 failures (Triton-kernel tests
#                                  # now pin gluon_decode off) and the other spying files
#   scripts/gpu_session.sh fiftysecond   # the Gluon decode's layer launch on cached keys
#                                  # (direct launches): its gpu tests, the decode table
#   scripts/gpu_session.sh fiftythird    # the narrow Gluon MLA kernel: the MLA gpu tests,
#                                  # then the MLA table
#   scripts/gpu_session.sh fiftyfourth   # the MLA split merge in the attention launch: its
#                                  # gpu tests, then 16-head rows with the launch variants
#   scripts/gpu_session.sh fiftyfifth    # MLA gpu tests (one query per request), then where
#                                  # a 16-head step's time goes (mla_time_split.py)
#   scripts/gpu_session.sh fiftysixth    # the MLA L2 prefetch (removed after this call; the
#                                  # case runs on 9f2df7e): 16-head rows, time split
#   scripts/gpu_session.sh fiftyseventh  # 16-head MLA rings deeper than two tiles a program
#                                  # (one program per SM), then ncu of both 16-head kernels
#   scripts/gpu_session.sh fiftyeighth   # the narrow MLA kernel's three-slot ring (rope rows
#                                  # in registers): its gpu tests, then the 16-head rows
#   scripts/gpu_session.sh fiftyninth    # the ring Gluon MLA kernel (32-key tiles, q in
#                                  # registers): its gpu tests, then the 16-head rows
#   scripts/gpu_session.sh sixtieth      # ncu of the ring kernel (stall reasons by source)
#   scripts/gpu_session.sh sixtyfirst    # the narrow kernel merging its own splits, one
#                                  # query per request: gpu tests, then the 16-head rows
#   scripts/gpu_session.sh sixtysecond   # the final code: every MLA gpu test (-k mla), then
#                                  # the MLA table with the 16-head variants
#   scripts/gpu_session.sh sixtythird    # every MLA gpu test again (the replay test's lengths
#                                  # fixed), failures with their reasons
#   scripts/gpu_session.sh sixtyfourth   # the fused-merge and narrow gpu tests on the final code
#   scripts/gpu_session.sh sixtyfifth    # the cooperative merge: its gpu tests, the 16-head rows
#                                  # beside the default, the time split
#   scripts/gpu_session.sh seventyseventh # the balanced launch's first segment outside the
#                                  # while loop: tests, time split, rows, PDL
#   scripts/gpu_session.sh seventysixth  # the balanced merge of many parts: tests, rows
#   scripts/gpu_session.sh seventyfifth  # the balanced launch aligned + PDL: tests, time split
#   scripts/gpu_session.sh seventyeighth # the narrow MLA kernel issuing its first tiles before
#                                  # q, its merge by PDL: gpu tests, A/B against OLD (a
#                                  # snapshot of the previous kernel), time split
#   scripts/gpu_session.sh seventyninth  # every MLA gpu test with the narrow kernel the default
#   scripts/gpu_session.sh eightieth     # the Triton-option gpu tests on the Triton kernel
#                                  # (narrow the default), the graph replays; on an H200
#                                  # the 16-head rows: default, Triton, OLD's narrow
#   scripts/gpu_session.sh eightyfourth  # the narrow kernel's per-program timeline (stamps):
#                                  # its gpu tests, narrow_timeline.py, the 16-head rows of
#                                  # the default and the fused merge twice, time splits,
#                                  # host µs of an MLA layer call (planned keys or not)
#   scripts/gpu_session.sh ninetyfirst   # one request a program: stream beside narrow
#   scripts/gpu_session.sh ninetieth     # Nsight Compute of the narrow and stream kernels
#                                  # at 64x4k (stalls by SASS line, memory tables)
#   scripts/gpu_session.sh eightyninth   # the spill-free stream kernel: gpu tests, step by
#                                  # program count and beside the default, 16-head rows
#                                  # (equal shares, and weighed by narrow / own SM rates)
#   scripts/gpu_session.sh eightyeighth  # the stream kernel without its spills: gpu tests,
#                                  # probe beside the default, 16-head rows
#   scripts/gpu_session.sh eightyseventh # the stream kernel's step by program count
#                                  # (stream_probe.py: stamps per slot), its gpu tests
#   scripts/gpu_session.sh eightysixth   # the stream kernel (mla_stream_gluon): its gpu tests
#                                  # and the SM claims', then the 16-head rows of the
#                                  # default, stream and stream-sm
#   scripts/gpu_session.sh eightyfifth   # the 64x4k step by SM (narrow_timeline --programs,
#                                  # --by-sm) on this card; the balanced launch weighed by
#                                  # the SMs' rates (gpu tests, rows beside the default)
#   scripts/gpu_session.sh eightythird   # MLA gpu tests, then the 16-head rows of OLD, MID
#                                  # (snapshot dirs) and this tree, alternating
#   scripts/gpu_session.sh seventyfourth # the balanced launch, merge unrolled: gpu tests, time
#                                  # split of its two launches, rows
#   scripts/gpu_session.sh seventythird  # the balanced MLA launch: gpu tests (also as the
#                                  # default), 16-head rows twice, uniform and skewed batches
#   scripts/gpu_session.sh seventysecond # on an H200 seventyfirst first; the 64x4k wave's empty
#                                  # program slots (60/64/66 requests); fp16 clamp gpu tests
#   scripts/gpu_session.sh seventyfirst  # item 4 on the H200: the 16-head rows (16-bit
#                                  # partials by default) beside float32 partials and narrow,
#                                  # twice; the time split with the launch floor
#   scripts/gpu_session.sh sixtysixth    # the 16-head MLA options (descriptors, lazy rescale,
#                                  # 16-bit partials, two or four score chains): rows, time split
#   scripts/gpu_session.sh sixtyseventh  # their gpu tests; ncu of the default and the options
#   scripts/gpu_session.sh sixtyeighth   # the candidates at 128x8k and 64x2k
#                                  # (MLA_VARIANTS: a comma list), the rest at 64x4k
#   scripts/gpu_session.sh seventieth    # the ring Gluon kernel's operands by ldmatrix:
#                                  # tests, 64x4k row, ncu bank conflicts
#   scripts/gpu_session.sh sixtyninth    # every MLA gpu test with candidate defaults
#                                  # (MLA_DEFAULTS: a JSON object of the options)
#   scripts/gpu_session.sh twentyseventh # prefill gpu tests (windows in the warp-specialised
#                                  # kernel) and the engine graph tests, -n 4
#   scripts/gpu_session.sh twentysecond # Gluon gpu tests, Triton/Gluon/capped 128-row rows,
#                                  # dense extend rows, ncu of Gluon and cuDNN at 8x2k
#   scripts/gpu_session.sh tenth   # ninth, Triton verify tables (paged, 5-D, MLA) with each
#                                  # failure's reason, then the pending gpu tests (logs in $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# every failing test's reason lands here at once (tests/conftest.py), even if a cap kills
# pytest before its summary
export AITER_ATTN_FAIL_LOG="$OUT/failures.log"
T=330 V=120 B1=200 B2=200 B3=150
# gpu_tests LOG CAP_S PER_TEST_S FILE...: the files' gpu tests (-n 8) into $OUT/LOG, then its
# failures and summary
# one bench_gluon_decode.py variant alone under a cap (a hang costs only its cap)
gluon_variant() {
  timeout ${GV_S:-90} python3 benchmarks/bench_gluon_decode.py --out "$OUT/gd_$1" --rep 20 \
    --rows "$2" --variants "$1" > "$OUT/gd_$1.log" 2>&1
  echo "$1 rc=$?"; grep -E "^\| [0-9]" "$OUT/gd_$1.log"
}
gpu_tests() {
  local log=$1 cap=$2 per=$3
  shift 3
  timeout "$cap" python3 -m pytest -m gpu -q -n 8 --timeout "$per" "$@" -p no:cacheprovider \
    -p no:warnings --tb=short > "$OUT/$log" 2>&1
  grep -E "FAILED|ERROR| passed| failed" "$OUT/$log" | tail -15
}
mla16_rows() {  # mla16_rows NAME VARIANTS: the 16-head MLA rows (64x4k, 128x8k) -> $OUT/NAME
  timeout ${BB_S:-100} python3 benchmarks/bench_attention.py --only mla --rep 30 \
    --anchors "" --mla-kv bf16 --mla-rows 16x64x4096,16x128x8192 --out "$OUT/$1" \
    --mla-variants "$2" > "$OUT/$1.log" 2>&1
  grep -E "ours|rates|Error|error|ceilings" "$OUT/$1.log" | head -12
}
early_tests() {  # early_tests CAP FILE...: gpu tests without xdist (their race windows are timed)
  local cap=$1
  shift
  timeout "$cap" python3 -m pytest -m gpu -q "$@" -p no:cacheprovider --tb=short \
    > "$OUT/early_tests.log" 2>&1
  grep -E "FAILED|ERROR| passed| failed|Error|assert" "$OUT/early_tests.log" | tail -15
}
timelines() {  # timelines "ARGS" TUNING...: narrow_timeline.py of 64x4k under each tuning
  local args=$1
  shift
  for t in "$@"; do
    timeout ${NT_S:-60} python3 benchmarks/narrow_timeline.py --rows 16x64x4096 $args \
      --tuning "$t" 2>&1 | tee -a "$OUT/narrow_timeline.log" | tail -1
  done
}
if [ "${1:-tests}" = all ]; then T=200 V=50 B1=90 B2=110 B3=80; fi
case "${1:-tests}" in
  next)
    timeout 90 python3 -m pytest -q -m gpu tests/test_graph_gpu.py -k multi_step -x \
      -p no:cacheprovider --tb=short 2>&1 | tail -30 | tee "$OUT/next_multistep.log"
    timeout 150 python3 -m pytest -q -m gpu tests/test_conformance_contract.py \
      tests/test_fp8_formats.py -p no:cacheprovider --tb=short 2>&1 | tail -40 \
      | tee "$OUT/next_verify_fp8.log"
    timeout 300 python3 -m pytest -m gpu -n 8 -v --tb=short --timeout 150 tests \
      -p no:cacheprovider -p no:warnings > "$OUT/gpu_tests.log" 2>&1
    grep -E "FAILED|ERROR| passed| failed" "$OUT/gpu_tests.log" | tail -30
    ;;
  fifth)
    timeout 70 python3 -m pytest -v -m gpu tests/test_graph_gpu.py -k multi_step \
      -p no:cacheprovider --tb=short > "$OUT/multistep.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$OUT/multistep.log" | tail -20
    timeout 120 python3 -m pytest -v -m gpu tests/test_conformance_contract.py \
      tests/test_fp8_formats.py tests/test_kv_scales.py -p no:cacheprovider --tb=long \
      > "$OUT/verify_fp8.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/verify_fp8.log" | tail -40
    timeout 190 python3 benchmarks/bench_attention.py --only mixed,cascade --cascade-sweep \
      --out "$OUT/bench" 2>&1 | grep -v "^ *$" | tail -40
    timeout 80 python3 benchmarks/bench_prefill.py --no-sweep --out "$OUT/prefill" 2>&1 \
      | tail -22
    timeout 100 ncu --clock-control none --profile-from-start off --nvtx \
      --target-processes all --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats \
      python3 benchmarks/ncu_kernels.py > "$OUT/ncu.log" 2>&1
    tail -5 "$OUT/ncu.log"
    rm -f "$OUT"/*/*.png
    ;;
  sixth)
    timeout 280 python3 -m pytest -m gpu -n 8 -v --tb=short --timeout 250 --durations=30 tests \
      -p no:cacheprovider -p no:warnings > "$OUT/gpu_tests.log" 2>&1
    grep -E "FAILED|ERROR| passed| failed|Timeout" "$OUT/gpu_tests.log" | tail -30
    timeout 60 python3 benchmarks/profile_kernels.py --out "$OUT" 2>&1 | tail -45
    timeout 100 python3 benchmarks/bench_attention.py --only cascade --cascade-sweep 1 \
      --out "$OUT/cascade" 2>&1 | grep -v "^ *$" | tail -12
    timeout 90 python3 benchmarks/bench_variants.py --rows 1x4096,16x4096,1x32768 --rep 20 \
      --variants default,splits128,splits64,bn64,bn64-s4,splits128-bn64,w8 --out "$OUT" \
      2>&1 | tail -6
    ;;
  seventh)
    timeout 40 python3 -m pytest -m gpu tests/test_fp8_formats.py -k bytes_equal -q \
      -p no:cacheprovider --tb=short 2>&1 | grep -vE "^\s*$|warn" | tail -40
    timeout 90 python3 benchmarks/bench_attention.py --only cascade --cascade-sweep 1 \
      --out "$OUT/cascade" 2>&1 | grep -v "^ *$" | tail -8
    timeout 110 python3 benchmarks/bench_attention.py --only mixed --out "$OUT/mixed" 2>&1 \
      | tail -6
    # the gpu tests the sixth call did not reach (scripts/gpu_pending.txt, node ids), else all
    sel=tests; [ -f scripts/gpu_pending.txt ] && sel=@scripts/gpu_pending.txt
    timeout ${SUITE_S:-300} python3 -m pytest -m gpu -n 8 -v --tb=short --timeout 200 \
      --durations=20 $sel -p no:cacheprovider -p no:warnings > "$OUT/gpu_tests.log" 2>&1
    grep -E "FAILED|ERROR| passed| failed|Timeout" "$OUT/gpu_tests.log" | tail -30
    ;;
  eighth)
    timeout 50 python3 -m pytest -m gpu tests/test_fp8_formats.py -k "bytes_equal or \
      token_head_attention_and_backend" -q -p no:cacheprovider --tb=short 2>&1 \
      | grep -E "^E |passed|failed|FAILED" | head -30
    AITER_ATTN_VERIFY_PROGRESS=1 timeout 140 python3 -m aiter_attn.cli verify --backend triton \
      --device cuda --op paged_attention --op paged_attention_5d 2>&1 \
      | grep -vE " pass( |$)|: pass in" | tail -30
    timeout 30 python3 -m aiter_attn.cli verify --backend reference --device cuda \
      --op write_kv --op write_kv_swa --op write_kv_5d 2>&1 | tail -4
    timeout 45 python3 -m pytest -m gpu "tests/test_triton_prefill.py::test_dense_gpu" -q \
      -p no:cacheprovider --tb=short -k "bn64-4w-ws" 2>&1 | grep -E "^E |passed|failed" \
      | head -20
    ;;
  ninth)
    timeout 40 python3 -m pytest -m gpu tests/test_fp8_formats.py tests/test_write_kv_padding.py \
      -k "bytes_equal or token_head_attention_and_backend or padding" -q -p no:cacheprovider \
      --tb=short > "$OUT/fp8.log" 2>&1
    timeout 15 python3 -m aiter_attn.cli verify --backend reference --device cuda \
      --op write_kv --op write_kv_swa --op write_kv_5d > "$OUT/verify_ref_writes.log" 2>&1
    timeout 30 python3 -m aiter_attn.cli verify --backend triton --device cuda \
      --op paged_attention_5d > "$OUT/verify_triton_5d.log" 2>&1
    tail -15 "$OUT/fp8.log"; tail -3 "$OUT/verify_ref_writes.log"; cat "$OUT/verify_triton_5d.log"
    ;;
  tenth)
    timeout 40 python3 -m pytest -m gpu tests/test_fp8_formats.py tests/test_write_kv_padding.py \
      -k "bytes_equal or token_head_attention_and_backend or padding" -v -p no:cacheprovider \
      --tb=long > "$OUT/fp8.log" 2>&1
    grep -E "PASSED|FAILED|ERROR| passed| failed" "$OUT/fp8.log" | tail -15
    timeout 20 python3 -m aiter_attn.cli verify --backend reference --device cuda \
      --op write_kv --op write_kv_swa --op write_kv_5d > "$OUT/verify_ref_writes.log" 2>&1
    tail -3 "$OUT/verify_ref_writes.log"
    for op in paged_attention_5d paged_attention mla_paged_attention; do
      AITER_ATTN_VERIFY_PROGRESS=1 timeout 100 python3 -m aiter_attn.cli verify \
        --backend triton --device cuda --op $op > "$OUT/verify_triton_$op.log" 2>&1
      echo "== $op rc=$?"; grep -vE " pass( |$)|: pass in" "$OUT/verify_triton_$op.log" | tail -8
    done
    sel=tests; [ -f scripts/gpu_pending.txt ] && sel=@scripts/gpu_pending.txt
    timeout ${SUITE_S:-200} python3 -m pytest -m gpu -n 8 -v --tb=short --timeout 180 \
      --durations=20 $sel -p no:cacheprovider -p no:warnings > "$OUT/gpu_tests.log" 2>&1
    grep -E "FAILED|ERROR| passed| failed|Timeout" "$OUT/gpu_tests.log" | tail -30
    ;;
  eleventh)
    sel=tests; [ -f scripts/gpu_pending.txt ] && sel=@scripts/gpu_pending.txt
    timeout ${SUITE_S:-300} python3 -m pytest -m gpu -n 6 -v --tb=short --timeout 240 \
      --durations=25 $sel -p no:cacheprovider -p no:warnings > "$OUT/gpu_tests.log" 2>&1
    grep -E "FAILED|ERROR| passed| failed|Timeout" "$OUT/gpu_tests.log" | tail -30
    timeout ${MIXED_S:-170} python3 benchmarks/bench_attention.py --only mixed \
      --out "$OUT/mixed" > "$OUT/mixed.log" 2>&1
    tail -6 "$OUT/mixed.log"
    ;;
  twelfth)
    timeout ${MIXED_S:-100} python3 benchmarks/bench_attention.py --only mixed \
      --out "$OUT/mixed" > "$OUT/mixed.log" 2>&1
    tail -4 "$OUT/mixed.log"
    timeout ${SUITE_S:-380} python3 -m pytest -m gpu -n 8 -v --tb=short --timeout 300 \
      --durations=25 tests -p no:cacheprovider -p no:warnings > "$OUT/gpu_tests.log" 2>&1
    grep -E "FAILED|ERROR| passed| failed|Timeout" "$OUT/gpu_tests.log" | tail -30
    ;;
  thirteenth)
    for t in "tests/test_triton_prefill_extend.py::test_extend_gpu[dtype1]" \
             "tests/test_triton_prefill.py::test_dense_gpu[bf16-bn64-4w-ws]" \
             "tests/test_triton_prefill.py::test_dense_gpu[bf16-bn128-4w-ws]"; do
      timeout ${EACH_S:-200} python3 -m pytest -m gpu -v --tb=short --timeout 190 \
        --durations=3 "$t" -p no:cacheprovider -p no:warnings >> "$OUT/left.log" 2>&1
      echo "== $t rc=$?"; grep -E "PASSED|FAILED|Timeout|s call" "$OUT/left.log" | tail -3
    done
    # small-batch decode: the chunked page lookup (every copy of a short split in flight)
    timeout ${VAR_S:-120} python3 benchmarks/bench_variants.py --rows 1x4096,16x4096,1x32768 \
      --rep 20 --variants default,chunk16,chunk16-s4,chunk16-bn64-s4,chunk16-splits128,\
splits512,chunk16-splits512 --out "$OUT" > "$OUT/variants.log" 2>&1
    tail -6 "$OUT/variants.log"
    # MLA launch sweep, with the spill-free 8-warp 16-head launch (docs/triton_tuning.md)
    timeout ${MLA_S:-150} python3 benchmarks/bench_attention.py --only mla --mla-sweep \
      --out "$OUT/mla" > "$OUT/mla.log" 2>&1
    grep -E "ours|mla H" "$OUT/mla.log" | tail -30
    ;;
  fourteenth)
    timeout ${TEST_S:-150} python3 -m pytest -m gpu -n 4 -v --tb=short --timeout 140 \
      tests/test_pdl.py tests/test_triton_prefill.py tests/test_triton_paged_attention.py \
      tests/test_triton_mla.py "tests/test_graph_gpu.py::test_replays_make_no_host_sync_and_match_eager" \
      -p no:cacheprovider -p no:warnings > "$OUT/tests.log" 2>&1
    grep -E "FAILED|ERROR| passed| failed|Timeout" "$OUT/tests.log" | tail -15
    timeout ${VAR_S:-110} python3 benchmarks/bench_variants.py \
      --rows 1x4096,16x4096,1x32768,64x4096,8x65536 --rep 20 \
      --variants default,nopdl,chunk16,chunk16-nopdl,min2k,min4k --out "$OUT" \
      > "$OUT/variants.log" 2>&1
    tail -8 "$OUT/variants.log"
    timeout ${PF_S:-170} python3 benchmarks/bench_prefill.py --budget-s 110 --out "$OUT/prefill" \
      > "$OUT/prefill.log" 2>&1
    tail -9 "$OUT/prefill.log"
    timeout ${MLA_S:-100} python3 benchmarks/bench_attention.py --only mla --mla-sweep \
      --out "$OUT/mla" > "$OUT/mla.log" 2>&1
    grep -E "ours" "$OUT/mla.log" | head -40
    timeout ${DEC_S:-90} python3 benchmarks/bench_attention.py --only decode,fp8 \
      --out "$OUT/decode" > "$OUT/decode.log" 2>&1
    grep -A12 "CUDA-graph replay" "$OUT/decode.log" | head -14
    rm -f "$OUT"/*/*.png
    ;;
  fifteenth)
    timeout ${TEST_S:-120} python3 -m pytest -m gpu -n 4 -v --tb=short --timeout 110 \
      tests/test_pdl.py tests/test_triton_prefill.py tests/test_triton_prefill_extend.py \
      tests/test_triton_prefill_backend.py tests/test_triton_paged_attention.py \
      -p no:cacheprovider -p no:warnings > "$OUT/tests.log" 2>&1
    grep -E "FAILED|ERROR| passed| failed|Timeout" "$OUT/tests.log" | tail -15
    timeout ${VAR_S:-100} python3 benchmarks/bench_variants.py \
      --rows 1x4096,16x4096,1x32768 --rep 20 \
      --variants default,chunk0,pdl,pdl-reduce,chunk4,chunk8,chunk16-s2 --out "$OUT" \
      > "$OUT/variants.log" 2>&1
    tail -5 "$OUT/variants.log"
    timeout ${PF_S:-150} python3 benchmarks/bench_prefill.py --budget-s 95 --out "$OUT/prefill" \
      > "$OUT/prefill.log" 2>&1
    grep -A7 "CUDA-graph replay" "$OUT/prefill.log"; grep -E "dense |ours-dense" "$OUT/prefill.log"
    timeout ${MLA_S:-100} python3 benchmarks/bench_attention.py --only mla --mla-sweep \
      --out "$OUT/mla" > "$OUT/mla.log" 2>&1
    grep -E "== mla H16 .*bf16|ours" "$OUT/mla.log" | head -34
    rm -f "$OUT"/*/*.png "$OUT"/*/*.json
    ;;
  sixteenth)
    timeout ${TEST_S:-100} python3 -m pytest -m gpu -n 4 -v --tb=short --timeout 90 \
      tests/test_triton_prefill.py tests/test_triton_prefill_extend.py \
      tests/test_triton_prefill_backend.py tests/test_triton_mla.py tests/test_pdl.py \
      -p no:cacheprovider -p no:warnings > "$OUT/tests.log" 2>&1
    grep -E "FAILED|ERROR| passed| failed|Timeout" "$OUT/tests.log" | tail -15
    timeout ${PF_S:-80} python3 benchmarks/bench_prefill.py --no-sweep --out "$OUT/prefill" \
      > "$OUT/prefill.log" 2>&1
    grep -A8 "CUDA-graph replay" "$OUT/prefill.log"; grep -A8 "^Eager" "$OUT/prefill.log"
    timeout ${DEC_S:-170} python3 benchmarks/bench_attention.py --only decode,mla,fp8 \
      --anchors cudnn --out "$OUT/attn" > "$OUT/attn.log" 2>&1
    grep -A22 "CUDA-graph replay" "$OUT/attn.log" | head -24
    rm -f "$OUT"/*/*.png
    ;;
  seventeenth)
    timeout ${TEST_S:-190} python3 -m pytest -m gpu -n 6 -v --tb=short --timeout 180 \
      tests/test_graph_gpu.py tests/test_engine_graphs.py tests/test_cascade.py \
      tests/test_cascade_backend.py "tests/test_conformance_contract.py::test_verify_on_cuda_captures_and_replays" \
      -k "not reference" -p no:cacheprovider -p no:warnings > "$OUT/tests.log" 2>&1
    grep -E "FAILED|ERROR| passed| failed|Timeout" "$OUT/tests.log" | tail -20
    ;;
  eighteenth)
    timeout ${PF_S:-150} python3 benchmarks/bench_prefill.py --rows "prefill 1x16k,prefill 8x2k" \
      --sweep-graphs --budget-s 110 --out "$OUT/prefill" > "$OUT/prefill.log" 2>&1
    grep -E "== |ours-dense|cudnn|dense " "$OUT/prefill.log"
    timeout ${MLA_S:-120} python3 benchmarks/bench_attention.py --only mla --mla-sweep \
      --out "$OUT/mla" > "$OUT/mla.log" 2>&1
    grep -E "== mla H16 .*bf16|ours16/32/4/3" "$OUT/mla.log" | head -20
    timeout ${SUITE_S:-280} python3 -m pytest -m gpu -n 8 -q --timeout 200 tests \
      -p no:cacheprovider -p no:warnings > "$OUT/gpu_tests.log" 2>&1
    grep -E "FAILED|ERROR| passed| failed" "$OUT/gpu_tests.log" | tail -20
    rm -f "$OUT"/*/*.png
    ;;
  nineteenth)
    timeout ${LT_S:-75} python3 -m pytest -m gpu -q tests/test_triton_prefill.py -k "lazy or m64" \
      -p no:cacheprovider -p no:warnings > "$OUT/lazy_tests.log" 2>&1
    tail -3 "$OUT/lazy_tests.log"
    timeout ${PF_S:-270} python3 benchmarks/bench_prefill.py --sweep-graphs --configs 2,3,7,8,9 \
      --budget-s 0 --out "$OUT/prefill" > "$OUT/prefill.log" 2>&1
    grep -E "== |ours-dense|cudnn|dense " "$OUT/prefill.log"
    timeout ${NCU_S:-110} ncu --clock-control none --profile-from-start off \
      --section SourceCounters --section WarpStateStats -f -o "$OUT/fused" \
      python3 benchmarks/profile_fused_reduce.py --ncu > "$OUT/ncu_fused.log" 2>&1
    tail -3 "$OUT/ncu_fused.log"
    ncu --import "$OUT/fused.ncu-rep" --page details > "$OUT/fused_details.txt" 2>&1
    ncu --import "$OUT/fused.ncu-rep" --page source --csv --print-source sass \
      > "$OUT/fused_sass.csv" 2>&1
    ls -la "$OUT"
    rm -f "$OUT"/*/*.png
    ;;
  twentieth)
    timeout ${GT_S:-120} python3 -m pytest -m gpu -q -x tests/test_triton_prefill.py \
      -k "gluon" -p no:cacheprovider -p no:warnings --tb=short > "$OUT/gluon_tests.log" 2>&1
    tail -30 "$OUT/gluon_tests.log"
    timeout ${PF_S:-300} python3 benchmarks/bench_prefill.py --sweep-graphs --host \
      --configs ${PF_CONFIGS:-2,3,7,8,9,10} --budget-s 0 --out "$OUT/prefill" \
      > "$OUT/prefill.log" 2>&1
    grep -E "== |ours-dense|cudnn|dense |Error|error" "$OUT/prefill.log" | head -60
    rm -f "$OUT"/*/*.png
    ;;
  twentyfirst)
    timeout ${SUITE_S:-290} python3 -m pytest -m gpu -n 8 -q --timeout 200 tests \
      -p no:cacheprovider -p no:warnings > "$OUT/gpu_tests.log" 2>&1
    grep -E "FAILED|ERROR| passed| failed" "$OUT/gpu_tests.log" | tail -20
    timeout ${PF_S:-120} python3 benchmarks/bench_prefill.py --no-sweep --host \
      --out "$OUT/prefill" > "$OUT/prefill.log" 2>&1
    grep -E "== |ours-|cudnn|Error|error" "$OUT/prefill.log" | head -40
    rm -f "$OUT"/*/*.png
    ;;
  twentythird)
    timeout ${GT_S:-200} python3 -m pytest -m gpu -q tests/test_triton_prefill.py \
      tests/test_direct_launch.py tests/test_triton_prefill_extend.py \
      tests/test_triton_prefill_backend.py -p no:cacheprovider -p no:warnings --tb=short \
      --durations=10 > "$OUT/prefill_tests.log" 2>&1
    tail -25 "$OUT/prefill_tests.log"
    timeout ${SW_S:-300} python3 benchmarks/bench_prefill.py --sweep-graphs --host \
      --rows "${PF_ROWS:-prefill 8x2k,prefill 1x8k,prefill 1x16k,prefill 1x2k}" \
      --configs ${PF_CONFIGS:-7,14,15,16,17,18} --budget-s 0 \
      --out "$OUT/sweep" > "$OUT/sweep.log" 2>&1
    grep -E "== |dense |cudnn|Error|error" "$OUT/sweep.log" | head -60
    rm -f "$OUT"/*/*.png
    ;;
  twentyfourth)
    timeout ${GT_S:-200} python3 -m pytest -m gpu -q tests/test_triton_prefill.py \
      tests/test_direct_launch.py tests/test_triton_prefill_extend.py \
      tests/test_triton_prefill_backend.py -p no:cacheprovider -p no:warnings --tb=short \
      > "$OUT/prefill_tests.log" 2>&1
    tail -5 "$OUT/prefill_tests.log"
    timeout ${SW_S:-300} python3 benchmarks/bench_prefill.py --sweep-graphs --host \
      --configs ${PF_CONFIGS:-7,17,18,19,20} --budget-s 0 \
      --out "$OUT/sweep" > "$OUT/sweep.log" 2>&1
    grep -E "== |dense |cudnn|ours-|Error|error" "$OUT/sweep.log" | head -60
    timeout ${BA_S:-200} python3 benchmarks/bench_attention.py --only prefill \
      --out "$OUT/attention" > "$OUT/attention.log" 2>&1
    tail -25 "$OUT/attention.log"
    timeout ${DE_S:-150} python3 benchmarks/bench_dense_extend.py --out "$OUT/dense_extend" \
      > "$OUT/dense_extend.log" 2>&1
    tail -22 "$OUT/dense_extend.log"
    rm -f "$OUT"/*/*.png
    ;;
  twentyfifth)
    timeout ${GT_S:-200} python3 -m pytest -m gpu -q tests/test_triton_prefill.py \
      tests/test_direct_launch.py tests/test_triton_prefill_extend.py \
      tests/test_triton_prefill_backend.py -p no:cacheprovider -p no:warnings --tb=short \
      > "$OUT/prefill_tests.log" 2>&1
    tail -5 "$OUT/prefill_tests.log"
    timeout ${BA_S:-240} python3 benchmarks/bench_attention.py --only prefill \
      --out "$OUT/attention" > "$OUT/attention.log" 2>&1
    grep -E "== |ours|cudnn" "$OUT/attention.log" | head -40
    tail -28 "$OUT/attention.log"
    timeout ${SW_S:-150} python3 benchmarks/bench_prefill.py --sweep-graphs --host \
      --rows "${PF_ROWS:-prefill 8x2k,prefill 1x8k,prefill 1x2k}" \
      --configs ${PF_CONFIGS:-2,7,17,18,19} --budget-s 0 \
      --out "$OUT/sweep" > "$OUT/sweep.log" 2>&1
    grep -E "== |dense |cudnn|ours-|Error|error" "$OUT/sweep.log" | head -40
    rm -f "$OUT"/*/*.png
    ;;
  twentysixth)
    timeout ${GT_S:-240} python3 -m pytest -m gpu -q tests/test_triton_mla.py tests/test_mla.py \
      -p no:cacheprovider -p no:warnings --tb=short -x > "$OUT/mla_tests.log" 2>&1
    tail -30 "$OUT/mla_tests.log"
    timeout ${BA_S:-240} python3 benchmarks/bench_attention.py --only mla \
      --out "$OUT/attention" > "$OUT/attention.log" 2>&1
    grep -E "== |ours|Error|error" "$OUT/attention.log" | head -60
    rm -f "$OUT"/*/*.png
    ;;
  twentyeighth)
    # the gpu tests of the launch options (each test turns its option on) and of the kernels
    # they touch; the reorderings that are on by default run in every paged test here
    gpu_tests gpu_tests.log ${GT_S:-240} 200 \
      tests/test_fp8_value_pairs.py tests/test_prefetch_pages.py tests/test_page_ahead.py \
      tests/test_mla_value_pairs.py tests/test_triton_paged_attention.py \
      tests/test_fp8_formats.py tests/test_triton_mla.py tests/test_direct_launch.py
    ;;
  thirtyfirst)
    # the gpu test files not run since the window change (the whole suite passed on 885dc97)
    gpu_tests gpu_tests_pending.log ${GT_S:-330} 200 \
      tests/test_conformance_contract.py tests/test_engine_mixed.py tests/test_graph_gpu.py \
      tests/test_swa.py tests/test_triton_prefill.py tests/test_kv_scales.py
    ;;
  thirtysecond)
    # the decode fix (bt_width last: 168 registers again) and the fp8 value-pairs default:
    # the gpu tests of the paged kernel, the decode / fp8 table against cuDNN, then the
    # small-batch rows against the carried lookup without splits
    gpu_tests gpu_tests.log ${GT_S:-200} 180 \
      tests/test_fp8_value_pairs.py tests/test_prefetch_pages.py tests/test_page_ahead.py \
      tests/test_triton_paged_attention.py tests/test_fp8_formats.py tests/test_direct_launch.py
    timeout ${BA_S:-200} python3 benchmarks/bench_attention.py --only decode,fp8 --rep 30 \
      --anchors cudnn --out "$OUT/attention" > "$OUT/attention.log" 2>&1
    grep -E "^\| (decode|fp8)" "$OUT/attention.log" | head -20
    timeout ${SB_S:-120} python3 benchmarks/bench_variants.py --out "$OUT/sb" \
      --rows 1x4096,16x4096,1x32768,64x4096,8x65536 --variants planned,\
planned-chunk0-ahead-splits1,planned-chunk0-ahead-bn64-splits1 2>&1 | tail -7 \
      | tee "$OUT/small_batch.log"
    rm -f "$OUT"/*/*.png
    ;;
  thirtythird)
    # one-wave decode unsplit on the carried lookup: its gpu tests, then the decode table
    gpu_tests gpu_tests.log ${GT_S:-120} 110 tests/test_page_ahead.py \
      tests/test_triton_launch_config.py tests/test_graph_gpu.py
    timeout ${BA_S:-150} python3 benchmarks/bench_attention.py --only decode --rep 30 \
      --anchors cudnn --out "$OUT/attention" > "$OUT/attention.log" 2>&1
    grep -E "^\| decode" "$OUT/attention.log" | head -20
    rm -f "$OUT"/*/*.png
    ;;
  thirtyfifth)
    # num_seqs unspecialised (1x32k: 168 registers, three programs per SM): split counts at
    # 1x32k, 16x4k and 1x4k; the MLA 16-head tiles that fit three programs per SM; ncu of
    # the small-batch and MLA rows on the current code
    gpu_tests gpu_tests.log ${GT_S:-90} 80 tests/test_triton_paged_attention.py \
      tests/test_page_ahead.py tests/test_triton_launch_config.py
    timeout ${SB_S:-150} python3 benchmarks/bench_variants.py --out "$OUT/sb32" --rows 1x32768 \
      --rep 30 --variants planned,planned-ov:num_splits=40,planned-ov:num_splits=43,\
planned-ov:num_splits=48,planned-ov:num_splits=64,planned-ov:block_n=64+num_splits=47,\
planned-ov:block_n=64+num_splits=64 2>&1 | tail -3 | tee "$OUT/small_batch.log"
    timeout ${SB2_S:-110} python3 benchmarks/bench_variants.py --out "$OUT/sb4" \
      --rows 16x4096,1x4096 --rep 30 --variants planned,planned-ov:num_splits=3,\
planned-ov:block_n=64+num_splits=16,planned-ov:block_n=64+num_splits=32,\
planned-ov:page_chunk=0+page_ahead=true+block_n=64+num_splits=2 2>&1 | tail -4 \
      | tee -a "$OUT/small_batch.log"
    timeout ${MLA_S:-120} python3 benchmarks/bench_attention.py --only mla --rep 30 \
      --anchors "" --mla-rows 16x64x4096 --mla-kv bf16 --mla-sweep --mla-configs \
      16/16/4/4/6,16/16/4/4/4,16/16/4/3/8,16/16/4/5/6,16/32/4/2/6,16/16/4/4/6/16,16/16/4/4/12 \
      --out "$OUT/mla" 2>&1 | grep -E "==|ours" | tee "$OUT/mla.log"
    timeout ${MLA2_S:-60} python3 benchmarks/bench_attention.py --only mla --rep 30 \
      --anchors "" --mla-rows 16x128x8192 --mla-kv bf16 --mla-sweep --mla-configs \
      16/16/4/4/3,16/16/4/4/6 --out "$OUT/mla2" 2>&1 | grep -E "==|ours" \
      | tee -a "$OUT/mla.log"
    timeout ${NCU_S:-150} ncu --clock-control none --profile-from-start off --nvtx \
      --target-processes all --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats \
      python3 benchmarks/ncu_kernels.py --cases decode1x4k,decode1x4k-cudnn,decode16x4k,\
decode16x4k-cudnn,decode1x32k,decode1x32k-cudnn,mla16 > "$OUT/ncu.log" 2>&1
    grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit" \
      "$OUT/ncu.log" | head -80
    rm -f "$OUT"/*/*.png
    ;;
  thirtysixth)
    # the carried page lookup on split launches again, now that num_seqs is unspecialised:
    # 64-key tiles (166 registers, 72 KB: three programs per SM) and 32-key tiles with 4
    # stages (111 registers, 38 KB: four per SM), with 2-4 programs per SM of splits
    A=page_chunk=0+page_ahead=true+block_n=64
    B=page_chunk=0+page_ahead=true+block_n=32+num_stages=4
    timeout ${SB_S:-400} python3 benchmarks/bench_variants.py --out "$OUT/sb" --rep 30 \
      --rows ${ROWS:-1x32768,8x65536,16x4096,64x4096,256x4096,1x4096} \
      --variants planned,planned-ov:$A,planned-ov:$A+waves=3,planned-ov:$B,\
planned-ov:$B+waves=3,planned-ov:$B+waves=4 2>&1 | tail -9 | tee "$OUT/small_batch.log"
    ;;
  thirtyseventh)
    # is the per-program gap to cuDNN the cache's storage order? the same kernel on caches
    # stored NHD (256-byte runs per head) and HND (each page's head contiguous), pages 16/64
    A=page_chunk=0+page_ahead=true+block_n=64
    timeout ${SB_S:-300} python3 benchmarks/bench_variants.py --out "$OUT/layout" --rep 30 \
      --rows ${ROWS:-1x32768,16x4096,1x4096,8x65536} --layouts nhd,hnd --pages 16,64 \
      --variants planned,planned-ov:$A 2>&1 | tail -17 | tee "$OUT/layout.log"
    ;;
  thirtyeighth)
    # the carried lookup reading a tile's page ids as one small load (page 16: 4 or 8 ids,
    # repeated per key in registers; was one 4-byte load per key per thread)
    A=page_chunk=0+page_ahead=true+block_n=64
    timeout ${SB_S:-300} python3 benchmarks/bench_variants.py --out "$OUT/ids" --rep 30 \
      --rows ${ROWS:-1x4096,1x32768,16x4096,8x65536,64x4096} \
      --variants planned,planned-ov:$A,planned-ov:$A+waves=3,planned-ov:$A+num_stages=4,\
planned-ov:page_chunk=0+page_ahead=true 2>&1 | tail -8 | tee "$OUT/ids.log"
    ;;
  thirtyninth)
    # where the carried lookup with 64-key tiles (A) beats the default: unsplit page-16
    # launches of at least one wave, and split launches on pages of 64
    A=page_chunk=0+page_ahead=true+block_n=64
    timeout ${SB_S:-200} python3 benchmarks/bench_variants.py --out "$OUT/p16" --rep 30 \
      --rows 33x4096,48x4096,64x4096,128x4096,256x4096,64x16384,64x1024,32x16384 \
      --variants planned,planned-ov:$A 2>&1 | tail -10 | tee "$OUT/p16.log"
    timeout ${SB2_S:-200} python3 benchmarks/bench_variants.py --out "$OUT/p64" --rep 30 \
      --rows 1x4096,1x32768,4x16384,16x4096,8x65536,64x4096,2x8192 --pages 64 \
      --variants planned,planned-ov:$A 2>&1 | tail -9 | tee "$OUT/p64.log"
    ;;
  fortieth)
    # slot-index addressing (FLAT_SLOTS: one widening multiply per K/V row): the default and
    # the 64-key carried lookup (A: 149 registers split, 153 unsplit, three programs per SM)
    A=page_chunk=0+page_ahead=true+block_n=64
    timeout ${SB_S:-300} python3 benchmarks/bench_variants.py --out "$OUT/flat" --rep 30 \
      --rows ${ROWS:-1x4096,1x32768,16x4096,8x65536,64x4096,256x4096,64x16384} \
      --variants planned,planned-ov:flat_slots=true,planned-ov:$A,planned-ov:$A+flat_slots=true,\
planned-ov:$A+flat_slots=true+waves=3 2>&1 | tail -10 | tee "$OUT/flat.log"
    ;;
  fortyfirst)
    # slot addressing by default (bf16 decode with at most two programs per SM): its gpu
    # tests, the launch-option files, then the decode table against cuDNN
    gpu_tests gpu_tests.log ${GT_S:-150} 140 tests/test_flat_slots.py \
      tests/test_triton_paged_attention.py tests/test_page_ahead.py \
      tests/test_triton_launch_config.py tests/test_graph_gpu.py
    timeout ${BA_S:-150} python3 benchmarks/bench_attention.py --only decode --rep 30 \
      --anchors cudnn --out "$OUT/attention" > "$OUT/attention.log" 2>&1
    grep -E "^\| decode" "$OUT/attention.log" | head -20
    rm -f "$OUT"/*/*.png
    timeout ${SB_S:-150} python3 benchmarks/bench_variants.py --out "$OUT/sb" --rep 30 \
      --rows 1x4096,1x32768,16x4096 --variants planned,planned-ov:page_chunk=8,\
planned-ov:page_chunk=2,planned-ov:num_stages=2,planned-pdl-reduce,planned-pdl \
      2>&1 | tail -5 | tee "$OUT/small_batch.log"
    timeout ${SB64_S:-80} python3 benchmarks/bench_variants.py --out "$OUT/p64" --rep 30 \
      --rows 1x4096,1x32768,2x8192 --pages 64 \
      --variants planned,planned-ov:page_chunk=0+page_ahead=true+block_n=64 \
      2>&1 | tail -5 | tee -a "$OUT/small_batch.log"
    ;;
  fortysecond)
    # query-head chunks (programs per (request, KV head, head chunk) reading the same K/V
    # from L2): more programs per SM without splits; then ncu of the new small-batch default
    timeout ${SB_S:-200} python3 benchmarks/bench_variants.py --out "$OUT/heads" --rep 30 \
      --rows 16x4096,1x32768,1x4096 --variants planned,planned-ov:heads=2,\
planned-ov:heads=2+num_splits=1,planned-ov:heads=2+num_splits=1+page_chunk=0+page_ahead=true+block_n=64,\
planned-ov:heads=1+num_splits=1 2>&1 | tail -5 | tee "$OUT/heads.log"
    timeout ${NCU_S:-120} ncu --clock-control none --profile-from-start off --nvtx \
      --target-processes all --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section WarpStateStats \
      python3 benchmarks/ncu_kernels.py --cases decode1x4k,decode16x4k,decode1x32k \
      > "$OUT/ncu.log" 2>&1
    grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Warp Cycles Per Issued" \
      "$OUT/ncu.log" | head -40
    ;;
  fortythird)
    # fp8 / bf16 tokens/s with the bf16 default on slot addressing, fp8 with and without it;
    # then the gpu test files that run bf16 decode through the default (slot addressing)
    timeout ${FP_S:-75} python3 benchmarks/bench_attention.py --only fp8 --rep 30 --anchors "" \
      --out "$OUT/fp8" 2>&1 | grep -E "==|ours" | tee "$OUT/fp8.log"
    timeout ${FP_S:-75} python3 benchmarks/bench_attention.py --only fp8 --rep 30 --anchors "" \
      --overrides '{"flat_slots": true}' --out "$OUT/fp8_flat" 2>&1 | grep -E "==|ours" \
      | tee -a "$OUT/fp8.log"
    gpu_tests gpu_tests.log ${GT_S:-280} 240 tests/test_engine_graphs.py tests/test_engine.py \
      tests/test_spec_modes.py tests/test_cascade.py tests/test_cascade_backend.py \
      tests/test_lse.py tests/test_ops_memo.py tests/test_direct_launch.py \
      tests/test_conformance_contract.py tests/test_engine_mixed.py tests/test_pdl.py \
      tests/test_graph_addresses.py tests/test_batch_invariant.py
    rm -f "$OUT"/*/*.png
    ;;
  fortyfourth)
    # small-batch shapes on slot addressing: 16x4k in two splits (256 programs, two per SM),
    # 1x4k in one-tile splits on a one-tile ring, 1x32k with fewer, longer splits
    timeout ${SB_S:-200} python3 benchmarks/bench_variants.py --out "$OUT/sb" --rep 30 \
      --rows 16x4096,1x4096,1x32768 --variants planned,planned-ov:num_splits=2,\
planned-ov:min_split_tokens=128+num_stages=2,planned-ov:min_split_tokens=128+num_stages=2+page_chunk=0,\
planned-ov:num_splits=24,planned-ov:num_splits=16 2>&1 | tail -5 | tee "$OUT/small_batch.log"
    ;;
  fortyseventh)
    gpu_tests gluon_decode_tests.log ${GT_S:-150} 120 tests/test_gluon_decode.py
    timeout ${GD_S:-300} python3 benchmarks/bench_gluon_decode.py --out "$OUT/gd" --rep 30 \
      --rows 16x4096,1x4096,1x32768,64x4096,8x65536,256x4096 --variants default,\
bn64.st4.nc2.r128.s0,bn128.st3.nc2.r168.s0,bn128.st2.nc2.r168.s0,bn64.st3.nc2.r80.s00,\
bn128.st3.nc1.r168.s0 2>&1 | tail -9 | tee "$OUT/gluon_decode.log"
    ;;
  sixtyseventh)
    # correctness of the four 16-head options (descriptors, lazy rescale, 16-bit partials,
    # two score chains), then ncu of the default and the options
    gpu_tests mla_option_tests.log ${GT_S:-330} 90 tests/test_mla_kv_desc.py \
      tests/test_mla_lazy_rescale.py tests/test_mla_half_partials.py tests/test_mla_qk_split.py
    timeout ${NCU_S:-220} ncu --clock-control none --profile-from-start off --nvtx \
      --target-processes all --section SpeedOfLight --section Occupancy \
      --section MemoryWorkloadAnalysis --section WarpStateStats --metrics \
smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum \
      python3 benchmarks/ncu_kernels.py --cases mla16,mla16-split2,mla16-lazy-half-split4,mla16-desc-lazy,mla16-all \
      > "$OUT/ncu.log" 2>&1
    grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Dynamic Shared|smsp__inst|bank_conf|wavefronts" \
      "$OUT/ncu.log" | head -80
    ;;
  seventyseventh)
    # the balanced launch with its first request's tile loop outside the while loop (sm_90:
    # 541 instructions a tile, the split kernel's 548): gpu tests, time split, rows, PDL
    timeout ${GT_S:-200} python3 -m pytest -q -p no:randomly -m gpu -n 8 tests/test_mla_balanced.py \
      > "$OUT/balanced_gpu.log" 2>&1
    tail -3 "$OUT/balanced_gpu.log"
    timeout ${MB_S:-200} python3 benchmarks/mla_balanced.py --split \
      --rows uniform64=64x4096,uniform128=128x8192,skew32k=1x32768+63x1024,mixed=16x8192+48x2048,small=32x1024 \
      --tunings '[{}, {"balanced": true}, {"balanced": true, "pdl": true}]' 2>&1 \
      | tee "$OUT/mla_balanced.log"
    ;;
  seventysixth)
    # the balanced launch's merge of many parts as [8, R] tiles: gpu tests, time split, rows
    timeout ${GT_S:-200} python3 -m pytest -q -p no:randomly -m gpu -n 8 tests/test_mla_balanced.py \
      > "$OUT/balanced_gpu.log" 2>&1
    tail -3 "$OUT/balanced_gpu.log"
    timeout ${MB_S:-200} python3 benchmarks/mla_balanced.py --split \
      --rows uniform64=64x4096,uniform128=128x8192,skew32k=1x32768+63x1024,skew16k=4x16384+60x512,mixed=16x8192+48x2048,small=32x1024 \
      --tunings '[{}, {"balanced": true}]' 2>&1 | tee "$OUT/mla_balanced.log"
    ;;
  seventyfifth)
    # the balanced launch with power-of-two program tiles (aligned on uniform batches) and
    # PDL (the merge's prologue under the attention's tail): gpu tests, time split, rows
    timeout ${GT_S:-200} python3 -m pytest -q -p no:randomly -m gpu -n 8 tests/test_mla_balanced.py \
      > "$OUT/balanced_gpu.log" 2>&1
    tail -3 "$OUT/balanced_gpu.log"
    timeout ${MB_S:-200} python3 benchmarks/mla_balanced.py --split \
      --rows uniform64=64x4096,uniform128=128x8192,skew32k=1x32768+63x1024,mixed=16x8192+48x2048,small=32x1024 \
      --tunings '[{}, {"balanced": true}, {"balanced": true, "pdl": true}, {"pdl": true}]' 2>&1 \
      | tee "$OUT/mla_balanced.log"
    ;;
  seventyeighth|seventyeighth-rows)
    # the narrow kernel with its first two tiles issued before q is staged, and its split
    # merge launched early (PDL): its gpu tests; then the 16-head rows against OLD (the
    # previous kernel: a snapshot directory), alternating; the time split of both
    # (seventyeighth-rows: the rows and time split only)
    if [ "$1" = seventyeighth ]; then
      gpu_tests narrow_tests.log ${GT_S:-200} 120 tests/test_triton_mla.py -k "narrow or ring"
      gpu_tests narrow_more.log ${GU_S:-150} 120 tests/test_hunt_fp16_gluon.py \
        tests/test_mla_half_partials.py
    fi
    for i in ${ROUNDS:-1 2}; do
      if [ -n "${OLD:-}" ]; then
        (cd "$OLD" && timeout ${BA_S:-100} python3 benchmarks/bench_attention.py --only mla \
          --rep 30 --anchors "" --mla-kv bf16 --mla-rows 16x64x4096,16x128x8192 \
          --mla-variants narrow --out "$OUT/old$i" > "$OUT/old$i.log" 2>&1)
        grep -E "ours|==|Error|error|ceilings" "$OUT/old$i.log" | head -8
      fi
      timeout ${BB_S:-150} python3 benchmarks/bench_attention.py --only mla --rep 30 \
        --anchors "" --mla-kv bf16 --mla-rows 16x64x4096,16x128x8192 \
        --mla-variants ${NEW_VARIANTS:-narrow,narrow-pdl,narrow-pdl-all} --out "$OUT/new$i" \
        > "$OUT/new$i.log" 2>&1
      grep -E "ours|==|Error|error|ceilings" "$OUT/new$i.log" | head -12
      if [ "$i" = 1 ]; then
        timeout ${TS_S:-100} python3 benchmarks/mla_time_split.py --rows 16x64x4096 \
          --splits 0 --floor --tunings '[{}, {"narrow": true, "pdl": false}, {"narrow": false}]' \
          2>&1 | tee "$OUT/time_split_new.log" | tail -5
        if [ -n "${OLD:-}" ]; then
          (cd "$OLD" && timeout ${TS_S:-100} python3 benchmarks/mla_time_split.py \
            --rows 16x64x4096 --splits 0 --floor --tunings '[{"narrow": true}]' 2>&1 \
            | tee "$OUT/time_split_old.log" | tail -4)
        fi
      fi
    done
    rm -f "$OUT"/*/*.png
    ;;
  eightieth)
    # with the narrow kernel the 16-head default: the Triton-option gpu tests (they pin the
    # Triton kernel), both graph replays; on an H200 the rows beside OLD's narrow kernel
    gpu_tests triton_option_tests.log ${GT_S:-300} 150 tests/test_mla_qk_split.py \
      tests/test_mla_kv_desc.py tests/test_mla_half_partials.py tests/test_mla_lazy_rescale.py \
      tests/test_mla_fused_merge.py tests/test_triton_mla.py
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
      NEW_VARIANTS=triton,narrow-no-pdl,narrow-pdl-all ROUNDS="1 2" bash "$0" seventyeighth-rows
    fi
    ;;
  ninetythird)
    # pdl="early": the narrow kernel starts early and issues its first tiles of older keys
    # before its wait (here during the previous step's merge): the race tests alone (their
    # window is timed), the other gpu tests, then the 16-head rows twice, and the time split
    nvidia-smi --query-gpu=name --format=csv,noheader
    early_tests ${EK_S:-200} tests/test_mla_early_keys.py
    gpu_tests narrow_tests.log ${GT_S:-200} 150 tests/test_triton_mla.py -k "narrow" \
      tests/test_mla_narrow_default.py tests/test_gluon_decode.py
    for i in 1 2; do mla16_rows rows$i "${VARIANTS:-narrow-early,narrow-pdl-all}"; done
    timeout ${TS_S:-100} python3 benchmarks/mla_time_split.py --rows 16x64x4096 \
      --splits 0 --floor --tunings '[{}, {"pdl": "early"}]' 2>&1 \
      | tee "$OUT/time_split.log" | tail -6
    rm -f "$OUT"/*/*.png
    ;;
  h200rows)
    # item 4's figure: the 16-head rows twice, on an H200 only (any other card stops at once,
    # so a call that gets an H100 costs seconds, not the rows)
    n=$(nvidia-smi --query-gpu=name --format=csv,noheader)
    echo "$n"
    case "$n" in *H200*) ;; *) exit 3 ;; esac
    for i in 1 2; do mla16_rows rows$i "${VARIANTS:-narrow-pdl}"; done
    timelines "--writer" '{"pdl": "reduce"}' '{"pdl": "early"}'
    rm -f "$OUT"/*/*.png "$OUT"/rows2/*
    ;;
  hundredfirst)
    # the rows first (item 4 needs an H200 figure), then the gpu tests of 4823aa9's shared
    # tile step (_attend_tile, _load_q, the stream kernel's wait): race tests alone, then
    # every MLA, stream and Gluon gpu test file
    nvidia-smi --query-gpu=name --format=csv,noheader
    for i in 1 2; do mla16_rows rows$i "${VARIANTS:-narrow-pdl}"; done
    early_tests ${EK_S:-60} tests/test_mla_early_keys.py tests/test_kv_write_sm90.py
    gpu_tests mla_tests.log ${GT_S:-300} 200 $(ls tests/test_*mla*.py | grep -v early_keys) \
      tests/test_stream_sm90.py tests/test_gluon_decode.py tests/test_gluon_sm90.py \
      tests/test_hunt_fp16_gluon.py
    rm -f "$OUT"/*/*.png "$OUT"/rows2/*
    ;;
  hundredth)
    # the rows first (an H200 is what item 4 needs), then ninetyninth's checks
    nvidia-smi --query-gpu=name --format=csv,noheader
    for i in 1 2; do mla16_rows rows$i "${VARIANTS:-narrow-pdl}"; done
    early_tests ${EK_S:-60} tests/test_mla_early_keys.py tests/test_kv_write_sm90.py
    timelines "--writer" '{"pdl": "reduce"}' '{"pdl": "early"}'
    rm -f "$OUT"/*/*.png "$OUT"/rows2/*
    ;;
  ninetyninth)
    # our K/V write now signals its dependents at its start: the early-keys tests (with the
    # real write before the default launch) and the write's gpu tests, then the timeline
    # of the three PDL modes behind that write (an engine's decode step), then the rows
    nvidia-smi --query-gpu=name --format=csv,noheader
    early_tests ${EK_S:-100} tests/test_mla_early_keys.py
    gpu_tests write_tests.log ${GT_S:-120} 150 $(ls tests/test_*write*.py) tests/test_pdl.py
    timelines "--writer" '{"pdl": "reduce"}' '{"pdl": "early"}' '{"pdl": true}'
    mla16_rows rows "${VARIANTS:-narrow-pdl}"
    rm -f "$OUT"/*/*.png
    ;;
  ninetyeighth)
    # q's L2 prefetch now ahead of the first tiles: the race tests, the timeline of
    # "early" and "reduce" with the steps back to back and with a torch kernel between
    # them (it does not signal early, as an engine's K/V write), then the rows
    nvidia-smi --query-gpu=name --format=csv,noheader
    early_tests ${EK_S:-100} tests/test_mla_early_keys.py
    for f in "" --fence; do
      timelines "$f" '{"pdl": "reduce"}' '{"pdl": "early"}' '{"pdl": true}'
    done
    mla16_rows rows "${VARIANTS:-narrow-pdl}"
    rm -f "$OUT"/*/*.png
    ;;
  ninetyseventh)
    # what the ninetysixth call's 300 s left: the MLA gpu test files in reverse order, the
    # graph and CUDA-verify tests of MLA, then the 16-head rows beside "reduce" once more
    nvidia-smi --query-gpu=name --format=csv,noheader
    gpu_tests mla_tests_rev.log ${GT_S:-330} 200 \
      $(ls tests/test_*mla*.py tests/test_hunt_fp16_gluon.py | grep -v early_keys | sort -r)
    gpu_tests mla_graph_tests.log ${GG_S:-120} 200 tests/test_graph_gpu.py \
      tests/test_conformance_contract.py -k "mla"
    mla16_rows rows "${VARIANTS:-narrow-pdl}"
    rm -f "$OUT"/*/*.png
    ;;
  ninetysixth)
    # pdl="early" the narrow kernel's default: every MLA gpu test file (the race tests
    # alone first), then the 16-head rows twice beside "reduce" (the previous default)
    nvidia-smi --query-gpu=name --format=csv,noheader
    early_tests ${EK_S:-100} tests/test_mla_early_keys.py
    gpu_tests mla_tests.log ${GT_S:-300} 200 $(ls tests/test_*mla*.py | grep -v early_keys) \
      tests/test_hunt_fp16_gluon.py tests/test_narrow_timeline.py
    for i in 1 2; do mla16_rows rows$i "${VARIANTS:-narrow-pdl}"; done
    rm -f "$OUT"/*/*.png "$OUT"/rows2/*
    ;;
  ninetyfifth)
    # pdl="early" with q prefetched to L2 before the wait and the merge releasing the next
    # launch first: its gpu tests (race tests alone first), the timeline of the three PDL
    # modes, then the 16-head rows twice
    nvidia-smi --query-gpu=name --format=csv,noheader
    early_tests ${EK_S:-150} tests/test_mla_early_keys.py tests/test_narrow_timeline.py
    gpu_tests narrow_tests.log ${GT_S:-150} 150 tests/test_triton_mla.py -k "narrow" \
      tests/test_mla_narrow_default.py
    timelines "" '{}' '{"pdl": "early"}'
    for i in 1 2; do mla16_rows rows$i "${VARIANTS:-narrow-early}"; done
    rm -f "$OUT"/*/*.png "$OUT"/rows2/*
    ;;
  ninetyfourth)
    # the race tests again (fixed; one replayed in a CUDA graph), then where the step's time
    # goes with and without pdl="early" (the timeline now stamps each program's start
    # before its PDL wait)
    nvidia-smi --query-gpu=name --format=csv,noheader
    early_tests ${EK_S:-200} tests/test_mla_early_keys.py tests/test_narrow_timeline.py
    timelines "" '{}' '{"pdl": "early"}' '{"pdl": true}'
    ;;
  ninetyfirst)
    # one request a program: the stream kernel (128 / 132 programs, one segment each, no
    # partials) beside the narrow kernel (one split a request) on the same keys a program,
    # to tell its per-tile stream from its request crossings
    nvidia-smi --query-gpu=name --format=csv,noheader
    V='default={}@64;stream 128={"stream": 128}@64;stream 132={"stream": 132}@64'
    V="$V"';default p16={}@16;stream 128 p16={"stream": 128}@16'
    timeout ${SP_S:-150} python3 benchmarks/stream_probe.py --rows 16x128x4096 \
      --programs 128 --variants "$V" 2>&1 | tee "$OUT/stream_probe.log"
    timeout ${SP2_S:-90} python3 benchmarks/stream_probe.py --rows 16x132x4096 \
      --programs 132 --variants 'default={}@64;stream 132={"stream": 132}@64' 2>&1 \
      | tee -a "$OUT/stream_probe.log"
    timeout ${NT_S:-90} python3 benchmarks/narrow_timeline.py --rows 16x128x4096,16x132x4096 \
      2>&1 | tee "$OUT/narrow_timeline.log"
    ;;
  ninetieth)
    # why the stream kernel streams slower than the narrow kernel (eightyninth, H100: step
    # 124 against 107 us; 66 programs stream nearly as fast as 132, so a chip-wide limit):
    # Nsight Compute of both 64x4k launches, stalls by SASS line, memory tables
    nvidia-smi --query-gpu=name --format=csv,noheader
    for c in mla16 mla16-stream; do
      timeout ${NCU_S:-150} ncu --clock-control none --profile-from-start off --nvtx \
        --target-processes all -k regex:mla_kernel --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
        --section MemoryWorkloadAnalysis_Tables --section WarpStateStats \
        --section SchedulerStats --section InstructionStats --section SourceCounters \
        -f -o "$OUT/$c" python3 benchmarks/ncu_kernels.py --cases $c > "$OUT/ncu_$c.log" 2>&1
      tail -2 "$OUT/ncu_$c.log"
      ncu --import "$OUT/$c.ncu-rep" --print-summary none > "$OUT/details_$c.txt" 2>&1
      grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Memory Throughput|L2 Hit|L1/TEX Hit|Warp Cycles Per Issued|Issue Slots|Executed Ipc|Registers Per|Stall|Local" \
        "$OUT/details_$c.txt" | head -24
      ncu --import "$OUT/$c.ncu-rep" --page source --csv --print-source sass \
        > "$OUT/sass_$c.csv" 2>/dev/null
      python3 benchmarks/ncu_source_summary.py "$OUT/sass_$c.csv"
      rm -f "$OUT/$c.ncu-rep"
    done
    ;;
  eightyninth)
    # the stream kernel's spill-free build (48 bytes of ptxas stack against 1.7 KB: its
    # wgmma descriptors no longer constant, a writer warp, one flat loop): its gpu tests,
    # its step by program count and beside the default's, then the 16-head rows (on an
    # H200 the default ran 64x4k at 3.87 TB/s; the target is 3.9)
    nvidia-smi --query-gpu=name --format=csv,noheader
    gpu_tests stream_tests.log ${GT_S:-200} 150 tests/test_mla_stream.py
    timeout ${SP_S:-120} python3 benchmarks/stream_probe.py --rows 16x64x4096 \
      --programs ${SP_P:-132,128,66} --compare 2>&1 | tee "$OUT/stream_probe.log"
    timeout ${BB_S:-150} python3 benchmarks/bench_attention.py --only mla --rep 30 \
      --anchors "" --mla-kv bf16 --mla-rows 16x64x4096,16x128x8192 --out "$OUT/rows" \
      --mla-variants stream,stream-sm,stream-own-sm > "$OUT/rows.log" 2>&1
    grep -E "ours|rates|Error|error|ceilings" "$OUT/rows.log" | head -12
    rm -f "$OUT"/*/*.png
    ;;
  eightyeighth)
    # the stream kernel as one flat tile loop a consumer (1.7 KB of spills -> 100 bytes in
    # the sm_90 build): its gpu tests, its step beside the default's, then the rows
    nvidia-smi --query-gpu=name --format=csv,noheader
    gpu_tests stream_tests.log ${GT_S:-200} 150 tests/test_mla_stream.py
    timeout ${SP_S:-90} python3 benchmarks/stream_probe.py --rows 16x64x4096 \
      --programs ${SP_P:-132} --compare 2>&1 | tee "$OUT/stream_probe.log"
    timeout ${BB_S:-150} python3 benchmarks/bench_attention.py --only mla --rep 30 \
      --anchors "" --mla-kv bf16 --mla-rows 16x64x4096,16x128x8192 --out "$OUT/rows" \
      --mla-variants stream,stream-sm > "$OUT/rows.log" 2>&1
    grep -E "ours|rates|Error|error|ceilings" "$OUT/rows.log" | head -12
    rm -f "$OUT"/*/*.png
    ;;
  eightyseventh)
    # why the stream kernel's step took twice the narrow kernel's (sixtieth call: 64x4k
    # 0.233 ms against 0.110 on an H100): its slots' stamps by program count (a second
    # wave shows as late entries), then its gpu tests again (stamps in the signature)
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout ${SP_S:-150} python3 benchmarks/stream_probe.py --rows 16x64x4096 \
      --programs ${SP_P:-132,128,124,100,66} ${SP_ARGS:-} 2>&1 | tee "$OUT/stream_probe.log"
    gpu_tests stream_tests.log ${GT_S:-200} 150 tests/test_mla_stream.py
    ;;
  eightysixth)
    # the persistent stream kernel: one program per SM over shares of the batch's keys
    # crossing requests (equal, or weighed by each SM's measured rate): its gpu tests and
    # the balanced launch's SM claims, then the rows beside the default (narrow kernel)
    nvidia-smi --query-gpu=name --format=csv,noheader
    gpu_tests stream_tests.log ${GT_S:-240} 150 tests/test_mla_stream.py tests/test_mla_shares.py
    timeout ${BB_S:-150} python3 benchmarks/bench_attention.py --only mla --rep 30 \
      --anchors "" --mla-kv bf16 --mla-rows 16x64x4096,16x128x8192 --out "$OUT/rows" \
      --mla-variants stream,stream-sm > "$OUT/rows.log" 2>&1
    grep -E "ours|rates|Error|error|ceilings" "$OUT/rows.log" | head -12
    rm -f "$OUT"/*/*.png
    ;;
  eightyfifth)
    # the 64x4k step's SM structure on this card: every program's stamps, summarised by SM
    # (by_sm: the SMs' spread against one SM's, the balanced stream, the stealing bound),
    # then the 16-head rows beside it (the H200's 3.87 came with copy 4.25)
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout ${NT_S:-90} python3 benchmarks/narrow_timeline.py --rows 16x64x4096,16x128x8192 \
      --programs "$OUT/programs.jsonl" 2>&1 | tee "$OUT/narrow_timeline.log"
    python3 benchmarks/narrow_timeline.py --by-sm "$OUT/programs.jsonl" | tee "$OUT/by_sm.log"
    gzip -9 "$OUT/programs.jsonl"
    # the balanced launch with its slots weighed by those rates (programs claiming their
    # SM's slot): its gpu tests, then its rows beside the plain balanced launch and the
    # default (does weighing by SM recover the tail the timeline shows?)
    gpu_tests shares_tests.log ${GT_S:-120} 100 tests/test_mla_shares.py
    timeout ${BB_S:-150} python3 benchmarks/bench_attention.py --only mla --rep 30 \
      --anchors "" --mla-kv bf16 --mla-rows 16x64x4096,16x128x8192 --out "$OUT/rows" \
      --mla-variants balanced,balanced-planned,balanced-sm > "$OUT/rows.log" 2>&1
    grep -E "ours|rates|Error|error|ceilings" "$OUT/rows.log" | head -12
    rm -f "$OUT"/*/*.png
    ;;
  eightyfourth)
    # where the narrow kernel's step goes, program by program (global-timer stamps): its
    # gpu tests with the stamps argument in the signature, then the timeline of the two
    # 16-head rows (narrow_timeline.py) and the rows themselves
    gpu_tests narrow_tests.log ${GT_S:-150} 120 tests/test_triton_mla.py tests/test_narrow_timeline.py \
      tests/test_mla_narrow_default.py -k "narrow or Narrow or graph or timeline"
    timeout ${NT_S:-120} python3 benchmarks/narrow_timeline.py --rows 16x64x4096,16x128x8192 \
      2>&1 | tee "$OUT/narrow_timeline.log"
    # the fused merge (its reads of the partials now all before its stores) beside the
    # default's merge launch, alternating, and both time splits
    for r in 1 2; do
      timeout ${BB_S:-100} python3 benchmarks/bench_attention.py --only mla --rep 30 \
        --anchors "" --mla-kv bf16 --mla-rows 16x64x4096,16x128x8192 \
        --mla-variants narrow,narrow-fused,narrow-fused-pdl --out "$OUT/rows$r" \
        > "$OUT/rows$r.log" 2>&1
      grep -E "ours|Error|error|ceilings" "$OUT/rows$r.log" | head -8
    done
    timeout ${TS_S:-90} python3 benchmarks/mla_time_split.py --rows 16x64x4096 --splits 0 \
      --floor --tunings '[{}, {"fused_merge": true}, {"fused_merge": true, "pdl": true}]' \
      > "$OUT/time_split.log" 2>&1
    tail -12 "$OUT/time_split.log"
    # host µs per 16-head MLA layer call, with the plan's interned launch-key specs and
    # with every call's key built from its arguments
    (cd benchmarks && timeout ${HM_S:-90} python3 -c "import _host, torch; print(_host.host_table(
      _host.host_mla(torch.device('cuda'), torch.bfloat16, 2000, 5, False)))") 2>&1 \
      | tee "$OUT/host_mla.log"
    rm -f "$OUT"/*/*.png
    ;;
  eightythird)
    # every gpu test of the MLA kernel files; then the 16-head rows of OLD and MID (snapshot
    # directories: on 2026-12-06 main and the interleaved splits, with this tree the
    # two-halves epilogue of branch wip/narrow-interleaved) and this tree, alternating
    gpu_tests mla_tests.log ${GT_S:-240} 120 tests/test_triton_mla.py tests/test_mla_balanced.py \
      tests/test_hunt_mla_half_default.py tests/test_mla_fused_merge.py \
      tests/test_hunt_fp16_gluon.py tests/test_mla_narrow_default.py
    for i in ${ROUNDS:-1 2}; do
      for d in ${OLD:-} ${MID:-}; do
        n=$(basename "$d")
        (cd "$d" && timeout ${BA_S:-100} python3 benchmarks/bench_attention.py --only mla \
          --rep 30 --anchors "" --mla-kv bf16 --mla-rows 16x64x4096,16x128x8192 \
          --out "$OUT/$n$i" > "$OUT/$n$i.log" 2>&1)
        echo "== $n round $i"
        grep -E "ours|Error|error|ceilings" "$OUT/$n$i.log" | head -6
      done
      timeout ${BB_S:-120} python3 benchmarks/bench_attention.py --only mla --rep 30 \
        --anchors "" --mla-kv bf16 --mla-rows 16x64x4096,16x128x8192 \
        --mla-variants ${NEW_VARIANTS:-triton} --out "$OUT/new$i" > "$OUT/new$i.log" 2>&1
      echo "== new round $i"
      grep -E "ours|Error|error|ceilings" "$OUT/new$i.log" | head -8
    done
    timeout ${TS_S:-80} python3 benchmarks/mla_time_split.py --rows 16x64x4096 --splits 0 \
      --floor --tunings '[{}]' 2>&1 | tee "$OUT/time_split_new.log" | tail -3
    rm -f "$OUT"/*/*.png
    ;;
  seventyninth)
    # every MLA gpu test with the narrow kernel as the 16-head default (before the flip)
    AITER_ATTN_TEST_MLA_DEFAULTS="{\"narrow\": true}" \
      gpu_tests mla_narrow_default_tests.log ${GT_S:-420} 150 tests -k "mla or MLA"
    ;;
  seventyfourth)
    # the balanced MLA launch after its merge was unrolled: gpu tests (LSE out included),
    # the time split of both launches beside the split launch's, rows
    timeout ${GT_S:-200} python3 -m pytest -q -p no:randomly -m gpu -n 8 tests/test_mla_balanced.py \
      > "$OUT/balanced_gpu.log" 2>&1
    tail -4 "$OUT/balanced_gpu.log"
    timeout ${MB_S:-150} python3 benchmarks/mla_balanced.py --split \
      --rows uniform64=64x4096,uniform128=128x8192,skew32k=1x32768+63x1024,mixed=16x8192+48x2048 \
      --tunings '[{}, {"balanced": true}, {"balanced": true, "half_partials": false}]' 2>&1 \
      | tee "$OUT/mla_balanced.log"
    timeout ${TS_S:-100} python3 benchmarks/mla_time_split.py --rows 16x64x4096,16x128x8192 \
      --splits 0 2>&1 | tee "$OUT/mla_time_split.log" | tail -3
    timeout ${BA_S:-150} python3 benchmarks/bench_attention.py --only mla --rep 30 \
      --anchors "" --mla-kv bf16 --mla-rows 16x64x4096,16x128x8192 \
      --mla-variants balanced --out "$OUT/mla1" > "$OUT/mla1.log" 2>&1
    grep -E "ours|==|Error|error|ceilings" "$OUT/mla1.log" | head -12
    rm -f "$OUT"/*/*.png
    ;;
  seventythird)
    # the balanced MLA launch (mla_balanced.py: equal key tiles a program, all the SMs'
    # slots): its gpu tests and the MLA gpu tests with it as the default; the 16-head rows
    # beside the default and narrow, twice; uniform and skewed batches
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
      echo "== H200"
    fi
    timeout ${GT_S:-200} python3 -m pytest -q -p no:randomly -m gpu -n 8 tests/test_mla_balanced.py \
      > "$OUT/balanced_gpu.log" 2>&1
    tail -4 "$OUT/balanced_gpu.log"
    AITER_ATTN_TEST_MLA_DEFAULTS="{\"balanced\": true}" timeout ${GT2_S:-200} python3 -m pytest \
      -q -p no:randomly -m gpu -n 8 tests/test_triton_mla.py tests/test_hunt_mla_half_default.py \
      > "$OUT/balanced_default_gpu.log" 2>&1
    tail -4 "$OUT/balanced_default_gpu.log"
    for i in 1 2; do
      timeout ${BA_S:-150} python3 benchmarks/bench_attention.py --only mla --rep 30 \
        --anchors "" --mla-kv bf16 --mla-rows 16x64x4096,16x128x8192 \
        --mla-variants balanced,balanced-f32,narrow --out "$OUT/mla$i" > "$OUT/mla$i.log" 2>&1
      grep -E "ours|==|Error|error|ceilings" "$OUT/mla$i.log" | head -12
    done
    timeout ${MB_S:-150} python3 benchmarks/mla_balanced.py \
      --tunings '[{}, {"balanced": true}, {"narrow": true}]' 2>&1 | tee "$OUT/mla_balanced.log"
    rm -f "$OUT"/*/*.png
    ;;
  seventysecond)
    # on an H200, issue 14 item 4 first (the seventyfirst call); on any card: whether the
    # 64x4k step loses to the 8 empty program slots of its 256-program wave (two programs per
    # SM over 132 SMs: 60, 64, 66 requests give 240, 256, 264 programs at four splits), then
    # the fp16 clamps of the Gluon kernels, the merge and the cascade kernels (gpu tests)
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
      bash "$0" seventyfirst
    fi
    timeout ${BA_S:-150} python3 benchmarks/bench_attention.py --only mla --rep 30 \
      --anchors "" --mla-kv bf16 --mla-rows 16x60x4096,16x64x4096,16x66x4096 \
      --mla-variants narrow --out "$OUT/wave" > "$OUT/wave.log" 2>&1
    grep -E "ours|==|Error|error|ceilings" "$OUT/wave.log" | head -12
    timeout ${TS_S:-120} python3 benchmarks/mla_time_split.py --rows 16x60x4096,16x64x4096,16x66x4096 \
      --splits 0 2>&1 | tee "$OUT/wave_time_split.log" | tail -4
    timeout ${GT_S:-240} python3 -m pytest -q -p no:randomly -m gpu -n 4 \
      tests/test_hunt_fp16_gluon.py tests/test_hunt_fp16_range.py tests/test_hunt_fp16_merge.py \
      tests/test_hunt_fp8_nan_write.py tests/test_fp8_formats.py \
      > "$OUT/fp16_gpu.log" 2>&1
    tail -15 "$OUT/fp16_gpu.log"
    rm -f "$OUT"/*/*.png
    ;;
  seventyfirst)
    # issue 14 item 4 on the H200 (3.9 TB/s at 64x4k): the default (16-bit partials since the
    # twenty-fourth session, merged split by split) beside float32 partials and the narrow
    # kernel, two runs; then where the step's time goes, with empty launches on the same timer
    for i in 1 2; do
      timeout ${BA_S:-150} python3 benchmarks/bench_attention.py --only mla --rep 30 \
        --anchors "" --mla-kv bf16 --mla-rows 16x64x4096,16x128x8192 \
        --mla-variants f32-partials,narrow,narrow-f32 \
        --out "$OUT/mla$i" > "$OUT/mla$i.log" 2>&1
      grep -E "ours|==|Error|error|ceilings" "$OUT/mla$i.log" | head -12
    done
    timeout ${TS_S:-150} python3 benchmarks/mla_time_split.py --rows 16x64x4096 --splits 0 \
      --floor --merge-fixed \
      --tunings '[{}, {"half_partials": false}, {"narrow": true}]' 2>&1 \
      | tee "$OUT/mla_time_split.log" | tail -6
    rm -f "$OUT"/*/*.png
    ;;
  sixtysixth)
    # the 64x4k 16-head row with the options, alone and together (the descriptor ones last:
    # they never ran on a GPU, and a fault would end the process); the step's time split.
    # 128x8k and 64x2k for the best of them: sixtyeighth
    timeout ${BA_S:-330} python3 benchmarks/bench_attention.py --only mla --rep 30 \
      --anchors "" --mla-kv bf16 --mla-rows 16x64x4096 \
      --mla-variants split4,lazy-half-split4,lazy-half-split4-fused,half,half-fused,split2,half-split2,narrow,narrow-half,desc-lazy,desc-lazy-half,desc-lazy-half-split2,ring \
      --out "$OUT/mla" > "$OUT/mla.log" 2>&1
    grep -E "ours|==|Error|error" "$OUT/mla.log" | head -40
    timeout ${TS_S:-200} python3 benchmarks/mla_time_split.py --rows 16x64x4096 --splits 0 \
      --tunings '[{}, {"half_partials": true}, {"qk_split": 4}, {"lazy_rescale": true, "half_partials": true, "qk_split": 4}, {"half_partials": true, "fused_merge": true}, {"qk_split": 2}, {"kv_desc": true, "lazy_rescale": true, "half_partials": true, "qk_split": 2}]' 2>&1 \
      | tee "$OUT/mla_time_split.log" | tail -12
    rm -f "$OUT"/*/*.png
    ;;
  seventieth)
    # the ring Gluon kernel with its operands read by ldmatrix (k_width 2; 52 conflicted
    # ld.shared.v4 before): its gpu tests, its 64x4k row, and ncu's bank-conflict counters
    gpu_tests ring_tests.log ${GT_S:-150} 90 tests/test_triton_mla.py::test_gpu_ring_gluon_mla
    timeout ${BA_S:-150} python3 benchmarks/bench_attention.py --only mla --rep 30 \
      --anchors "" --mla-kv bf16 --mla-rows 16x64x4096 --mla-variants ring,narrow \
      --out "$OUT/mla_ring" > "$OUT/mla_ring.log" 2>&1
    grep -E "ours|==|Error|error" "$OUT/mla_ring.log" | head -10
    timeout ${NCU_S:-150} ncu --clock-control none --profile-from-start off --nvtx \
      --target-processes all --section SpeedOfLight --section WarpStateStats --metrics \
smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum \
      python3 benchmarks/ncu_kernels.py --cases mla16-ring > "$OUT/ncu_ring.log" 2>&1
    grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Warp Cycles Per Issued|smsp__inst|bank_conf|wavefronts" \
      "$OUT/ncu_ring.log" | head -20
    ;;
  sixtyninth)
    # every MLA gpu test with candidate defaults (MLA_DEFAULTS: JSON of the options, e.g.
    # {"kv_desc": true, "lazy_rescale": true, "half_partials": true, "qk_split": 2}),
    # before the library flips them
    AITER_ATTN_TEST_MLA_DEFAULTS="${MLA_DEFAULTS:-{\"kv_desc\": true, \"lazy_rescale\": true, \"half_partials\": true, \"qk_split\": 2\}}" \
      gpu_tests mla_candidate_tests.log ${GT_S:-400} 150 tests -k "mla or MLA"
    ;;
  sixtyeighth)
    # the candidates at 128x8k and 64x2k (a flipped default must hold 128x8k), then the
    # remaining descriptor variants at 64x4k
    timeout ${BA_S:-330} python3 benchmarks/bench_attention.py --only mla --rep 30 \
      --anchors "" --mla-kv bf16 --mla-rows 16x128x8192,16x64x2048 \
      --mla-variants ${MLA_VARIANTS:-split4,lazy-half-split4,lazy-half-split4-fused,half-fused,half-split2,narrow,desc-lazy-half-split2} \
      --out "$OUT/mla" > "$OUT/mla.log" 2>&1
    grep -E "ours|==|Error|error" "$OUT/mla.log" | head -30
    timeout ${BB_S:-200} python3 benchmarks/bench_attention.py --only mla --rep 30 \
      --anchors "" --mla-kv bf16 --mla-rows 16x64x4096 \
      --mla-variants desc,lazy,desc-lazy-64w8,desc-coop \
      --out "$OUT/mla_rest" > "$OUT/mla_rest.log" 2>&1
    grep -E "ours|==|Error|error" "$OUT/mla_rest.log" | head -30
    rm -f "$OUT"/*/*.png
    ;;
  sixtyfifth)
    timeout 100 python3 -m pytest -m gpu -q --timeout 60 tests/test_mla_fused_merge.py \
      -k "cooperative" -x -p no:cacheprovider -p no:warnings --tb=short > "$OUT/coop_tests.log" 2>&1
    grep -E "FAILED|ERROR| passed| failed|Timeout" "$OUT/coop_tests.log" | tail -15
    gpu_tests mla_fused_tests.log ${GT_S:-100} 60 tests/test_mla_fused_merge.py
    timeout ${BA_S:-150} python3 benchmarks/bench_attention.py --only mla --rep 30 \
      --anchors "" --mla-kv bf16 --mla-rows 16x64x4096,16x128x8192 \
      --mla-variants coop,fused,narrow --out "$OUT/mla" > "$OUT/mla.log" 2>&1
    grep -E "ours|==|Error|error" "$OUT/mla.log" | head -20
    timeout ${TS_S:-120} python3 benchmarks/mla_time_split.py --rows 16x64x4096 --splits 0,2,8 \
      --tunings '[{}, {"fused_merge": "cooperative"}]' 2>&1 | tee "$OUT/mla_time_split.log" | tail -20
    rm -f "$OUT"/*/*.png
    ;;
  sixtyfourth)
    gpu_tests mla_fused_tests.log ${GT_S:-110} 80 tests/test_mla_fused_merge.py \
      tests/test_triton_mla.py -k "fused or narrow or graph"
    ;;
  sixtythird)
    gpu_tests mla_all_tests.log ${GT_S:-200} 150 tests -k "mla or MLA"
    ;;
  sixtysecond)
    gpu_tests mla_all_tests.log ${GT_S:-260} 150 tests -k "mla or MLA"
    timeout ${BA_S:-170} python3 benchmarks/bench_attention.py --only mla --rep 30 \
      --anchors "" --mla-kv bf16 --mla-variants narrow,narrow-fused,fused,ring --out "$OUT/mla" \
      > "$OUT/mla.log" 2>&1
    grep -E "ours|==|Error|error" "$OUT/mla.log" | head -40
    rm -f "$OUT"/*/*.png
    ;;
  sixtyfirst)
    gpu_tests mla_narrow_tests.log ${GT_S:-150} 80 tests/test_triton_mla.py \
      -k "narrow or gluon_mla or one_query or token_t"
    timeout ${BA_S:-150} python3 benchmarks/bench_attention.py --only mla --rep 30 \
      --anchors "" --mla-kv bf16 --mla-rows 16x64x4096,16x128x8192,16x64x2048 \
      --mla-variants narrow,narrow-fused --out "$OUT/mla" > "$OUT/mla.log" 2>&1
    grep -E "ours|==|Error|error" "$OUT/mla.log" | head -20
    rm -f "$OUT"/*/*.png
    ;;
  sixtieth)
    timeout ${NCU_S:-200} ncu --clock-control none --profile-from-start off --nvtx \
      --target-processes all --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section SourceCounters -f -o "$OUT/ring" \
      python3 benchmarks/ncu_kernels.py --cases mla16-ring > "$OUT/ncu.log" 2>&1
    [ -n "${RING_BENCH:-}" ] && OUT=$OUT bash scripts/gpu_session.sh fiftyninth
    ncu --import "$OUT/ring.ncu-rep" --print-summary none > "$OUT/ncu_ring.txt" 2>&1
    grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Dynamic Shared|Block Limit|Stall|stall" \
      "$OUT/ncu_ring.txt" | head -40
    ncu --import "$OUT/ring.ncu-rep" --page source --csv --print-source sass \
      > "$OUT/ring_sass.csv" 2>/dev/null
    python3 benchmarks/ncu_source_summary.py "$OUT/ring_sass.csv" --lines 0
    rm -f "$OUT"/*.ncu-rep
    ;;
  fiftyninth)
    gpu_tests mla_ring_tests.log ${GT_S:-120} 80 tests/test_triton_mla.py -k "ring"
    timeout ${BA_S:-150} python3 benchmarks/bench_attention.py --only mla --rep 30 \
      --anchors "" --mla-kv bf16 --mla-rows 16x64x4096,16x128x8192,16x64x1024 \
      --mla-variants ring,narrow --out "$OUT/mla" > "$OUT/mla.log" 2>&1
    grep -E "ours|==|Error|error" "$OUT/mla.log" | head -20
    rm -f "$OUT"/*/*.png
    ;;
  fiftyeighth)
    gpu_tests mla_narrow_tests.log ${GT_S:-120} 80 tests/test_triton_mla.py -k "narrow or l2"
    timeout ${BA_S:-120} python3 benchmarks/bench_attention.py --only mla --rep 30 \
      --anchors "" --mla-kv bf16 --mla-rows 16x64x4096,16x128x8192,16x64x1024 \
      --mla-variants narrow --out "$OUT/mla" > "$OUT/mla.log" 2>&1
    grep -E "ours|==" "$OUT/mla.log" | head -20
    rm -f "$OUT"/*/*.png
    ;;
  fiftyseventh)
    timeout ${MLA_S:-150} python3 benchmarks/bench_attention.py --only mla --rep 30 \
      --anchors "" --mla-rows 16x64x4096 --mla-kv bf16 --mla-sweep --mla-configs \
16/32/4/6/2,16/32/8/6/2,16/32/8/5/2,16/32/4/5/2,16/32/8/4/2,16/32/4/3/auto \
      --out "$OUT/mla" 2>&1 | grep -E "==|ours" | tee "$OUT/mla.log"
    timeout ${NCU_S:-150} ncu --clock-control none --profile-from-start off --nvtx \
      --target-processes all --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats \
      python3 benchmarks/ncu_kernels.py --cases mla16,mla16-narrow > "$OUT/ncu.log" 2>&1
    grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Dynamic Shared|Block Limit" \
      "$OUT/ncu.log" | head -60
    rm -f "$OUT"/*/*.png
    ;;
  fiftysixth)
    # ran on 9f2df7e (the L2 prefetch, since removed): MLA variants l2-2, l2-4, l2-8,
    # l2-16 and narrow, and mla_time_split.py with "l2_ahead" tunings
    echo "fiftysixth needs commit 9f2df7e (the L2 prefetch option)"
    ;;
  fiftyfifth)
    gpu_tests mla_tests.log ${GT_S:-120} 80 tests/test_mla_fused_merge.py tests/test_triton_mla.py
    timeout ${TS_S:-200} python3 benchmarks/mla_time_split.py --rows 16x64x4096,16x64x1024 \
      --splits 0,2,8 --tunings '[{}, {"one_query": false}]' --out "$OUT/split" 2>&1 \
      | tee "$OUT/mla_time_split.log"
    timeout ${TF_S:-60} python3 benchmarks/mla_time_split.py --rows 16x64x4096,16x64x1024 \
      --tunings '[{"fused_merge": true}]' 2>&1 | tee -a "$OUT/mla_time_split.log"
    ;;
  fiftyfourth)
    gpu_tests mla_fused_tests.log ${GT_S:-120} 80 tests/test_mla_fused_merge.py \
      tests/test_triton_mla.py
    timeout ${BA_S:-240} python3 benchmarks/bench_attention.py --only mla --rep 30 \
      --anchors "" --mla-kv bf16 --mla-rows 16x64x4096,16x128x8192,16x64x1024,16x64x2048 \
      --mla-variants fused,fused-pdl,pdl,narrow --out "$OUT/mla" > "$OUT/mla.log" 2>&1
    grep -E "^\| mla" "$OUT/mla.log" | head -40
    rm -f "$OUT"/*/*.png
    ;;
  fiftythird)
    gpu_tests mla_narrow_tests.log ${GT_S:-90} 80 tests/test_triton_mla.py
    timeout ${BA_S:-75} python3 benchmarks/bench_attention.py --only mla --rep 20 \
      --mla-rows 16x64x4096,16x128x8192 \
      --out "$OUT/mla" > "$OUT/mla.log" 2>&1
    grep -E "^\| mla" "$OUT/mla.log" | head -8
    rm -f "$OUT"/*/*.png
    ;;
  fiftysecond)
    gpu_tests gluon_direct_tests.log ${GT_S:-120} 100 tests/test_gluon_decode.py \
      tests/test_direct_launch.py
    timeout ${BA_S:-120} python3 benchmarks/bench_attention.py --only decode --rep 30 \
      --anchors cudnn --out "$OUT/attention" > "$OUT/attention.log" 2>&1
    grep -E "^\| decode" "$OUT/attention.log" | head -20
    rm -f "$OUT"/*/*.png
    ;;
  fiftyfirst)
    gpu_tests spy_tests.log ${GT_S:-240} 150 tests/test_direct_launch.py \
      tests/test_page_ahead.py tests/test_flat_slots.py tests/test_fp8_value_pairs.py \
      tests/test_mla_value_pairs.py tests/test_gluon_decode.py
    ;;
  suite)
    # part K of N of the whole gpu suite (scripts/gpu_suite_part.py: files balanced by test
    # count), one report per test in $OUT/suite_K.xml: `suite 1 2` then `suite 2 2` cover it
    k=${2:-1} n=${3:-2}
    files=$(python3 scripts/gpu_suite_part.py "$k" "$n")
    timeout ${GT_S:-540} python3 -m pytest -m gpu -q -n 8 --timeout ${PER_S:-300} $files \
      -p no:cacheprovider -p no:warnings --tb=short -rfE --junitxml="$OUT/suite_$k.xml" \
      > "$OUT/suite_$k.log" 2>&1
    echo "suite part $k of $n rc=$?"; tail -12 "$OUT/suite_$k.log"
    ;;
  fiftieth)
    gpu_tests gpu_suite.log ${GT_S:-420} 200 tests
    ;;
  fortyninth)
    gpu_tests gluon_default_tests.log ${GT_S:-200} 150 tests/test_gluon_decode.py \
      tests/test_flat_slots.py tests/test_triton_paged_attention.py tests/test_graph_gpu.py \
      tests/test_lse.py tests/test_lse_fused_reduce.py
    timeout ${BA_S:-150} python3 benchmarks/bench_attention.py --only decode --rep 30 \
      --anchors cudnn --out "$OUT/attention" > "$OUT/attention.log" 2>&1
    grep -E "^\| decode" "$OUT/attention.log" | head -20
    rm -f "$OUT"/*/*.png
    gluon_variant bn64.st4.nc2.r128.s0 16x4096,1x4096,1x32768,64x4096,8x65536,256x4096
    ;;
  fortyeighth)
    for V in bn64.st4.nc2.r128.s0 bn128.st3.nc2.r168.s0 bn64.st3.nc2.r80.s00 \
        bn128.st3.nc1.r168.s0 bn128.st2.nc2.r168.s0; do
      gluon_variant "$V" 16x4096,1x4096,1x32768
    done
    ;;
  fortysixth)
    # the Gluon decode kernel (TMA pages, keys as wgmma's M side): its oracle tests, then
    # tile shapes, one and two programs per SM, against the Triton default and cuDNN
    gpu_tests gluon_decode_tests.log ${GT_S:-150} 120 tests/test_gluon_decode.py
    timeout ${GD_S:-300} python3 benchmarks/bench_gluon_decode.py --out "$OUT/gd" --rep 30 \
      --rows 1x4096,16x4096,1x32768,64x4096,8x65536 --variants default,bn64.st4.nc2.r128.s0,\
bn64.st4.nc1.r128.s0,bn64.st2.nc2.r80.s00,bn64.st6.nc2.r128.s0,bn64.st4.nc2.r128.s1 \
      2>&1 | tail -8 | tee "$OUT/gluon_decode.log"
    ;;
  fortyfifth)
    # fewer warps per program, more programs per SM: 2 warps on 64-key tiles (211-215
    # registers, 72 KB: three per SM), 1 warp on 32-key tiles (204-207, 21-37 KB)
    W2=num_warps=2+block_n=64+page_chunk=0+page_ahead=true
    W1=num_warps=1+block_n=32+page_chunk=0+page_ahead=true
    timeout ${SB_S:-200} python3 benchmarks/bench_variants.py --out "$OUT/warps" --rep 30 \
      --rows 16x4096,1x32768,1x4096,8x65536 --variants planned,planned-ov:$W2,\
planned-ov:$W2+waves=3,planned-ov:$W2+waves=3+flat_slots=true,planned-ov:$W1+waves=3,\
planned-ov:$W1+waves=5 2>&1 | tail -6 | tee "$OUT/warps.log"
    ;;
  thirtyfourth)
    # the gpu test files the thirteenth session's other calls did not run (after the
    # bt_width move, the fp8 value-pairs and one-wave defaults)
    gpu_tests gpu_tests_rest.log ${GT_S:-220} 200 \
      tests/test_batch_invariant.py tests/test_cascade.py tests/test_cascade_backend.py \
      tests/test_cascade_plan.py tests/test_engine.py tests/test_engine_graphs.py \
      tests/test_graph_addresses.py tests/test_lse.py tests/test_ops_memo.py tests/test_pdl.py \
      tests/test_spec_modes.py tests/test_triton_index_kv.py tests/test_triton_prefill_extend.py
    ;;
  twentyninth)
    # decode: the default against the page-id prefetch and the carried page lookup, as the
    # planned (graph) step; cuDNN on the dense equivalent
    timeout ${SB_S:-270} python3 benchmarks/bench_variants.py --out "$OUT/sb" \
      --rows 1x4096,16x4096,1x32768,64x4096,8x65536 --variants planned,planned-prefetch,\
planned-chunk0-ahead,planned-chunk0-ahead-bn64,planned-chunk0-ahead-bn64-s4 \
      2>&1 | tail -14 | tee "$OUT/small_batch.log"
    timeout ${SB1_S:-75} python3 benchmarks/bench_variants.py --out "$OUT/sb1" \
      --rows 1x4096,16x4096 --variants planned-chunk0-ahead-bn64-splits128,\
planned-bn64-splits128,planned-bn64-splits128-prefetch,planned-chunk0-ahead-splits1 \
      2>&1 | tail -7 \
      | tee -a "$OUT/small_batch.log"
    # fp8 value reads: the byte-wise default against 16-bit column pairs, then options on top
    for ov in '{}' '{"v_pairs": true}' '{"v_pairs": true, "page_chunk": 0, "page_ahead": true}' \
              '{"v_pairs": true, "num_stages": 4}'; do
      tag=$(echo "$ov" | tr -dc 'a-z0-9_')
      timeout ${FP_S:-55} python3 benchmarks/bench_attention.py --only fp8 --rep 30 --anchors "" \
        --overrides "$ov" --out "$OUT/fp8_${tag:-default}" 2>&1 | grep -E "==|ours" \
        | tee -a "$OUT/fp8.log"
    done
    ;;
  thirtieth)
    # MLA rows (fp8 16 heads: byte-wise value reads against the value-pairs option,
    # "ours-v-pairs"), then the paged prefill row with the carried page lookup
    timeout ${MLA_S:-220} python3 benchmarks/bench_attention.py --only mla --rep 30 \
      --mla-variants pdl-reduce,pdl --out "$OUT/mla" 2>&1 | grep -E "==|ours" \
      | tee "$OUT/mla.log"
    for ov in '{}' '{"page_chunk": 0, "page_ahead": true}'; do
      tag=$(echo "$ov" | tr -dc 'a-z0-9_')
      timeout ${PF_S:-170} python3 benchmarks/bench_attention.py --only prefill --rep 30 \
        --anchors cudnn --overrides "$ov" --out "$OUT/prefill_${tag:-default}" 2>&1 \
        | grep -E "==|ours |cudnn" | tee -a "$OUT/prefill.log"
    done
    ;;
  twentyseventh)
    timeout ${GT_S:-240} python3 -m pytest -m gpu -q tests/test_triton_prefill.py \
      tests/test_direct_launch.py tests/test_triton_prefill_extend.py \
      tests/test_triton_prefill_backend.py tests/test_engine_graphs.py -p no:cacheprovider \
      -p no:warnings --tb=short -n 4 > "$OUT/prefill_tests.log" 2>&1
    grep -E "FAILED|ERROR| passed| failed" "$OUT/prefill_tests.log" | tail -15
    ;;
  twentysecond)
    timeout ${GT_S:-120} python3 -m pytest -m gpu -q -x tests/test_triton_prefill.py \
      tests/test_direct_launch.py -k "gluon or dense_prefill" -p no:cacheprovider \
      -p no:warnings --tb=short > "$OUT/gluon_tests.log" 2>&1
    tail -15 "$OUT/gluon_tests.log"
    timeout ${SW_S:-150} python3 benchmarks/bench_prefill.py --sweep-graphs --host \
      --rows "prefill 8x2k,prefill 1x8k,prefill 1x16k" --configs ${PF_CONFIGS:-2,7,11} \
      --budget-s 0 \
      --out "$OUT/sweep" > "$OUT/sweep.log" 2>&1
    grep -E "== |dense |cudnn|Error|error" "$OUT/sweep.log" | head -40
    timeout ${DE_S:-150} python3 benchmarks/bench_dense_extend.py --out "$OUT/dense_extend" \
      > "$OUT/dense_extend.log" 2>&1
    tail -22 "$OUT/dense_extend.log"
    for impl in dense cudnn; do
      timeout ${NCU_S:-60} ncu --clock-control none --target-processes all --launch-skip 2 \
        --launch-count 1 -k regex:'prefill|sdpa|fprop|flash|fmha|cudnn' \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy \
        --section MemoryWorkloadAnalysis --section WarpStateStats \
        python3 benchmarks/ncu_prefill.py --bs 8 --ctx 2048 --impl $impl \
        > "$OUT/ncu_$impl.log" 2>&1
      grep -E "  [a-zA-Z_].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|Issue Slots Busy|Executed Ipc A|Achieved Occupancy|Registers Per|Warp Cycles Per Issued" \
        "$OUT/ncu_$impl.log" | head -14
    done
    rm -f "$OUT"/*/*.png
    ;;
  tests|all)
    timeout $T python3 -m pytest -q -n 8 -m gpu tests -p no:cacheprovider -p no:warnings \
      --timeout 240 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
    for args in "--backend triton --dtype bfloat16" \
                "--self-test"; do
      echo "== verify $args --device cuda"
      timeout $V python3 -m aiter_attn.cli verify $args --device cuda 2>&1 | tail -4
    done 2>&1 | tee "$OUT/verify.log"
    ;;&
  bench|all)
    timeout $B1 python3 benchmarks/bench_variants.py --out "$OUT" 2>&1 | tail -9
    timeout $B2 python3 benchmarks/bench_attention.py --only host --out "$OUT" 2>&1 | tail -14
    timeout $B3 python3 benchmarks/bench_attention.py --only mixed --out "$OUT/mixed" 2>&1 | tail -8
    ;;
esac
