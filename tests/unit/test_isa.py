"""The instruction-set levels of the native kernels (kernels/native/isa.py): the host's level
from its feature flags, KDASERVE_ISA's cap, and the compiler flags a capped build gets (checked
against what g++ then defines, where there is a g++)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from kdaserve.kernels.native import isa

AVX2 = {"avx2", "fma"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}
ZEN4 = AVX512 | {"avx512_bf16"}
SPR = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}


def test_host_level_is_the_highest_whole_level() -> None:
    assert isa.host_level(set()) is None
    assert isa.host_level({"avx2"}) is None  # no FMA
    assert isa.host_level(AVX2) == "avx2"
    assert isa.host_level(AVX512) == "avx512"
    assert isa.host_level(ZEN4) == "avx512_bf16"
    assert isa.host_level(SPR) == "amx"
    assert isa.host_level(AVX2 | {"amx_tile", "amx_bf16", "amx_int8"}) == "avx2"  # no gaps


def test_a_cap_lowers_and_never_raises() -> None:
    assert isa.resolve("amx", None) == "amx"
    assert isa.resolve("amx", "") == "amx"
    assert isa.resolve("amx", "AVX2") == "avx2"
    assert isa.resolve("avx512_bf16", "avx512") == "avx512"
    with pytest.raises(ValueError, match="above this CPU"):
        isa.resolve("avx512", "amx")
    with pytest.raises(ValueError, match="not one of"):
        isa.resolve("amx", "sse2")
    with pytest.raises(ValueError, match="above this CPU"):
        isa.resolve(None, "avx2")


def test_compile_flags_turn_off_what_is_above_the_level() -> None:
    assert isa.compile_flags("amx", "amx") == ["-march=native"]
    assert isa.compile_flags(None, None) == ["-march=native"]
    flags = isa.compile_flags("avx512", "amx")
    assert "-mno-avx512bf16" in flags and "-mno-amx-tile" in flags and "-mno-avx512f" not in flags
    assert "-mno-avx512f" in isa.compile_flags("avx2", "avx512_bf16")


def defines(flags: list[str]) -> set[str]:
    out = subprocess.run(["g++", *flags, "-dM", "-E", "-x", "c++", "/dev/null"],
                         capture_output=True, text=True, check=True).stdout
    return {line.split()[1] for line in out.splitlines() if line.startswith("#define")}


@pytest.mark.skipif(shutil.which("g++") is None or not isa.supported(),
                    reason="needs g++ on an x86 host with AVX2")
@pytest.mark.parametrize("level", isa.supported())
def test_a_capped_build_has_exactly_its_level(level: str) -> None:
    """What the kernels branch on, at every level this host supports."""
    host = isa.supported()[-1]
    got = defines(isa.compile_flags(level, host))
    rank = isa.LEVELS.index(level)
    assert "__AVX2__" in got and "__FMA__" in got
    assert ("__AVX512F__" in got) == (rank >= 1)
    assert ("__AVX512BF16__" in got) == (rank >= 2)
    assert ("__AMX_TILE__" in got) == (rank >= 3)


def test_bf16_dots_need_the_level_and_follow_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isa, "level", lambda: "avx512")
    monkeypatch.setenv(isa.BF16_DOTS_ENV, "1")
    assert not isa.bf16_dots()  # no BF16 instructions at this level, whatever is asked
    monkeypatch.setattr(isa, "level", lambda: "amx")
    assert isa.bf16_dots()
    monkeypatch.setenv(isa.BF16_DOTS_ENV, "0")
    assert not isa.bf16_dots()
    monkeypatch.setenv(isa.BF16_DOTS_ENV, "yes")
    with pytest.raises(ValueError, match="0 or 1"):
        isa.bf16_dots()
    monkeypatch.delenv(isa.BF16_DOTS_ENV)
    for vendor, want in (("AuthenticAMD", True), ("GenuineIntel", False), ("", False)):
        monkeypatch.setattr(isa, "cpu_vendor", lambda vendor=vendor: vendor)
        assert isa.bf16_dots() == want
