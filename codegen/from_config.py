"""A spec from a Hugging Face model's `config.json`: the routed experts of its MoE layers.

    cuteaot spec path/to/model [-o specs/model.yaml] [--targets h200,h100] [--tp 1,2,4] [--ep]
                 [--weights nvfp4 | modelopt | modelopt_w31] [--dtype bf16 | fp16] [--max-tokens 16384]

A model's MoE layers share one routed-expert shape (hidden size, expert intermediate size, expert
count, top-k, activation), which is all a spec needs.  Configs name these differently per family,
so each quantity is read from the first of a few keys (`_KEYS`); where a config holds two keys for
the same count they must agree.  Multimodal configs keep the language model's in `text_config`.
What is read, and from which key, goes into the spec's header, and the spec is validated
(`load_spec`: sizes, tensor-parallel degrees, plans) before it is written.

Model families whose activation or router is not in the config are named in `_FAMILY`: gpt-oss
(SwiGLU-OAI with the config's `swiglu_limit`, expert biases) and Llama 4 (router weight applied to
the expert input).  Shared experts (DeepSeek, Qwen2-MoE, ...) are a dense MLP outside this layer.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from cuteaot.runtime.errors import BadInputError
from cuteaot.runtime.types import SWIGLUOAI_DEFAULT_LIMIT, Activation, DType, WeightFormat

CONFIG_FILE = "config.json"
DEFAULT_TARGETS = ("h200", "h100")  # the profiles the product is measured on (others build, untuned)
DEFAULT_MAX_TOKENS = 16384  # the largest bucket of the shipped specs; larger calls run in chunks

# quantity -> config keys, most specific first: an expert's intermediate size is `moe_intermediate_size`
# where a config also has the dense MLP's `intermediate_size`
_KEYS = {
    "hidden_size": ("hidden_size",),
    "intermediate_size": ("moe_intermediate_size", "intermediate_size"),
    "num_experts": ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts"),
    "top_k": ("num_experts_per_tok", "experts_per_token", "moe_k", "moe_top_k"),
    "activation": ("mlp_hidden_act", "hidden_act", "hidden_activation"),
    "dtype": ("torch_dtype", "dtype"),
}
# counts that several keys of one config may hold: they must agree (the others: the first key wins)
_AGREE = ("num_experts", "top_k")
_ACTIVATIONS = {"silu": Activation.SILU, "swish": Activation.SILU, "relu2": Activation.RELU2}
_DTYPES = {"bfloat16": DType.BF16, "float16": DType.FP16}
# model_type -> what its config does not say
_FAMILY = {
    "gpt_oss": dict(activation=Activation.SWIGLUOAI, bias=True),
    "llama4": dict(router_weight_on_input=True),
    "llama4_text": dict(router_weight_on_input=True),
}
_SHARED_EXPERT_KEYS = ("n_shared_experts", "shared_expert_intermediate_size", "num_shared_experts",
                       "moe_num_shared_experts")


@dataclass(frozen=True)
class ModelMoe:
    """The routed-expert shape of a model's MoE layers, with where each value came from."""

    name: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    activation: Activation
    dtype: DType
    swiglu_limit: float | None = None  # swigluoai's clamp where it differs from the runtime's default
    bias: bool = False
    router_weight_on_input: bool = False
    sources: dict[str, str] = field(default_factory=dict)  # quantity -> "key = value" it was read from
    notes: tuple[str, ...] = ()


