"""Build a bundle of hand-picked kernel keys for the tuning tools (tune_gemm, tune_wgmma).

The planner-driven `cuteaot build` compiles what a spec resolves to; a tuning tool needs
kernels the planner would *not* pick, so it names the keys itself and this writes them as an
ordinary bundle (H200 profile, sm_90a) that `load_bundle` reads.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def build_variant_bundle(name: str, keys, out: str, source: str) -> None:
    from cuteaot.codegen.build import _compile_all, _manifest, source_fingerprint, toolchain, write_bundle
    from cuteaot.codegen.enumerate import Job
    from cuteaot.codegen.spec import BundleSpec
    from cuteaot.runtime.devices import PROFILES
    from cuteaot.runtime.kernels import route_pack_specs

    keys = list(keys) + [s.key() for s in route_pack_specs()]
    jobs = sorted({Job.of(key, "sm_90a") for key in keys})
    compiled = _compile_all(jobs, 2, True)
    records, cubins = [], {}
    for job in jobs:
        record, data = compiled[job]
        rel = f"{job.arch}/{job.key.digest}.cubin"
        records.append(dict(record, file=rel, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data)))
        cubins[rel] = data
    spec = BundleSpec(name, (PROFILES["h200"],), (), source, "-")
    write_bundle(Path(out) / name, _manifest(spec, records, source_fingerprint(), toolchain(), None), cubins)
    print(f"built {len(jobs)} kernels into {out}/{name}")
