"""A spec from a Hugging Face model's `config.json` (runtime/model_config.py reads it).

    cuteaot spec path/to/model [-o specs/model.yaml] [--targets h200,h100] [--tp 1,2,4] [--ep]
                 [--weights nvfp4 | modelopt | modelopt_w31] [--dtype bf16 | fp16] [--max-tokens 16384]

The spec has one fused MoE problem of the model's routed-expert shape, a header saying which config
key each value came from, and is validated (`load_spec`: sizes, tensor-parallel degrees, plans)
before it is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from pathlib import Path

from cuteaot.runtime.errors import BadInputError
from cuteaot.runtime.model_config import CONFIG_FILE, MoeConfig, moe_config, read_config
from cuteaot.runtime.types import SWIGLUOAI_DEFAULT_LIMIT, Activation, WeightFormat
from cuteaot.runtime.parallel import mxfp4_tp_blocks

DEFAULT_TARGETS = ("h200", "h100")  # the profiles the product is measured on (others build, untuned)
DEFAULT_MAX_TOKENS = 16384  # the largest bucket of the shipped specs; larger calls run in chunks
HF_CACHE_PREFIX = "models--"  # huggingface_hub's cache: models--<org>--<name>/snapshots/<commit>/
NOTE_PREFIX = "# note: "  # a header line with something the user must know about the checkpoint


def spec_name(path: Path, config: dict) -> str:
    """A bundle / problem name for the model: its directory's (or `_name_or_path`'s) last part, lowercased;
    in the Hugging Face cache (models--<org>--<name>/snapshots/<commit>) the model's name, not the commit."""
    # absolute, not resolved: the cache's snapshots/<commit>/config.json is a link into its blobs/
    directory = Path(os.path.abspath(path.parent if path.name == CONFIG_FILE else path))
    cached = directory.parent.parent.name if directory.parent.name == "snapshots" else ""
    if cached.startswith(HF_CACHE_PREFIX):
        raw = cached.split("--")[-1]
    elif path.name == CONFIG_FILE:
        raw = Path(str(config.get("_name_or_path") or "")).name or directory.name
    else:
        raw = directory.name
    return _safe_name(raw) or str(config.get("model_type", "model")).replace("_", "-")


