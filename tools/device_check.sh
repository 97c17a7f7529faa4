#!/bin/bash
# The GPU checks of one device call, each part with its own time limit, logs under $OUT (or
# ./device-logs): the CUDA tests file by file in risk order, then the benchmarks of the CUDA
# backend with its opt-in / opt-out switches. Run on the device machine from the repository
# root after `source .device/setup.sh` (docs/DEVELOPING.md):
#   tools/device_check.sh tests [FILE ...]   the CUDA test files (default: all, the risky first)
#   tools/device_check.sh bench              bench_cuda.py pp512 / tg128 / 1,2,4,8 slots, with
#                                            and without each switch, and the mmq profile
#   tools/device_check.sh all                both
#   tools/device_check.sh suite              the whole test suite in one run, cuda and not, the
#                                            GPU visible (tests/conftest.py keeps the other
#                                            tests on the CPU), all cores but two (SUITE_LIMIT
#                                            seconds, default 480): the wheels in
#                                            .device/xwheels (openai, hypothesis, anthropic,
#                                            flake8; the image lacks them) installed first;
#                                            then the failures' reasons
#   tools/device_check.sh offload            issue #7's rows with every expert in RAM on the
#                                            skew-0 and skew-1 synths: pp512 with
#                                            STRATA_POOL_SURE 0 / auto alternating (ROUNDS,
#                                            default 3), tg64 at 1 and 4 slots
#   tools/device_check.sh pair "A" "B" ARGS  strata bench ARGS (tools/bench_logged.py, so the
#                                            tier's log too; experts in RAM unless ARGS set
#                                            --expert-cache) on $PAIR_MODEL (default the skew-0
#                                            synth; one missing is written with routing skew
#                                            $PAIR_SKEW, default 1) under side A and side B
#                                            alternating, A B then B A (ROUNDS, default
#                                            3); a side is words, NAME=VALUE ones the
#                                            environment, the others more bench flags (e.g.
#                                            "STRATA_POOL_SURE=0" "--pcie-frac auto"); then each
#                                            row's runs, medians and B/A, and where
#                                            --pcie-frac auto left each run's shares (its
#                                            tuner's rounds: strata.pool's log)
#   tools/device_check.sh sides "A" "B" "C" ... -- ARGS
#                                            as pair, with any number of sides, each row's
#                                            medians against side A's (PAIR_TAG names the
#                                            logs, default pair: two calls in one device call,
#                                            e.g. one per synth, need two tags)
#   tools/device_check.sh amx OLD_AMX_C      on a CPU with AMX: tools/bench_amx.c built against
#                                            the tree's amx.c and against OLD_AMX_C (e.g.
#                                            `git show REV:src/strata/_native/amx.c >
#                                            .device/amx_old.c` here), alternating (ROUNDS,
#                                            default 2), then tests/native/test_amx.py
#   tools/device_check.sh old                the revision that tools/prepare_ab.sh REV packed
#                                            (.device/old.tar.gz) unpacked in $OLD_TREE
#                                            (/tmp/old) and built into $OLD_SITE
#                                            (/tmp/site_old): a pair side
#                                            "PYTHONPATH=/tmp/site_old:/tmp/site" then runs it
#                                            (with STRATA_STREAM_TIMELINE=1 on both sides the
#                                            pair's summary gives each run's timeline too)
#   tools/device_check.sh kernel [ARGS]      tools/bench_pool_kernel.py ARGS (default: Q4_0,
#                                            8-128 rows an expert, both kernels, all cores but
#                                            one) of the tree and, once `old` has built it, of
#                                            the old build (the tree's script on its kernels),
#                                            alternating (ROUNDS, default 2),
#                                            then each line's experts/s side by side. Run it
#                                            on a quiet host: not beside a synth being written
#   tools/device_check.sh ab                 the working tree against the revision that
#                                            tools/prepare_ab.sh REV packed (run here first):
#                                            bench_cuda.py twice each, interleaved, and
#                                            decode_breakdown.py for both
#   tools/device_check.sh llama [TARBALL]    llama.cpp beside Strata on this host: llama-bench
#                                            from TARBALL (tools/build_llama_bench.sh; default
#                                            .device/llama-bench.tar.xz) and `strata bench` on
#                                            the skew-1 synth, then the skew-0 one (not with
#                                            LLAMA_SKEW0=0), alternating (ROUNDS, default 2;
#                                            FIRST_ROUND=2 starts with Strata first): every
#                                            expert in RAM (llama.cpp -ngl 99 -ncmoe 48, all
#                                            cores; Strata --expert-cache 0, all but one) pp512
#                                            and tg128, half of it (llama.cpp -ncmoe 24;
#                                            Strata a cache of half the experts) tg128, and 4
#                                            sequences decoding together with every expert in
#                                            RAM (llama-batched-bench -npp 128 -ntg 128 -npl 4;
#                                            Strata -np 4), tg128 x4 (LLAMA_SETTINGS, default
#                                            "ram half x4", picks them); then
#                                            each row's medians and Strata / llama.cpp. Its
#                                            experts in RAM are read into pinned memory
#                                            (LLAMA_LOAD_MODE, default none; mmap, its default,
#                                            gave it a quarter of the pp512: docs/offload.md,
#                                            "Session 88")
# The synth model /tmp/q.gguf (qwen3-30b-a3b, Q4_0) is written first when missing (~50 s).
set -u
OUT="${OUT:-./device-logs}"
# cubins built here by tools/precompile_cubins.py (--pack .device/cubins.tar.xz, or a folder
# .device/cubins): no compile on the device
if [ -f .device/cubins.tar.xz ]; then
    mkdir -p .device/cubins && tar -xJf .device/cubins.tar.xz -C .device/cubins
