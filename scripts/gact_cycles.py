"""Derive `momlab.moms.quant`'s GACT instruction cycles (`_GACT_*_CYCLES`) from SASS, without a GPU.

The paper's quantizer (GACT-ICML gact/cpp_extension/quantization_cuda_kernel.cu and its minimax kernel) is not
vendored here; the kernels below are written for this count with its algorithm, types and launch shape: one
thread per value position of a 256-value group and 8 / bits groups a thread, the bit count known only at run
time, Philox noise set up per thread with `curand_init(seed, thread, offset)`, 64-bit indices, an IEEE division a
value in unpack; one 32-thread warp a group for min and max; a uint8 mask packed through shared-memory atomics.

Each kernel's executed path (bits 4, the noise offset a multiple of 4) is a list of SASS address spans, traced by
hand for nvcc 13.0 (cuda_13.0.r13.0) targeting sm_75 (the oldest target it has): another compiler moves the
addresses, so check `--sass` output against the spans before trusting the numbers. Each instruction weighs
1 / (its throughput per multiprocessor and clock), the CUDA C++ Programming Guide's table "Throughput of Native
Arithmetic Instructions" for compute capability 7.x-9.0: 64 for 32-bit integer and float arithmetic, logic,
shifts and compares (and, here, whatever the table does not name: barriers, shared atomics, BMOV); 16 for
conversions and special functions (MUFU); 32 for shuffles; loads, stores and branches counted at 32 and S2R at 16
(few of each), uniform-datapath instructions at 64.

Tools (no GPU needed): nvcc; cuobjdump and nvdisasm from PyPI's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm
wheels, curand_kernel.h from nvidia-curand (``pip download --no-deps nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
nvidia-curand`` and unzip them). Usage::

    python scripts/gact_cycles.py --bin DIR_WITH_CUOBJDUMP_AND_NVDISASM --include DIR_WITH_CURAND_KERNEL_H [--sass]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <cuda_fp16.h>
#include <curand_kernel.h>
#include <stdint.h>

template <typename T>
__global__ void pack(int bits, const T* __restrict__ x, const T* __restrict__ scale, const T* __restrict__ lo,
                     int8_t* __restrict__ out, unsigned long long seed, unsigned long long offset,
                     int64_t ngroups_total, int64_t groups, int64_t gsize, int64_t ybase) {
  const int64_t row = blockIdx.y + ybase;
  const int g = blockIdx.x;
  const int t = threadIdx.x;
  const int per = 8 / bits;
  const int64_t tid = (row * groups + g) * gsize + t;
  curandStatePhilox4_32_10_t st;
  curand_init(seed, tid, offset, &st);
  uint8_t packed = 0;
  for (int i = 0; i < per; i++) {
    const int64_t n = row * per + i;
    const int64_t at = (n * groups + g) * gsize + t;
    const float u = curand_uniform(&st);
    const int32_t q = __float2int_rn(fmaxf((float)((x[at] - lo[n * groups + g]) * scale[n * groups + g]) + u - 0.5f,
                                           0.0f));
    packed |= (q << (i * bits));
  }
  out[tid] = packed;
}

template <typename T>
__global__ void unpack(int bits, const int8_t* __restrict__ in, const T* __restrict__ scale, const T* __restrict__ lo,
                       T* __restrict__ y, int64_t ngroups_total, int64_t groups, int64_t gsize, int64_t ybase) {
  const int64_t row = blockIdx.y + ybase;
  const int g = blockIdx.x;
  const int t = threadIdx.x;
  const int64_t tid = (row * groups + g) * gsize + t;
  const int per = 8 / bits;
  const uint8_t packed = in[tid];
  const int mask = (1 << bits) - 1;
  for (int i = 0; i < per; i++) {
    const int64_t n = row * per + i;
    const int v = (packed >> (i * bits)) & mask;
    const int64_t at = (n * groups + g) * gsize + t;
    y[at] = ((T)v) / scale[n * groups + g] + lo[n * groups + g];
  }
}

template <typename T>
__global__ void minmax(const T* __restrict__ x, T* __restrict__ lo, T* __restrict__ hi, int64_t n, int64_t d) {
  T a = -60000.0f, b = 60000.0f;
  for (int64_t k = 0; k < d / 32; ++k) {
    const T v = x[blockIdx.x * d + k * 32 + threadIdx.x];
    a = a > v ? a : v;
    b = b < v ? b : v;
  }
  unsigned m = __activemask();
  for (int s = 16; s > 0; s >>= 1) { T o = __shfl_down_sync(m, a, s, 32); a = a > o ? a : o; }
  a = __shfl_sync(m, a, 0, 32);
  hi[blockIdx.x] = a;
  for (int s = 16; s > 0; s >>= 1) { T o = __shfl_down_sync(m, b, s, 32); b = b < o ? b : o; }
  b = __shfl_sync(m, b, 0, 32);
  lo[blockIdx.x] = b;
}

#define T_MASK 512
__global__ void mask_pack(const uint8_t* __restrict__ x, int32_t* __restrict__ out, int n, int len) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int base = blockIdx.x * blockDim.x / 32;
  const int words = T_MASK / 32;
  __shared__ int sh[T_MASK / 32];
  if (threadIdx.x * 2 < words) reinterpret_cast<int2*>(sh)[threadIdx.x] = make_int2(0, 0);
  if (i < n) {
    bool b = x[i];
    __syncthreads();
    atomicOr(sh + threadIdx.x % words, b << (threadIdx.x / words));
    __syncthreads();
  }
  if (threadIdx.x * 2 < words)
    reinterpret_cast<int2*>(out)[base / 2 + threadIdx.x] = reinterpret_cast<int2*>(sh)[threadIdx.x];
}

__global__ void mask_unpack(int32_t* __restrict__ m, uint8_t* __restrict__ y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int base = blockIdx.x * blockDim.x / 32;
  const int words = T_MASK / 32;
  if (i < n) y[i] = (m[base + threadIdx.x % words] >> (threadIdx.x / words)) & 1;
}

template __global__ void pack<__half>(int, const __half*, const __half*, const __half*, int8_t*, unsigned long long,
                                      unsigned long long, int64_t, int64_t, int64_t, int64_t);
template __global__ void pack<float>(int, const float*, const float*, const float*, int8_t*, unsigned long long,
                                     unsigned long long, int64_t, int64_t, int64_t, int64_t);
template __global__ void unpack<__half>(int, const int8_t*, const __half*, const __half*, __half*, int64_t, int64_t,
                                        int64_t, int64_t);
template __global__ void unpack<float>(int, const int8_t*, const float*, const float*, float*, int64_t, int64_t,
                                       int64_t, int64_t);
template __global__ void minmax<__half>(const __half*, __half*, __half*, int64_t, int64_t);
template __global__ void minmax<float>(const float*, float*, float*, int64_t, int64_t);
"""