def _safe_name(raw: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", raw.lower()).strip("-._")


def notes_of(text: str) -> list[str]:
    """The notes a spec's header carries about its checkpoint (shared experts, weight format), one string each."""
    return [line[2:] for line in text.splitlines() if line.startswith(NOTE_PREFIX)]


def token_buckets(max_tokens: int) -> list[int]:
    """Powers of two up to max_tokens, and max_tokens itself."""
    if max_tokens < 1:
        raise BadInputError(f"--max-tokens must be at least 1, got {max_tokens}")
    buckets = [1 << i for i in range(max_tokens.bit_length()) if 1 << i <= max_tokens]
    return buckets if buckets[-1] == max_tokens else buckets + [max_tokens]


def spec_text(moe: MoeConfig, *, source: str, targets: tuple[str, ...] = DEFAULT_TARGETS, tp: tuple[int, ...] = (),
              ep: bool = False, weights: str = WeightFormat.NVFP4.value,
              max_tokens: int = DEFAULT_MAX_TOKENS) -> str:
    """The spec's YAML: a header saying where each value came from, then one fused MoE problem."""
    rows = [("hidden_size", moe.hidden_size), ("intermediate_size", moe.intermediate_size),
            ("num_experts", moe.num_experts), ("top_k", moe.top_k), ("activation", moe.activation.value),
            ("dtype", moe.dtype.value)]
    read = rows + ([("swiglu limit", moe.swiglu_limit or SWIGLUOAI_DEFAULT_LIMIT)]
                   if moe.activation is Activation.SWIGLUOAI else [])
    width = max(len(f"{q} {v}") for q, v in read)
    header = [f"# {moe.name}: the routed experts of {source} (model_type {moe.model_type}), by `cuteaot spec`."]
    header += [f"#   {f'{q} {v}'.ljust(width)}  <- {moe.sources[q]}" for q, v in read]
    if moe.bias:
        header.append(f"#   expert biases: {moe.model_type} checkpoints carry them")
    if moe.router_weight_on_input:
        header.append(f"#   router weight on the expert input: {moe.model_type} applies it there")
    header += [f"{NOTE_PREFIX}{note}" for note in moe.notes]
    header.append(f"# Build: cuteaot build <this file> (then cuteaot inspect --plans generated/{moe.name})")
    name = json.dumps(moe.name)  # quoted: a name such as 1.5 or true stays a string in YAML
    body = [f"bundle: {name}", f"targets: [{', '.join(targets)}]", "moe:", f"  - name: {name}"]
    body += [f"    {q}: {v}" for q, v in rows]
    if moe.swiglu_limit is not None:
        body.append(f"    swiglu: {{limit: {moe.swiglu_limit}}}")
    if moe.bias:
        body.append("    bias: true")
    if weights != WeightFormat.NVFP4.value:
        body.append(f"    weights: {weights}")
    if tp:
        body.append(f"    tp: [{', '.join(str(t) for t in tp)}]")
    body.append(f"    tokens: [{', '.join(str(t) for t in token_buckets(max_tokens))}]")
    variants = []
    if moe.router_weight_on_input:
        variants.append("router_weight_on_input: true")
    if ep:
        variants.append("expert_map: [false, true]")
    body.append(f"    fused: {{{', '.join(variants)}}}" if variants else "    fused: true")
    return "\n".join(header + body) + "\n"


def write_spec(model: str | Path, out: str | Path | None = None, *, name: str | None = None,
               dtype: str | None = None, **options) -> tuple[str, Path | None]:
    """Read the model's config, render its spec and validate it (load_spec); write it to `out` if given.

    Returns (the spec's text, the file written or None).  Nothing is written when validation fails.
    """
    from cuteaot.runtime.errors import SpecError

    from .spec import load_spec

    config, file = read_config(model)
    if name is not None and _safe_name(name) != name:
        raise BadInputError(f"--name {name!r}: a bundle name is lower-case letters, digits, '.', '_' and '-' "
                            f"(it names generated/<name>); e.g. {_safe_name(name) or 'my-model'!r}")
    moe = moe_config(config, name or spec_name(Path(model), config), dtype=dtype, source=str(file))
    if moe.quant_method == "mxfp4":  # the loader cuts W2 in whole MXFP4 blocks: refuse now what it would refuse
        for world in options.get("tp", ()):
            try:
                mxfp4_tp_blocks(moe.intermediate_size, 0, world)
            except BadInputError as exc:
                raise BadInputError(f"{file} (an MXFP4 checkpoint), tp={world}: {exc}") from None
    text = spec_text(moe, source=str(file), **options)
    with tempfile.TemporaryDirectory() as tmp:
        check = Path(tmp) / f"{moe.name}.yaml"
        check.write_text(text)
        try:  # sizes, tensor-parallel degrees, plans: what `cuteaot build` would refuse, refused now
            load_spec(check)
        except SpecError as exc:
            problem = str(exc).split(": ", 1)[-1]  # the field and the message, not the temporary file
            raise BadInputError(f"the spec of {file} would not build: {problem}") from None
    if out is None:
        return text, None
    out = Path(out)
    if out.is_dir():
        raise BadInputError(f"{out} is a directory; -o takes the spec file to write (e.g. {out / (moe.name + '.yaml')})")
    staging = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # a reader sees the old spec or the new one
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.write_text(text)
        os.replace(staging, out)
    except OSError as exc:
        with contextlib.suppress(OSError):  # (a staging file may not exist, nor its folder)
            staging.unlink(missing_ok=True)
        raise BadInputError(f"cannot write the spec to {out}: {exc.strerror or exc}") from None
    return text, out
