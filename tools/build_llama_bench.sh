#!/bin/bash
# Builds llama.cpp's llama-bench and llama-batched-bench with CUDA for the device machine, here
# on the CPU machine (nvcc, no driver, no GPU), and packs them for `tools/device_check.sh
# llama`, which runs them beside `strata bench` on the same host: the reference figures of
# ../shared/device/README.md were taken on one machine, and the device's hosts differ
# (docs/offload.md, "Session 88").
#
#   tools/build_llama_bench.sh [OUT]     OUT default .device/llama-bench.tar.xz (git-ignored)
#   tools/build_llama_bench.sh --cpu     llama-bench and llama-batched-bench for this machine's
#                                        CPU only (-march=native, no CUDA; ~5 minutes on 2
#                                        cores), in $LLAMA_WORK/build-cpu/bin: llama.cpp's CPU
#                                        speed beside `strata bench --device cpu` (DEVELOPING.md,
#                                        "CPU speed")
#
# Sources: llama.cpp as vendored in the llama-cpp-python sdist on PyPI (the registries are all
# this machine reaches; $LLAMA_CPP_PYTHON, default 0.3.36), cuBLAS headers and libraries from
# the nvidia-cublas wheel (the CUDA toolkit here has none), and a stub libcuda.so.1 made from
# cuda.h's declarations to link against (the device's driver provides the real one).
# Build: CUDA for $CUDA_ARCH (default 90-real: H100 and H200), the CPU side for the device's
# Xeon (AVX-512 VNNI / BF16, AMX; not -march=native, since this machine is not that one), ggml
# and llama as shared libraries the two tools share, OpenMP. On 2 cores the build takes about 25
# minutes (the CUDA template instances); $LLAMA_WORK (default /tmp/llama-bench-build) keeps it,
# so a second run only relinks and packs.
# The pack (~22 MB) holds the tools, their libraries and libcudart; cuBLAS (~600 MB) stays
# behind: the device finds the libcublas.so.13 that its torch's CUDA wheels installed. The tools
# need glibc >= 2.34 and the libstdc++ of gcc >= 12 there (the device's are newer; none is
# packed, so that nothing shadows the libraries Strata's own extensions were built against).
set -eu
CPU_ONLY=0
if [ "${1:-}" = "--cpu" ]; then CPU_ONLY=1; shift; fi
OUTFILE=$(realpath -m "${1:-.device/llama-bench.tar.xz}")
VERSION=${LLAMA_CPP_PYTHON:-0.3.36}
WORK=${LLAMA_WORK:-/tmp/llama-bench-build}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
mkdir -p "$WORK"
cd "$WORK"

src=llama_cpp_python-$VERSION/vendor/llama.cpp
if [ ! -d "$src" ]; then
    url=$(python3 - "$VERSION" <<'PY'
import json, sys, urllib.parse, urllib.request
index = "https://pypi.org/pypi/llama-cpp-python/json"
meta = json.load(urllib.request.urlopen(index))
url = next(u["url"] for u in meta["releases"][sys.argv[1]] if u["packagetype"] == "sdist")
print(urllib.parse.urljoin(index, url))  # a mirror may give it relative to the index
PY
)
    curl -sSfL -o sdist.tar.gz "$url"
    tar -xzf sdist.tar.gz
fi

if [ "$CPU_ONLY" = 1 ]; then
    cmake -S "$src" -B "$WORK/build-cpu" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DGGML_CUDA=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        > "$WORK/configure-cpu.log"
    ninja -C "$WORK/build-cpu" -j"$(nproc)" llama-bench llama-batched-bench
    ls -la "$WORK/build-cpu/bin/llama-bench" "$WORK/build-cpu/bin/llama-batched-bench"
    exit 0
fi

cublas=$WORK/cublas/nvidia/cu13
if [ ! -f "$cublas/lib/libcublasLt.so.13" ]; then
    python3 -m pip download -q --no-deps "nvidia-cublas==13.0.*" -d "$WORK/wheels"
    rm -rf "$WORK/cublas" && mkdir -p "$WORK/cublas"
    python3 -m zipfile -e "$WORK"/wheels/nvidia_cublas-*.whl "$WORK/cublas"
fi

# a stub driver library: every cu* function cuda.h declares, doing nothing; only for the link
stub=$WORK/stub/libcuda.so
if [ ! -f "$stub" ]; then
    mkdir -p "$WORK/stub"
    echo '#include <cuda.h>' | gcc -E -P -I"$CUDA_HOME/include" -x c - \
        | grep -oE '\bcu[A-Za-z0-9_]+[[:space:]]*\(' | tr -d ' (' | sort -u \
        | awk '{print "void " $1 "(void) {}"}' > "$WORK/stub/stub.c"
    gcc -shared -fPIC -o "$stub" "$WORK/stub/stub.c" -Wl,-soname,libcuda.so.1
fi
ln -sf libcuda.so "$WORK/stub/libcuda.so.1"  # the name the link looks for behind libggml-cuda

inc="-I$cublas/include"
# no run path into this machine's folders (the stub must never shadow a real driver); the link
# finds the libraries' own needs through -rpath-link instead
links="-Wl,-rpath-link,$WORK/build/bin:$cublas/lib:$WORK/stub"
PATH=$CUDA_HOME/bin:$PATH cmake -S "$src" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_FLAGS="$inc" -DCMAKE_CXX_FLAGS="$inc" -DCMAKE_SKIP_BUILD_RPATH=ON \
    -DCMAKE_EXE_LINKER_FLAGS="$links" -DCMAKE_SHARED_LINKER_FLAGS="$links" \
    -DCUDA_cublas_LIBRARY="$cublas/lib/libcublas.so.13" \
    -DCUDA_cublasLt_LIBRARY="$cublas/lib/libcublasLt.so.13" \
    -DCUDA_cuda_driver_LIBRARY="$stub" \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90-real}" -DGGML_CUDA_NCCL=OFF \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
    -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
    -DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON -DGGML_AMX_BF16=ON \
    -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF > "$WORK/configure.log"
PATH=$CUDA_HOME/bin:$PATH ninja -C "$WORK/build" -j"$(nproc)" llama-bench llama-batched-bench

pack=$WORK/pack
rm -rf "$pack" && mkdir -p "$pack"
cp "$WORK/build/bin/llama-bench" "$WORK/build/bin/llama-batched-bench" "$pack/"
cp -P "$WORK"/build/bin/lib*.so* "$pack/"
find "$pack" -maxdepth 1 -type f -name 'l*' -exec strip {} +  # the tools and ggml's, llama's
cp -L "$CUDA_HOME/lib64/libcudart.so.13" "$pack/"
commit=$(cd "$src" && git log -1 --format=%h 2>/dev/null || echo '?')
echo "llama-cpp-python $VERSION, llama.cpp $commit, CUDA arch ${CUDA_ARCH:-90-real}" > "$pack/VERSION"
mkdir -p "$(dirname "$OUTFILE")"
tar -cJf "$OUTFILE" -C "$pack" .
ls -la "$OUTFILE"