# kernel -> (values per thread, spans of the executed path); nvcc 13.0, sm_75, bits 4, Philox STATE 0 at start
PATHS = {
    "pack<half>": ("_Z4packI6__halfEviPKT_S3_S3_Payyllll", 2,
                   "0000-0a00 0a10-0a90 0ad0-0ae0 0e70-1060 0a10-0a30 0ac0-0ae0 0e70-1060 1070-1180"),
    "pack<float>": ("_Z4packIfEviPKT_S2_S2_Payyllll", 2,
                    "0000-0a00 0a10-0a90 0ad0-0ae0 0e70-1050 0a10-0a30 0ac0-0ae0 0e70-1050 1060-1170"),
    "unpack<half>": ("_Z6unpackI6__halfEviPKaPKT_S5_PS3_llll", 2, "0000-0380 0c80-0cf0 0d00-0f90 0d00-0f90 0fa0-0fa0"),
    "unpack<float>": ("_Z6unpackIfEviPKaPKT_S4_PS2_llll", 2,
                      "0000-0370 0ce0-0d50 0d60-0f20 0f60-1040 0d60-0f20 0f60-1040 1050-1050"),
    "minmax<half>": ("_Z6minmaxI6__halfEvPKT_PS1_S4_ll", 8, "0000-0230 0240-0400 0240-0400 0410-0410 0590-0910"),
    "minmax<float>": ("_Z6minmaxIfEvPKT_PS0_S3_ll", 8, "0000-0270 0280-0440 0280-0440 0450-0450 05d0-0890"),
    "mask_pack": ("_Z9mask_packPKhPiii", 1, "0000-0160 0170-0170"),
    "mask_unpack": ("_Z11mask_unpackPiPhi", 1, "0000-0120"),
}
# the per-value part of pack and unpack (one iteration of the loop over a thread's values), for other bit counts
LOOPS = {"pack<half>": ("0a10-0a90 0ad0-0ae0 0e70-1060", "0a10-0a30 0ac0-0ae0 0e70-1060"),
         "unpack<half>": ("0d00-0f90",)}

