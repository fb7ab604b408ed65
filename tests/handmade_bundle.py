"""A bundle written by hand: a manifest and placeholder cubins, as `cuteaot build` lays them out.

`verify` and `inspect` never parse a cubin, so these tests need neither CuTeDSL nor a GPU.
Every field follows `runtime/manifest.schema.json` (test_manifest_containment validates it).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from cuteaot.runtime.keys import KernelKey
from cuteaot.runtime.manifest import MANIFEST_NAME, SCHEMA_VERSION

TARGETS = [
    {"name": "h200", "arch": "sm_90a", "compute_capability": [9, 0], "sm_count": 132,
     "max_shared_memory_per_block_optin": 232448},
    {"name": "b200", "arch": "sm_100a", "compute_capability": [10, 0], "sm_count": 148,
     "max_shared_memory_per_block_optin": 232448},
    {"name": "rtx-pro-6000", "arch": "sm_120a", "compute_capability": [12, 0], "sm_count": 188,
     "max_shared_memory_per_block_optin": 101376},
]
# One symbol for every kernel, as CuTeDSL names all kernels of a family alike: longer than any
# column, so only the key tells the rows apart.
SYMBOL = "kernel_cutlass_kernel_cuteaotcodegenkernelsactivationActivationKernel_object_at__" + "ptrbf16gmemalign16_" * 8


def long_facts(i: int) -> dict:
    """Facts whose `k=v` text is far wider than a terminal (like the GEMM's)."""
    return {"index": i, **{f"tile_parameter_{n:02d}": f"value-{n}-of-a-long-fact" for n in range(20)}}


def kernel_record(arch: str, family: str, facts: dict, data: bytes) -> dict:
    key = KernelKey(family, 1, facts).digest
    return {
        "key": key, "family": family, "version": 1, "facts": facts, "arch": arch,
        "file": f"{arch}/{key}.cubin", "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
        "symbol": SYMBOL, "params": [{"name": "x", "kind": "ptr", "size": 8, "align": 8}],
        "block": [256, 1, 1], "dynamic_smem_bytes": 0, "static_smem_bytes": 0, "registers": 32,
        "stack_bytes": 0, "local_bytes": 0, "min_blocks_per_sm": None, "compiler": "handmade",
        "compile_seconds": 0.0,
    }


def write_bundle(bundle_dir: Path, archs=("sm_100a", "sm_90a", "sm_120a"), per_arch: int = 2) -> Path:
    """A verifiable bundle with `per_arch` kernels for each arch; returns `bundle_dir`."""
    kernels = []
    for arch in archs:
        for i in range(per_arch):
            data = f"placeholder cubin {arch} {i}".encode() * 8
            record = kernel_record(arch, "moe_activation", long_facts(i), data)
            (bundle_dir / arch).mkdir(parents=True, exist_ok=True)
            (bundle_dir / record["file"]).write_bytes(data)
            kernels.append(record)
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "bundle": "handmade",
        "toolchain": {"python": "3.11.7", "nvidia-cutlass-dsl": "4.8.1", "nvidia-cutlass-dsl-libs-base": "4.8.1",
                      "nvidia-cuda-cuobjdump": "13.0"},
        "source_fingerprint": "0" * 64,
        "plan_fingerprint": "2" * 64,
        "spec": {"file": "handmade.yaml", "sha256": "1" * 64},
        "targets": [t for t in TARGETS if t["arch"] in archs],
        "shard": None,
        "kernels": kernels,
        "resolution": [],  # element-wise kernels only: nothing is planned per token count
    }
    write_manifest(bundle_dir, manifest)
    return bundle_dir


def read(bundle_dir: Path) -> dict:
    return json.loads((bundle_dir / MANIFEST_NAME).read_text())


def write_manifest(bundle_dir: Path, manifest: dict) -> None:
    (bundle_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