fi
[ -d .device/cubins ] && export STRATA_CUBIN_DIR="${STRATA_CUBIN_DIR:-$PWD/.device/cubins}"
mkdir -p "$OUT"
MODEL=${SYNTH_MODEL:-/tmp/q.gguf}            # the skew-0 synth (written when missing)
OLD_TREE=${OLD_TREE:-/tmp/old}      # the old revision's source (build_old)
OLD_SITE=${OLD_SITE:-/tmp/site_old}  # and its build
TESTS=(test_cuda_kernels test_cuda_mmq test_prompt_kernels test_cuda_parity test_cuda_sample
       test_cuda_drafts test_cuda_kv_int8 test_cuda_offload test_offload_stream test_cuda_pool test_cuda_kv_grow
       test_split_stages)

part() {  # part SECONDS NAME COMMAND...: run with a limit, log to $OUT/NAME.log, print its tail
    local limit=$1 name=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    PART_RC=$rc  # the command's status, for a caller that passes it on (run_suite)
    echo "== $name: rc $rc in $((SECONDS - t0)) s (limit $limit)"
    # a failure's reasons too (pytest's "E " lines, errors): the call's stdout always comes
    # back, its logs only up to the device tool's count of files
    [ $rc -ne 0 ] && grep -E '^E |Error|error:' "$OUT/$name.log" | head -n 20
    tail -n 4 "$OUT/$name.log"
}