THROUGHPUT = {"conv": 16, "mufu": 16, "s2r": 16, "shfl": 32, "mem": 32, "branch": 32, "uniform": 64, "alu": 64}


def _class(op: str) -> str:
    base = (op.split()[1] if op.startswith("@") else op.split()[0]).split(".")[0]
    if base in ("I2F", "F2I", "F2F", "I2I", "F2FP"):
        return "conv"
    if base == "MUFU":
        return "mufu"
    if base in ("S2R", "CS2R"):
        return "s2r"
    if base == "SHFL":
        return "shfl"
    if base in ("LDG", "STG", "LDS", "STS", "LDC"):
        return "mem"
    if base in ("BRA", "EXIT", "BSYNC", "BSSY", "WARPSYNC"):
        return "branch"
    if base.startswith("U") or base == "S2UR":
        return "uniform"
    return "alu"


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    out = {}
    for block in sass.split("Function : ")[1:]:
        name = block.split()[0]
        out[name] = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4})\*/\s+(.*?)\s*;", block)]
    return out


def cycles(ins: list[tuple[int, str]], spans: str) -> tuple[float, int]:
    total, n = 0.0, 0
    for span in spans.split():
        lo, hi = (int(x, 16) for x in span.split("-"))
        for a, op in ins:
            if lo <= a <= hi:
                total += 1.0 / THROUGHPUT[_class(op)]
                n += 1
    return total, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", required=True, help="folder with cuobjdump and nvdisasm")
    ap.add_argument("--include", required=True, help="folder with curand_kernel.h")
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--sass", action="store_true", help="print the disassembly too")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "k.cu", Path(tmp) / "k.cubin"
        src.write_text(SOURCE)
        subprocess.run([a.nvcc, "-cubin", "-arch=sm_75", "-O3", "-I", a.include, "-o", str(cubin), str(src)],
                       check=True)
        env = {**os.environ, "PATH": f"{a.bin}:{os.environ.get('PATH', '')}", "NVDISASM_PATH": a.bin}
        sass = subprocess.run([str(Path(a.bin) / "cuobjdump"), "-sass", str(cubin)], check=True, env=env,
                              capture_output=True, text=True).stdout
    if a.sass:
        print(sass)
    fns = functions(sass)
    print("| kernel | instructions on the path | SM cycles a thread | values a thread | SM cycles a value |")
    print("|---|---|---|---|---|")
    for label, (name, per, spans) in PATHS.items():
        c, n = cycles(fns[name], spans)
        print(f"| {label} | {n} | {c:.3f} | {per} | {c / per:.3f} |")
    for label, loops in LOOPS.items():
        name, per, spans = PATHS[label]
        whole = cycles(fns[name], spans)[0]
        value = sum(cycles(fns[name], s)[0] for s in loops) / len(loops)
        print(f"{label}: {whole - per * value:.3f} SM cycles a thread + {value:.3f} a value")


if __name__ == "__main__":
    main()
