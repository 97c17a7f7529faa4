"""Every launch a plan adds with a literal format string (`plan._add("kernel", grid, block,
"FMT", args)`) matches the kernel's parameter list in the CUDA sources: one format character
per parameter, of the parameter's kind. A mismatch only shows on a GPU (a wrong argument or a
crash); this catches it on any machine."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import strata.backends.cuda as cuda_pkg

CUDA_DIR = Path(cuda_pkg.__file__).parent
KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?'
                    r'(\w+)\s*\(([^)]*)\)', re.S)
LAUNCH = re.compile(r'_add\(\s*"(\w+)",[^"]*?"([A-Za-z]+)"', re.S)


def kind(param: str) -> str | None:
    """The format character of a kernel parameter: 'P' for a pointer or a 64-bit unsigned
    value (addresses), 'q' a long long, 'i' an int, 'f' a float; None for a macro's name (a
    parameter list pasted in by the preprocessor)."""
    text = " ".join(param.replace("__restrict__", " ").split())
    if "*" in text or "unsigned long long" in text:
        return "P"
    if "long long" in text:
        return "q"
    if re.search(r"\b(int|unsigned int|unsigned)\b", text):
        return "i"
    if re.search(r"\bfloat\b", text):
        return "f"
    if re.fullmatch(r"[A-Z_][A-Z0-9_]*", text):
        return None
    raise AssertionError(f"unknown parameter kind: {param!r}")


def kernels() -> dict[str, list[str]]:
    out = {}
    for path in sorted(CUDA_DIR.glob("*.cu")):
        for name, params in KERNEL.findall(path.read_text()):
            if name == "__launch_bounds__":  # a kernel whose name a macro pastes together
                continue
            kinds = [kind(p) for p in params.split(",") if p.strip()]
            if None not in kinds:
                out[name] = kinds
    return out


def launches() -> list[tuple[str, str, str]]:
    out = []
    for path in sorted(CUDA_DIR.glob("*.py")):
        for name, fmt in LAUNCH.findall(path.read_text()):
            out.append((path.name, name, fmt))
    return out


def test_the_sources_hold_kernels_and_literal_launches():
    found = kernels()
    assert {"tier_groups", "tier_groups_keep", "pool_publish", "moe_combine_pool",
            "pool_wait", "quantize_q8"} <= set(found)
    assert len(launches()) >= 20


@pytest.mark.parametrize("where,name,fmt", launches(), ids=lambda v: str(v))
def test_a_literal_launch_matches_its_kernel(where, name, fmt):
    params = kernels().get(name)
    if params is None:
        pytest.skip(f"{name} is not a plain extern \"C\" kernel in the sources")
    assert len(fmt) == len(params), (f"{where}: {name} takes {len(params)} parameters "
                                     f"({''.join(params)}), the launch gives {len(fmt)} ({fmt})")
    for i, (got, want) in enumerate(zip(fmt, params)):
        assert got == want, (f"{where}: {name} parameter {i} is '{want}', the launch gives "
                             f"'{got}' ({fmt} against {''.join(params)})")
