"""cuteaot codegen: YAML specs -> CuTeDSL compilation -> cubin bundle + manifest.

Importing this package does not import CuTeDSL; only compiling does.  On a serving
machine (torch + cuda-bindings + cuteaot, without the `codegen` extra) the package
still imports, so that `cuteaot verify` and `cuteaot inspect` run there; the build
API then raises an ImportError that names the extra to install.
"""

# Modules only the `codegen` extra installs (PyYAML, CuTeDSL).
CODEGEN_EXTRA_MODULES = ("yaml", "cutlass")

try:
    from .build import build, merge
    from .spec import BundleSpec, MoeProblem, load_spec
except ModuleNotFoundError as exc:
    if exc.name is None or exc.name.split(".")[0] not in CODEGEN_EXTRA_MODULES:
        raise
    _missing = exc

    def __getattr__(name: str):
        if name in __all__:
            raise ImportError(
                f"cuteaot.codegen.{name} needs the codegen extra (module {_missing.name!r} is not installed): "
                "pip install 'cuteaot[codegen]'"
            ) from _missing
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["build", "merge", "load_spec", "BundleSpec", "MoeProblem"]