turned() {  # turned ROUND ITEM...: the items in order in odd rounds, reversed in even ones
    # (A B, B A, ...): the second of two runs back to back is the faster on these hosts
    # (session 45; session 92: the second side won one-slot decode by 3-5% whichever setting
    # it was), so an A/B that keeps one order measures the order
    local round=$1 i
    shift
    local items=("$@")
    if (( round % 2 )); then printf '%s\n' "${items[@]}"
    else for (( i = ${#items[@]} - 1; i >= 0; i-- )); do printf '%s\n' "${items[$i]}"; done
    fi
}

synth() {
    [ -f "$MODEL" ] || part 120 synth python3 tools/bench_cuda.py "$MODEL" --synth qwen3-30b-a3b \
        --weight-type q4_0 --jobs "$(nproc)" --synth-only
}

run_tests() {
    local files=("$@")
    if [ ${#files[@]} -eq 0 ]; then  # the risky ones first, then every other CUDA test file
        files=("${TESTS[@]}")
        for path in tests/backends/cuda/test_*.py; do
            local name
            name=$(basename "$path" .py)
            [[ " ${TESTS[*]} " == *" $name "* ]] || files+=("$name")
        done
    fi
    for f in "${files[@]}"; do
        part 150 "$f" python3 -m pytest -q -p no:cacheprovider "tests/backends/cuda/$f.py"
    done
}

run_suite() {  # the whole suite on this host (session 97: 4,432 passed in 340 s, -n 14; 98: 330 s)
    if compgen -G ".device/xwheels/*.whl" > /dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/xsite \
            .device/xwheels/*.whl && export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/xsite"
    fi
    local workers=$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))
    # -p no:benchmark: the image's pytest-benchmark stops xdist; -rfE: each failure's line; -v:
    # each test's outcome as it ends, so a run cut off by the limit still names its failures
    # (session 100: 420 s ended at 98% with one F and no name)
    part "${SUITE_LIMIT:-480}" suite python3 -m pytest -v -p no:benchmark -p no:cacheprovider \
        -n "$workers" --dist worksteal -rfE tests
    grep -E '^(FAILED|ERROR) |\] (FAILED|ERROR) ' "$OUT/suite.log" | cut -c1-300 | head -n 40
    grep -E '^=+ .*(passed|failed)' "$OUT/suite.log" | tail -n 1
    return "$PART_RC"  # the script's status is pytest's (session 98: 0 after a failure)
}

run_bench() {
    synth
    part 150 bench python3 tools/bench_cuda.py "$MODEL" -p 512 -n 128 -r 3 --slots 1,2,4,8 --profile
    part 90 bench_old_kernels env STRATA_DECODE_MM=dp4a STRATA_PROMPT_ATTN=old \
        python3 tools/bench_cuda.py "$MODEL" -p 512 -n 128 -r 3 --slots 1,4,8
    part 90 bench_no_pdl env STRATA_PDL=0 \
        python3 tools/bench_cuda.py "$MODEL" -p 512 -n 128 -r 3 --slots 1,4,8
    part 90 mmq python3 tools/bench_mmq.py "$MODEL" --rows 512 -r 5 --profile
}

build_old() {  # .device/old.tar.gz (tools/prepare_ab.sh REV) into $OLD_TREE, built into $OLD_SITE
    if [ ! -f .device/old.tar.gz ]; then
        echo "no .device/old.tar.gz: run tools/prepare_ab.sh REV here" >&2
        return 2
    fi
    rm -rf "$OLD_TREE" "$OLD_SITE" && mkdir -p "$OLD_TREE"
    tar -xzf .device/old.tar.gz -C "$OLD_TREE"
    part 150 old_build bash -c "cd '$OLD_TREE' && python3 -m pip install -q --no-index --no-deps \
        --no-build-isolation --target '$OLD_SITE' ."
}

run_kernel() {  # kernel [ARGS]: the pool's kernel, the tree against the old build if there
    local args=("$@")
    [ ${#args[@]} -eq 0 ] && args=(--types Q4_0 --rows-per-expert 8,16,32,64,128 --amx both
                                   --threads "$(( $(nproc) - 1 ))" --seconds 1 --repeats 2)
    local sides=(new)
    [ -d "$OLD_SITE" ] && sides+=(old)
    for round in $(seq "${ROUNDS:-2}"); do  # alternating, so drift spreads over both
        for side in $(turned "$round" "${sides[@]}"); do
            if [ "$side" = new ]; then
                part 150 "kernel_new_$round" python3 tools/bench_pool_kernel.py "${args[@]}"
            else
                # the tree's benchmark (its random weights cover every type it knows) on
                # the old build's kernels
                part 150 "kernel_old_$round" env PYTHONPATH="$OLD_SITE:/tmp/site" \
                    python3 tools/bench_pool_kernel.py "${args[@]}"
            fi
        done
    done
    python3 - "$OUT" <<'PY'
import glob, re, sys
rows = {}  # the line's setting -> side -> [experts/s of each round]
for side in ("new", "old"):
    for path in sorted(glob.glob(f"{sys.argv[1]}/kernel_{side}_*.log")):
        for line in open(path):
            m = re.match(r"\s*(\S+\s+threads\s+\d+\s+rows/expert\s+\d+\s*(?:amx)?)\s*:"
                         r"\s*([\d,]+) experts/s", line)
            if m:
                rate = float(m.group(2).replace(",", ""))
                key = " ".join(m.group(1).split())
                rows.setdefault(key, {"new": [], "old": []})[side].append(rate)
for key, got in rows.items():
    new, old = got["new"], got["old"]
    text = f"{key}: tree {' / '.join(f'{v:,.0f}' for v in new)}"
    if old:
        ratio = (sum(new) / len(new)) / (sum(old) / len(old)) if new else float("nan")
        text += f"; old {' / '.join(f'{v:,.0f}' for v in old)}; tree/old {ratio:.3f}"
    print(text)
PY
}

run_ab() {  # NEW: the working tree (setup.sh's /tmp/site); OLD: .device/old.tar.gz
    if [ ! -f .device/old.tar.gz ] || [ ! -d .device/cubins ]; then
        echo "no .device/old.tar.gz or .device/cubins(.tar.xz): run tools/prepare_ab.sh REV here" >&2
        return 2
    fi
    echo "== working tree against $(cat .device/old.rev 2>/dev/null || echo '?')"
    synth
    build_old || return 2
    local new=(env PYTHONPATH=/tmp/site STRATA_CUBIN_DIR="$PWD/.device/cubins")
    local old=(env PYTHONPATH="$OLD_SITE:/tmp/site" STRATA_CUBIN_DIR="$PWD/.device/cubins")
    local side
    for round in 1 2; do
        for side in $(turned "$round" new old); do
            local envs=("${new[@]}")
            [ "$side" = old ] && envs=("${old[@]}")
            part 90 "bench_${side}_$round" "${envs[@]}" python3 tools/bench_cuda.py "$MODEL" \
                -p 512 -n 128 -r 3 --slots 1,4,8
        done
    done
    part 60 breakdown_new "${new[@]}" python3 tools/decode_breakdown.py "$MODEL"
    part 60 breakdown_old "${old[@]}" python3 tools/decode_breakdown.py "$MODEL"
}

run_offload() {  # issue #7's rows, experts in RAM, on both synths; STRATA_POOL_SURE 0 / auto
    local skew1=/tmp/q1.gguf threads=$(( $(nproc) - 1 ))
    synth
    [ -f "$skew1" ] || part 120 synth_skew1 python3 -m strata.tool synth "$skew1" \
        --shape qwen3-30b-a3b --type q4_0 --routing-skew 1 --jobs "$(nproc)"
    local bench=(python3 -m strata bench --device cuda -t "$threads" --expert-cache 0)
    for round in $(seq "${ROUNDS:-3}"); do  # alternating, so drift spreads over both
        for m in "$MODEL" "$skew1"; do
            for sure in $(turned "$round" 0 auto); do
                part 100 "pp512_$(basename "$m" .gguf)_${sure}_$round" env STRATA_POOL_SURE=$sure \
                    "${bench[@]}" -m "$m" -p 512 -n 0 -r 6
            done
        done
    done
    for m in "$MODEL" "$skew1"; do
        part 150 "tg64_$(basename "$m" .gguf)" "${bench[@]}" -m "$m" -p 0 -n 64 -r 3 -np 1,4
    done
    grep -H -o 'pp512 |[^|]*|\|tg64[ x4]* |[^|]*|' "$OUT"/pp512_*.log "$OUT"/tg64_*.log
}

run_sides() {  # run_sides N "SIDE A" "SIDE B" ... BENCH_ARGS...: N sides alternating
    local n=$1 model=${PAIR_MODEL:-$MODEL} threads=$(( $(nproc) - 1 )) tag=${PAIR_TAG:-pair}
    shift
    local sides=("${@:1:$n}")
    shift "$n"
    [ "$model" = "$MODEL" ] && synth
    [ -f "$model" ] || part 120 synth_pair python3 -m strata.tool synth "$model" \
        --shape qwen3-30b-a3b --type q4_0 --routing-skew "${PAIR_SKEW:-1}" --jobs "$(nproc)"
    for round in $(seq "${ROUNDS:-3}"); do  # alternating, so drift spreads over every side
        for i in $(turned "$round" $(seq 0 $(( n - 1 )))); do
            local envs=() flags=() word
            for word in ${sides[$i]}; do
                if [[ $word == [A-Za-z_]*=* ]]; then envs+=("$word"); else flags+=("$word"); fi
            done
            # bench_logged: the tier's decisions too (where STRATA_POOL_SURE moved, e.g.)
            part 150 "${tag}_${i}_$round" env "${envs[@]}" python3 \
                "$(dirname "${BASH_SOURCE[0]}")/bench_logged.py" --log strata.tier=INFO \
                --log strata.pool=INFO -- -m "$model" --device cuda \
                -t "$threads" --expert-cache 0 "$@" "${flags[@]}"
        done
    done
    python3 - "$OUT" "$tag" "${sides[@]}" <<'PY'
import glob, re, statistics, sys
out, tag, names = sys.argv[1], sys.argv[2], sys.argv[3:]
letters = [chr(ord("A") + i) for i in range(len(names))]
rows = {}  # test -> side -> [tokens/s of each round]
logs = [sorted(glob.glob(f"{out}/{tag}_{side}_*.log"), key=lambda p: int(p[:-4].split("_")[-1]))
        for side in range(len(names))]
for side, paths in enumerate(logs):
    for path in paths:
        for line in open(path):
            m = re.search(r"\|\s*([a-z]+\d+[^|]*?)\s*\|\s*([\d.]+)\s*±", line)
            if m:
                rows.setdefault(m.group(1), [[] for _ in names])[side].append(float(m.group(2)))
for side, paths in enumerate(logs):  # each run's timeline (STRATA_STREAM_TIMELINE=1) and
    for path in paths:                # where --pcie-frac auto left each window class's share
        for line in open(path):
            for m in re.finditer(r"timeline, medians of .*|PCIe share \(--pcie-frac auto\) "
                                 r"by window rows: [^;]*|PCIe share of [\d-]+-row windows .*",
                                 line):
                print(f"{letters[side]} round {path[:-4].split('_')[-1]}: {m.group(0)}")
for test, runs in rows.items():
    medians = [statistics.median(r or [0]) for r in runs]
    text = "; ".join(f"{letter} ({name or 'as is'}) {', '.join(f'{v:.1f}' for v in r)} median "
                     f"{m:.1f}" for letter, name, r, m in zip(letters, names, runs, medians))
    for letter, r, m in list(zip(letters, runs, medians))[1:]:
        won = sum(y > x for x, y in zip(runs[0], r))
        ratio = m / medians[0] if medians[0] else float("nan")
        text += f"; {letter}/A {ratio:.3f}, {letter} won {won} of {min(len(runs[0]), len(r))}"
    print(f"{test}: {text}")
PY
}

run_llama() {  # llama [TARBALL]: llama.cpp's llama-bench and strata bench on one host
    local tarball=${1:-.device/llama-bench.tar.xz} dir=${LLAMA_DIR:-/tmp/llama-bench}
    local skew1=${SYNTH_SKEW1:-/tmp/q1.gguf}
    local cores threads lt
    cores=$(nproc); threads=$(( cores - 1 ))
    if [ ! -f "$tarball" ]; then
        echo "llama: no $tarball: build it with tools/build_llama_bench.sh here" >&2
        return 2
    fi
    rm -rf "$dir" && mkdir -p "$dir" && tar -xJf "$tarball" -C "$dir"
    # its cuBLAS is the one torch's CUDA wheels brought (the image has torch; the libraries are
    # too large to carry), or the folder CUBLAS_DIR names
    if [ -n "${CUBLAS_DIR:-}" ]; then
        lt=$(ls "$CUBLAS_DIR"/libcublasLt.so.13 2>/dev/null)
    else
        lt=$(find / \( -path /proc -o -path /sys \) -prune -o -name 'libcublasLt.so.13' -print \
            2>/dev/null | head -n 1)
    fi
    if [ -z "$lt" ]; then
        echo "llama: no libcublasLt.so.13 on this machine (torch's nvidia wheels or a CUDA 13" \
             "toolkit); llama-bench cannot start" >&2
        return 2
    fi
    # for llama-bench alone: Strata's extensions keep the machine's own libraries
    local ld="LD_LIBRARY_PATH=$dir:$(dirname "$lt")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    local common=(-ngl 99 -t "$cores" -lm "${LLAMA_LOAD_MODE:-none}")
    local llama=(env "$ld" "$dir/llama-bench" "${common[@]}")
    # several sequences decoding together: llama-batched-bench, 128-token prompts, B at once
    local batched=(env "$ld" "$dir/llama-batched-bench" "${common[@]}" -c 2048 -b 2048 -ub 512)
    part 30 llama_devices env "$ld" "$dir/llama-bench" --list-devices
    [ -f "$skew1" ] || part 120 synth_skew1 python3 -m strata.tool synth "$skew1" \
        --shape qwen3-30b-a3b --type q4_0 --routing-skew 1 --jobs "$cores"
    [ "${LLAMA_SKEW0:-1}" = 0 ] || synth
    local models=("$skew1")
    [ "${LLAMA_SKEW0:-1}" = 0 ] || models+=("$MODEL")
    local strata=(python3 -m strata bench --device cuda -t "$threads")
    local -A run=(  # side_setting -> its command's arguments after the model
        [llama_ram]="-ncmoe 48 -p 512 -n 128 -r 3"
        [strata_ram]="--expert-cache 0 -p 512 -n 128 -r 3"
        [llama_half]="-ncmoe 24 -p 0 -n 128 -r 3"
        [strata_half]="--expert-cache 3072 -p 0 -n 128 -r 3"
        [llama_x4]="-ncmoe 48 -npp 128 -ntg 128 -npl 4"
        [strata_x4]="--expert-cache 0 -p 0 -n 128 -r 3 -np 4")
    local first=${FIRST_ROUND:-1}  # FIRST_ROUND=2 ROUNDS=1: one round with Strata first
    for round in $(seq "$first" $(( first + ${ROUNDS:-2} - 1 ))); do  # ABBA: llama.cpp first in odd rounds
        for m in "${models[@]}"; do
            local n setting side
            n=$(basename "$m" .gguf)
            for setting in ${LLAMA_SETTINGS:-ram half x4}; do
                for side in $(turned "$round" llama strata); do
                    local cmd=("${strata[@]}")
                    [ "$side" = llama ] && cmd=("${llama[@]}")
                    [ "$side$setting" = llamax4 ] && cmd=("${batched[@]}")
                    # shellcheck disable=SC2086  # the table's arguments split into words
                    part 150 "${side}_${setting}_${n}_$round" "${cmd[@]}" -m "$m" \
                        ${run[${side}_$setting]}
                done
            done
        done
    done
    python3 - "$OUT" <<'PY'
import glob, re, statistics, sys
rows = {}  # (synth, setting, test) -> side -> [tokens/s]
for path in glob.glob(f"{sys.argv[1]}/*.log"):
    name = re.match(r".*/(llama|strata)_(ram|half|x4)_(.+)_\d+\.log$", path)
    if not name:
        continue
    side, setting, synth = name.groups()
    for line in open(path):
        m = re.search(r"\|\s*((?:pp|tg)\d+(?: x\d+)?)\s*\|\s*([\d.]+)\s*±", line)
        # llama-batched-bench: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | ...
        b = re.match(r"\|\s*\d+\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|" + r"\s*([\d.]+)\s*\|" * 7,
                     line)
        if m:
            test, rate = m.group(1), float(m.group(2))
        elif b:
            test, rate = f"tg{b.group(1)} x{b.group(2)}", float(b.group(7))
        else:
            continue
        rows.setdefault((synth, setting, test), {"llama": [], "strata": []})[side].append(rate)
for (synth, setting, test), got in sorted(rows.items()):
    med = {k: statistics.median(v) if v else float("nan") for k, v in got.items()}
    print(f"{synth} {setting} {test}: strata {', '.join(f'{v:.1f}' for v in got['strata'])} "
          f"(median {med['strata']:.1f}); llama.cpp {', '.join(f'{v:.1f}' for v in got['llama'])} "
          f"(median {med['llama']:.1f}); strata / llama.cpp {med['strata'] / med['llama']:.2f}")
PY
}

run_amx() {  # amx OLD_AMX_C
    local old=${1:-}
    if [ -z "$old" ] || [ ! -f "$old" ]; then
        echo "amx: give the old amx.c to compare with (a file)" >&2
        return 2
    fi
    grep -q amx_tile /proc/cpuinfo || { echo "amx: this CPU has no AMX" >&2; return 2; }
    local n=src/strata/_native srcs=()
    for f in quant_ref matmul tiles unpack_simd unpack_neon fused fused_k fused_iq; do
        srcs+=("$n/$f.c")
    done
    cp "$old" "$n/amx_old.c"
    sed 's#../src/strata/_native/amx.c#../src/strata/_native/amx_old.c#' tools/bench_amx.c \
        > tools/bench_amx_old.c
    part 60 amx_build_new gcc -O3 -march=native -fopenmp -I"$n" tools/bench_amx.c "${srcs[@]}" \
        -lm -o /tmp/bench_amx_new
    part 60 amx_build_old gcc -O3 -march=native -fopenmp -I"$n" tools/bench_amx_old.c \
        "${srcs[@]}" -lm -o /tmp/bench_amx_old
    rm -f "$n/amx_old.c" tools/bench_amx_old.c
    local side
    for round in $(seq "${ROUNDS:-2}"); do  # alternating, so drift spreads over both
        for side in $(turned "$round" new old); do
            part 90 "amx_${side}_$round" "/tmp/bench_amx_$side" "$(( $(nproc) - 1 ))"
        done
    done
    grep -H "dequantise\|n  16\|n  32\|n  64" "$OUT"/amx_new_*.log "$OUT"/amx_old_*.log
    part 150 test_amx python3 -m pytest -q -p no:cacheprovider tests/native/test_amx.py
}

case "${1:-all}" in
    tests) shift; run_tests "$@" ;;
    bench) run_bench ;;
    all) run_tests; run_bench ;;
    suite) run_suite ;;
    ab) run_ab ;;
    old) build_old ;;
    kernel) shift; run_kernel "$@" ;;
    offload) run_offload ;;
    pair) shift; run_sides 2 "$@" ;;
    sides) shift; n=0; for a in "$@"; do [ "$a" = "--" ] && break; n=$((n + 1)); done
           run_sides "$n" "${@:1:$n}" "${@:$((n + 2))}" ;;
    amx) shift; run_amx "$@" ;;
    llama) shift; run_llama "$@" ;;
    *) echo "usage: tools/device_check.sh tests [FILE ...] | bench | all | ab | offload |" \
            "pair \"A\" \"B\" BENCH_ARGS | amx OLD_AMX_C | old | kernel [ARGS] | llama [TARBALL]" >&2
       exit 2 ;;
esac