def read_config(path: str | Path) -> tuple[dict, Path]:
    """The config of a model directory (its config.json) or of a config file, and the file read."""
    path = Path(path)
    file = path / CONFIG_FILE if path.is_dir() else path
    try:
        config = json.loads(file.read_text())
    except OSError as exc:
        raise BadInputError(f"cannot read {file}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise BadInputError(f"{file} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise BadInputError(f"{file} holds a JSON {type(config).__name__}, not a model config object")
    return config, file


def model_moe(config: dict, name: str, *, dtype: str | None = None, source: str = "config.json") -> ModelMoe:
    """The routed-expert shape of `config` (a Hugging Face config dict); BadInputError naming what is missing."""
    root = config
    if not _has_any(config, _KEYS["num_experts"]) and isinstance(config.get("text_config"), dict):
        config, source = config["text_config"], f"{source} text_config"  # a multimodal model's language model
    model_type = str(config.get("model_type", "unknown"))
    family = _FAMILY.get(model_type, {})
    sources: dict[str, str] = {}

    def read(quantity: str, required: bool = True):
        keys = _KEYS[quantity]
        found = [(k, config[k]) for k in keys if config.get(k) is not None]
        if not found and quantity == "dtype":  # a multimodal config may give it for the whole model only
            found = [(k, root[k]) for k in keys if root.get(k) is not None]
        if not found:
            if not required:
                return None
            what = "expert count" if quantity == "num_experts" else quantity.replace("_", " ")
            hint = " (a dense model? this builds MoE layers only)" if quantity == "num_experts" else ""
            raise BadInputError(f"{source} (model_type {model_type!r}) has no {what}{hint}: looked for "
                                f"{', '.join(keys)}; write the spec by hand (README, 'Your own model')")
        if quantity in _AGREE and len({json.dumps(v) for _, v in found}) > 1:
            raise BadInputError(f"{source} disagrees with itself on {quantity.replace('_', ' ')}: "
                                + ", ".join(f"{k} = {v!r}" for k, v in found))
        key, value = found[0]
        sources[quantity] = f"{key} = {json.dumps(value)}"
        return value

    sizes = {q: read(q) for q in ("hidden_size", "intermediate_size", "num_experts", "top_k")}
    for quantity, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadInputError(f"{source}: {sources[quantity]} is not a positive integer (per-layer lists, as "
                                "some multimodal configs hold, are not read: write the spec by hand)")

    activation = family.get("activation")
    if activation is None:
        act = read("activation")
        activation = _ACTIVATIONS.get(str(act).lower())
        if activation is None:
            raise BadInputError(f"{source}: activation {sources['activation']} is not served; the kernels "
                                f"run {sorted(_ACTIVATIONS)} (and gpt-oss's SwiGLU-OAI)")
    else:
        sources["activation"] = f"model_type = {json.dumps(model_type)}"
    swiglu_limit = None
    if activation is Activation.SWIGLUOAI:
        limit = config.get("swiglu_limit", SWIGLUOAI_DEFAULT_LIMIT)
        if float(limit) != SWIGLUOAI_DEFAULT_LIMIT:
            swiglu_limit = float(limit)
        sources["swiglu limit"] = f"swiglu_limit = {json.dumps(limit)}" if "swiglu_limit" in config else "default"

    if dtype is not None:
        chosen = DType(dtype)
        sources["dtype"] = "--dtype"
    else:
        raw = read("dtype", required=False)
        chosen = _DTYPES.get(str(raw).removeprefix("torch."))
        if chosen is None:
            raise BadInputError(f"{source}: the activations' dtype {sources.get('dtype', '(none given)')} is not "
                                "bfloat16 or float16; pass --dtype bf16 or --dtype fp16")

    notes = []
    shared = [k for k in _SHARED_EXPERT_KEYS if config.get(k)]
    if shared:
        notes.append(f"Shared experts ({', '.join(shared)}) are a dense MLP outside this layer.")
    quant = root.get("quantization_config") or config.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower() if isinstance(quant, dict) else ""
    algo = str(quant.get("quant_algo", "")).upper() if isinstance(quant, dict) else ""
    if method == "mxfp4":
        notes.append("MXFP4 checkpoint: load_moe_layer packs its blocks for these NVFP4 kernels exactly.")
    elif not (method == "modelopt" and "NVFP4" in algo):
        what = f"{method} {algo}".strip() + " checkpoint" if method else "Unquantized checkpoint"
        notes.append(f"{what[0].upper()}{what[1:]}: the kernels read NVFP4 (or MXFP4) experts; serve a ModelOpt "
                     "NVFP4 export of this model.")
    return ModelMoe(
        name=name, model_type=model_type, activation=activation, dtype=chosen, swiglu_limit=swiglu_limit,
        bias=bool(family.get("bias", False)), router_weight_on_input=bool(family.get("router_weight_on_input")),
        sources=sources, notes=tuple(notes), **sizes,
    )


def _has_any(config: dict, keys: tuple[str, ...]) -> bool:
    return any(config.get(k) is not None for k in keys)


def spec_name(path: Path, config: dict) -> str:
    """A bundle / problem name for the model: its directory's (or `_name_or_path`'s) last part, lowercased."""
    raw = Path(str(config.get("_name_or_path") or "")).name if path.name == CONFIG_FILE else path.name
    if path.name == CONFIG_FILE and not raw:
        raw = path.resolve().parent.name
    name = re.sub(r"[^a-z0-9._-]+", "-", raw.lower()).strip("-._")
    return name or str(config.get("model_type", "model")).replace("_", "-")


def token_buckets(max_tokens: int) -> list[int]:
    """Powers of two up to max_tokens, and max_tokens itself."""
    if max_tokens < 1:
        raise BadInputError(f"--max-tokens must be at least 1, got {max_tokens}")
    buckets = [1 << i for i in range(max_tokens.bit_length()) if 1 << i <= max_tokens]
    return buckets if buckets[-1] == max_tokens else buckets + [max_tokens]


def spec_text(moe: ModelMoe, *, source: str, targets: tuple[str, ...] = DEFAULT_TARGETS, tp: tuple[int, ...] = (),
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
    header += [f"# {note}" for note in moe.notes]
    header.append(f"# Build: cuteaot build <this file> (then cuteaot inspect --plans generated/{moe.name})")
    body = [f"bundle: {moe.name}", f"targets: [{', '.join(targets)}]", "moe:", f"  - name: {moe.name}"]
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
    moe = model_moe(config, name or spec_name(Path(model), config), dtype=dtype, source=str(file))
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
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return text, out
