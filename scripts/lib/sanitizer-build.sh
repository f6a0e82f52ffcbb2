# Sourced by scripts/sanitize and scripts/fuzz: configures a sanitizer build
# folder with clang. Both scripts share build-asan, so the fuzz targets and
# the ASan+UBSan test build are compiled once.
#
#   sanitizer_configure asan|tsan <build-dir>

# scripts/deps installs clang and its runtimes; say so if they are missing.
sanitizer_need_clang() {
  command -v clang++ >/dev/null && compgen -G "/usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a" >/dev/null && return
  echo "sanitize: clang++ or its sanitizer runtimes are missing; run scripts/deps (installs clang, libclang-rt-14-dev, llvm)" >&2
  return 1
}

sanitizer_configure() {
  local kind=$1 build=$2 flags fuzz=OFF
  case $kind in
    asan) flags="address,undefined"; fuzz=ON ;;
    tsan) flags="thread" ;;
    *) echo "sanitize: unknown kind $kind (asan, tsan)" >&2; return 2 ;;
  esac
  sanitizer_need_clang
  # -O1: sanitizer builds compile faster and still inline enough to be quick.
  cmake -S "$ROOT" -B "$build" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" \
    -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g" \
    -DACCORD_SANITIZE=$flags -DACCORD_FUZZ=$fuzz -DACCORD_CUDA=OFF \
    -DACCORD_BUILD_BENCHMARKS=OFF -DACCORD_BUILD_PYTHON=OFF >"$build.configure.log" 2>&1 \
    || { cat "$build.configure.log"; return 1; }
}
