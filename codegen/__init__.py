"""cuteaot codegen: YAML specs -> CuTeDSL compilation -> cubin bundle + manifest.

Importing this package does not import CuTeDSL; only compiling does.
"""

from .build import build, merge
from .spec import BundleSpec, MoeProblem, load_spec

__all__ = ["build", "merge", "load_spec", "BundleSpec", "MoeProblem"]
