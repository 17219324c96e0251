"""tools/llama_build.py picks llama.cpp's build switches from the CPU: every instruction set the CPU has, AMX never."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import llama_build  # noqa: E402

# /proc/cpuinfo "flags" lines (shortened to the instruction-set flags) of the two kinds of machine CI runs on
INTEL_AMX = (
    "fpu sse sse2 ssse3 sse4_1 sse4_2 fma f16c avx avx2 bmi1 bmi2 avx512f avx512dq avx512ifma avx512cd avx512bw "
    "avx512vl avx512_bf16 avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg avx512_vpopcntdq avx_vnni "
    "avx512_fp16 amx_bf16 amx_tile amx_int8"
)
AMD_AVX512 = (
    "fpu sse sse2 ssse3 sse4_1 sse4_2 fma f16c avx avx2 bmi1 bmi2 avx512f avx512dq avx512ifma avx512cd avx512bw "
    "avx512vl avx512_bf16 avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg avx512_vpopcntdq"
)
AVX2_ONLY = "fpu sse sse2 ssse3 sse4_1 sse4_2 fma f16c avx avx2 bmi1 bmi2"


def switches(flags: str, machine: str = "x86_64") -> dict[str, str]:
    """The CMake switches chosen for a CPU with these flags, as {name: ON/OFF}."""
    cpuinfo = f"processor\t: 0\nmodel name\t: some cpu\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n"
    args = llama_build.cmake_args(machine, llama_build.cpu_flags(cpuinfo))
    return dict(a.removeprefix("-D").split("=") for a in args)


def test_intel_with_amx_builds_every_instruction_set_but_amx():
    got = switches(INTEL_AMX)
    assert got["GGML_NATIVE"] == "OFF"  # -march=native would turn AMX back on
    assert {k for k, v in got.items() if v == "ON"} == {
        "GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2", "GGML_AVX_VNNI",
        "GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16",
    }  # fmt: skip
    assert got["GGML_AMX_TILE"] == got["GGML_AMX_INT8"] == got["GGML_AMX_BF16"] == "OFF"


def test_amd_with_avx512_and_no_amx():
    got = switches(AMD_AVX512)
    assert got["GGML_AVX512"] == got["GGML_AVX512_BF16"] == got["GGML_AVX512_VNNI"] == "ON"
    assert got["GGML_AVX_VNNI"] == "OFF"  # this CPU has it only as AVX-512 VNNI
    assert all(got[k] == "OFF" for k in llama_build.AMX_SWITCHES)


def test_a_cpu_without_avx512_gets_no_avx512_code():
    got = switches(AVX2_ONLY)
    assert got["GGML_AVX2"] == got["GGML_FMA"] == "ON"
    assert all(v == "OFF" for k, v in got.items() if k.startswith(("GGML_AVX512", "GGML_AMX")))
    # AVX-512 needs all five of F, CD, VL, DQ, BW (ggml compiles each): one missing turns it off
    assert switches(AVX2_ONLY + " avx512f avx512cd avx512vl avx512dq")["GGML_AVX512"] == "OFF"


def test_arm_keeps_the_native_build():
    assert switches("fp asimd sve", machine="aarch64") == {"GGML_NATIVE": "ON"}


def test_the_wheel_key_changes_with_the_switches():
    intel, amd = (
        llama_build.cmake_args("x86_64", llama_build.cpu_flags(f"flags : {f}")) for f in (INTEL_AMX, AMD_AVX512)
    )
    assert llama_build.build_key(intel, "llama-cpp-python==0.3.36") != llama_build.build_key(
        amd, "llama-cpp-python==0.3.36"
    )
    assert llama_build.build_key(amd, "llama-cpp-python==0.3.36") == llama_build.build_key(
        amd, "llama-cpp-python==0.3.36"
    )
