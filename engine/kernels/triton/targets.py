"""Compile Conveyor's Triton kernels for GPU targets on any host, no GPU needed (Triton carries
its own `ptxas`): every kernel in the forms the server launches (fp32, bf16 and fp16 queries;
caches of the same dtype or fp8; one split or several; with sinks or without; the sampler's),
down to a cubin for each target. A kernel that Triton's interpreter runs but the GPU compiler
rejects fails here, before a GPU host meets it.

    python -m engine.kernels.triton.targets 80 90      # Ampere and Hopper

Run without `TRITON_INTERPRET`: under the interpreter the kernels are not compiled.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from engine.kernels.triton import paged_attention as kernels
from engine.kernels.triton import sampling

COMPUTE = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}
FP8 = {"fp8_e4m3": ("fp8e4nv", 448.0), "fp8_e5m2": ("fp8e5", 57344.0)}
# e4m3 has no conversions before compute capability 8.9 (Ada, Hopper); the server refuses it
# there (`factory.kv_cache_dtype`).
E4M3_FROM = 89
INDEX_ARGS = (
    "table_ptr",
    "lens_ptr",
    "slots_ptr",
    "tile_rows_ptr",
    "tile_starts_ptr",
    "query_starts_ptr",
    "query_lens_ptr",
    "context_lens_ptr",
)
FLOAT_ARGS = ("scale",)
# The layer's key and value scales, read on the device.
SCALES = {"kv_scales_ptr": "fp32"}


@dataclass(frozen=True, slots=True)
class Form:
    """One kernel as launched: its pointer element types and its constants."""

    name: str
    kernel: Any
    pointers: dict[str, str]
    constants: dict[str, Any]
    warps: int = 4  # Triton's default, as the attention kernels launch

    def signature(self) -> dict[str, str]:
        types = {}
        for arg in self.kernel.arg_names:
            if arg in self.constants:
                types[arg] = "constexpr"
            elif arg in self.pointers:
                types[arg] = "*" + self.pointers[arg]
            elif arg in INDEX_ARGS:
                types[arg] = "*i64"
            elif arg in FLOAT_ARGS:
                types[arg] = "fp32"
            else:  # strides
                types[arg] = "i32"
        return types


def forms(arch: int) -> Iterator[Form]:
    """The forms the server may launch on `sm_<arch>`."""
    for compute in COMPUTE:
        caches = [(compute, 0.0)] + ([] if compute == "fp32" else list(FP8.values()))
        for cache, fp8_max in caches:
            if cache == "fp8e4nv" and arch < E4M3_FROM:
                continue
            tag = f"{compute} query, {cache} cache"
            yield from _attention_forms(compute, cache, tag, scaled=fp8_max > 0)
            if cache == compute:  # gpt-oss's sinks, in the model's dtype
                yield from _attention_forms(compute, cache, tag + ", sinks", False, sinks=True)
            yield Form(
                f"store ({tag})",
                kernels._store_kv_kernel,
                {"key_ptr": compute, "value_ptr": compute}
                | {"key_cache_ptr": cache, "value_cache_ptr": cache}
                | SCALES,
                dict(BLOCK=16, HEADS=8, HEADS_PAD=8, DIM=128, DIM_PAD=128, FP8_MAX=fp8_max),
            )
    yield Form(
        "nucleus sample",
        sampling._nucleus_sample_kernel,
        {"logits_ptr": "fp32", "noise_ptr": "fp32", "rows_ptr": "i64"}
        | {"top_p_ptr": "fp32", "min_p_ptr": "fp32", "out_ptr": "i64"},
        dict(BLOCK=sampling.BLOCK),
        warps=sampling.WARPS,
    )
    yield Form(
        "seeded noise",
        sampling._seeded_noise_kernel,
        {"noise_ptr": "fp32", "rows_ptr": "i64", "keys_ptr": "i64", "draws_ptr": "i32"},
        dict(BLOCK=sampling.BLOCK),
    )
    for sinks in (False, True):
        yield Form(
            "combine" + (" with sinks" if sinks else ""),
            kernels._combine_kernel,
            {"out_ptr": "bf16", "sinks_ptr": "bf16"}
            | {f"part_{p}_ptr": "fp32" for p in ("acc", "max", "sum")},
            dict(HEADS=12, DIM=128, DIM_PAD=128, SPLITS=4, SPLITS_PAD=4, SINKS=sinks),
        )


def _attention_forms(
    compute: str, cache: str, tag: str, scaled: bool, sinks: bool = False
) -> Iterator[Form]:
    """Decode in one split and in several, and prefill; with `sinks`, the forms that join them
    (split decode rows join them in the combine kernel)."""
    ieee = compute == "fp32"
    pointers = {"out_ptr": compute, "query_ptr": compute, "key_ptr": cache, "value_ptr": cache}
    pointers |= SCALES | {"sinks_ptr": compute}
    for splits in (1,) if sinks else (1, 4):
        yield Form(
            f"decode in {splits} split(s) ({tag})",
            kernels._paged_decode_kernel,
            pointers | {f"part_{p}_ptr": "fp32" for p in ("acc", "max", "sum")},
            dict(
                GROUP=6,
                GROUP_PAD=16,
                BLOCK=16,
                DIM=128,
                DIM_PAD=128,
                TILE_TOKENS=kernels.TILE,
                SPLITS=splits,
                SCALED=scaled,
                SINKS=sinks,
                IEEE=ieee,
                WIDEN=False,
            ),
        )
    yield Form(
        f"prefill ({tag})",
        kernels._paged_prefill_kernel,
        pointers,
        dict(
            GROUP=6,
            BLOCK=16,
            DIM=128,
            DIM_PAD=128,
            TILE_M=kernels.PREFILL_TILE,
            TILE_N=kernels.TILE,
            SCALED=scaled,
            SINKS=sinks,
            IEEE=ieee,
            WIDEN=False,
        ),
    )


def compile_for(arch: int) -> list[str]:
    """Compile every form for `sm_<arch>`; the failures, each named (empty when all compile)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    failures = []
    for form in forms(arch):
        source = ASTSource(fn=form.kernel, signature=form.signature(), constexprs=form.constants)
        try:
            compiled = triton_compile(
                source, target=GPUTarget("cuda", arch, 32), options={"num_warps": form.warps}
            )
            if not compiled.asm.get("cubin"):
                raise RuntimeError("no cubin")
        except Exception as error:
            lines = str(error).strip().splitlines() or [""]
            failures.append(f"sm_{arch} {form.name}: {type(error).__name__}: {lines[-1]}")
    return failures


def main(argv: list[str]) -> int:
    failures = [failure for arch in argv or ["80", "90"] for failure in compile_for(int(arch))]
    for failure in failures:
        print(failure)
    print(f"{len(failures)} of the forms failed to compile")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
