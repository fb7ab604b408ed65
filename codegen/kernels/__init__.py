"""CuTeDSL device code, one module per kernel family.

Each module exposes `build(spec) -> (kernel_object, fake_args)`: the object and
arguments that `cute.compile` turns into one device kernel whose parameters
match the family's runtime signature.
"""
