"""How setup builds llama.cpp (llama-cpp-python, bench/'s llama.cpp peer) so that it runs on the CPU it is built on.

pip builds llama.cpp with GGML_NATIVE=ON, `-march=native`. On an Intel CPU with AMX (Sapphire Rapids and later)
that compiles ggml's AMX backend, whose matrix product segfaults on the first evaluation of a Q4_1 model (a known
ggml defect, "segfault in ggml_backend_amx_mul_mat"). GGML_AMX_*=OFF alone does not help: `-march=native` turns AMX
back on. So on x86-64 the build is not native: every instruction-set switch of ggml is set from the CPU's own flags
(/proc/cpuinfo), AMX always off. Elsewhere (Arm) the native build stands: ggml has no AMX there.

    python tools/llama_build.py cmake-args   # the CMAKE_ARGS for pip, for this CPU
    python tools/llama_build.py key          # a name for the wheel built with them (setup keeps it to reuse)
    python tools/llama_build.py check        # the installed build's system-info line; fails if AMX is in it
"""

from __future__ import annotations

import hashlib
import platform
import sys

# ggml's x86 switch -> the /proc/cpuinfo flags it needs (all of them). GGML_AVX512 compiles -mavx512f, cd, vl, dq, bw.
X86_SWITCHES = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512vbmi",)),
    ("GGML_AVX512_VNNI", ("avx512_vnni",)),
    ("GGML_AVX512_BF16", ("avx512_bf16",)),
)
AMX_SWITCHES = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")  # off on every CPU: the backend that crashes
X86_MACHINES = ("x86_64", "amd64")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The instruction-set flags of the first CPU listed in /proc/cpuinfo's text."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return set(value.split())
    return set()


def cmake_args(machine: str, flags: set[str]) -> list[str]:
    """CMake switches for llama.cpp on a CPU of this machine type with these flags: on x86-64 each switch from the
    flags and AMX off; elsewhere ggml's native build."""
    if machine.lower() not in X86_MACHINES:
        return ["-DGGML_NATIVE=ON"]
    switches = [f"-D{name}={'ON' if set(need) <= flags else 'OFF'}" for name, need in X86_SWITCHES]
    return ["-DGGML_NATIVE=OFF", *switches, *(f"-D{name}=OFF" for name in AMX_SWITCHES)]


def this_cpu() -> tuple[str, set[str]]:
    """This machine's type and its CPU flags."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            return platform.machine(), cpu_flags(fh.read())
    except OSError:
        return platform.machine(), set()


def build_key(args: list[str], requirement: str) -> str:
    """A short name for a wheel built from `requirement` with `args` under this Python."""
    text = "\n".join([requirement, sys.version.split()[0], *args])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def system_info() -> str:
    """The installed llama.cpp's system-info line (which instruction sets its build uses)."""
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode()


def main(argv: list[str]) -> int:
    """cmake-args | key REQUIREMENTS_FILE | check."""
    args = cmake_args(*this_cpu())
    if argv[:1] == ["cmake-args"]:
        print(" ".join(args))
    elif argv[:1] == ["key"] and len(argv) == 2:
        with open(argv[1], encoding="utf-8") as fh:
            print(build_key(args, fh.read()))
    elif argv[:1] == ["check"]:
        info = system_info()
        print(f"llama.cpp system info: {info.strip()}")
        if "AMX_INT8 = 1" in info:
            print("llama.cpp was built with AMX, which crashes: rebuild it with bash tools/setup.sh --llama")
            return 1
    else:
        print("usage: python tools/llama_build.py cmake-args | key REQUIREMENTS_FILE | check", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
