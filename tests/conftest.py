import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_SPEC = ROOT / "specs" / "tiny.yaml"


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _built_bundle(env: str, name: str) -> Path:
    path = Path(os.environ.get(env, ROOT / "generated" / name))
    if not (path / "manifest.json").is_file():
        pytest.fail(f"{path} is not built: run `cuteaot build specs/{name}.yaml` first")
    return path


@pytest.fixture(scope="session")
def tiny_bundle_dir() -> Path:
    """The tiny bundle built by `make kernels SPEC=specs/tiny.yaml` (or CUTEAOT_TEST_BUNDLE)."""
    return _built_bundle("CUTEAOT_TEST_BUNDLE", "tiny")


@pytest.fixture(scope="session")
def gemm_bundle_dir() -> Path:
    """The GEMM test bundle built by `cuteaot build specs/tiny-gemm.yaml` (or CUTEAOT_GEMM_BUNDLE)."""
    return _built_bundle("CUTEAOT_GEMM_BUNDLE", "tiny-gemm")


@pytest.fixture(scope="session")
def probe_bundle_dir() -> Path:
    """The intrinsic probe bundle built by `cuteaot build specs/probes.yaml` (or CUTEAOT_PROBE_BUNDLE)."""
    return _built_bundle("CUTEAOT_PROBE_BUNDLE", "probes")


@pytest.fixture(scope="session")
def modelopt_bundle_dir() -> Path:
    """Layers read as ModelOpt stores them: `cuteaot build specs/tiny-modelopt.yaml` (or CUTEAOT_MODELOPT_BUNDLE)."""
    return _built_bundle("CUTEAOT_MODELOPT_BUNDLE", "tiny-modelopt")


@pytest.fixture(scope="session")
def fused_bundle_dir() -> Path:
    """The fused MoE test bundle built by `cuteaot build specs/tiny-fused.yaml` (or CUTEAOT_FUSED_BUNDLE)."""
    return _built_bundle("CUTEAOT_FUSED_BUNDLE", "tiny-fused")
