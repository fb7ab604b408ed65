"""A Hugging Face model's `config.json` -> the routed-expert shape of its MoE layers.

A model's MoE layers share one routed-expert shape (hidden size, expert intermediate size, expert
count, top-k, activation), which is what a spec (`cuteaot spec`) and a layer (`load_model_moe`)
need.  Configs name these differently per family, so each quantity is read from the first of a
few keys (`_KEYS`); where a config holds two keys for the same count they must agree.  Multimodal
configs keep the language model's in `text_config`.  Model families whose activation or router is
not in the config are named in `_FAMILY`: gpt-oss (SwiGLU-OAI with the config's `swiglu_limit`,
expert biases) and Llama 4 (router weight applied to the expert input).  Shared experts
(DeepSeek, Qwen2-MoE, ...) are a dense MLP outside this layer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import BadInputError
from .types import SWIGLUOAI_DEFAULT_LIMIT, Activation, DType

CONFIG_FILE = "config.json"
MODELOPT_QUANT_FILE = "hf_quant_config.json"  # {"producer": {"name": "modelopt"}, "quantization": {"quant_algo"...}}

# quantity -> config keys, most specific first: an expert's intermediate size is `moe_intermediate_size`
# where a config also has the dense MLP's `intermediate_size`
_KEYS = {
    # a latent MoE (Nemotron-H's moe_latent_size) runs its routed experts on the latent width
    "hidden_size": ("moe_latent_size", "hidden_size"),
    "intermediate_size": ("moe_intermediate_size", "intermediate_size"),
    "num_experts": ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts"),
    "top_k": ("num_experts_per_tok", "experts_per_token", "moe_k", "moe_top_k"),
    "activation": ("mlp_hidden_act", "hidden_act", "hidden_activation"),
    "dtype": ("torch_dtype", "dtype"),
    "num_layers": ("num_hidden_layers", "num_layers", "n_layers"),
}
# counts that several keys of one config may hold: they must agree (the others: the first key wins)
_AGREE = ("num_experts", "top_k")
_ACTIVATIONS = {"silu": Activation.SILU, "swish": Activation.SILU, "relu2": Activation.RELU2}
# model_type -> what its config does not say
_FAMILY = {
    "gpt_oss": dict(activation=Activation.SWIGLUOAI, bias=True),
    "llama4": dict(router_weight_on_input=True),
    "llama4_text": dict(router_weight_on_input=True),
}
_SHARED_EXPERT_KEYS = ("n_shared_experts", "shared_expert_intermediate_size", "num_shared_experts",
                       "moe_num_shared_experts")


@dataclass(frozen=True)
class MoeConfig:
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
    quant_method: str = ""  # the checkpoint's quantization_config.quant_method ("modelopt", "mxfp4", ...), or ""
    num_layers: int | None = None  # the main model's decoder layers (num_hidden_layers), where the config says


def read_config(path: str | Path) -> tuple[dict, Path]:
    """The config of a model directory (its config.json) or of a config file, and the file read.

    A ModelOpt export that states its quantization in `hf_quant_config.json` beside config.json (older
    exports do; config.json then has no `quantization_config`) gets it as config.json would say it:
    {"quant_method": "modelopt", "quant_algo": ...}."""
    path = Path(path)
    if not path.exists() and not path.is_absolute() and len(path.parts) == 2 and not str(path).startswith("."):
        raise BadInputError(f"{path} does not exist here; if it is a Hugging Face repository id, download the model "
                            f"first (e.g. `huggingface-cli download {path}`) and pass its local directory")
    file = path / CONFIG_FILE if path.is_dir() else path
    config = _read_json(file, "a model config")
    quant_file = file.parent / MODELOPT_QUANT_FILE
    if "quantization_config" not in config and quant_file.is_file():
        quant = _read_json(quant_file, "a ModelOpt quantization config").get("quantization")
        if not isinstance(quant, dict):
            raise BadInputError(f"{quant_file} has no 'quantization' object (ModelOpt writes its quant_algo there)")
        config = dict(config, quantization_config=dict(quant, quant_method="modelopt"))
    return config, file


def _read_json(file: Path, what: str) -> dict:
    try:
        found = json.loads(file.read_text())
    except OSError as exc:
        raise BadInputError(f"cannot read {file}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise BadInputError(f"{file} is not JSON: {exc}") from None
    if not isinstance(found, dict):
        raise BadInputError(f"{file} holds a JSON {type(found).__name__}, not {what} object")
    return found


def moe_config(config: dict, name: str, *, dtype: str | None = None, source: str = "config.json") -> MoeConfig:
    """The routed-expert shape of `config` (a Hugging Face config dict); BadInputError naming what is missing."""
    r = _Reader(config, source)
    family = _FAMILY.get(r.model_type, {})
    # the expert count first: a dense model fails there, with the hint
    sizes = {q: r.value(q) for q in ("num_experts", "top_k", "hidden_size", "intermediate_size")}
    for quantity, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadInputError(f"{r.source}: {r.sources[quantity]} is not a positive integer (per-layer lists, as "
                                "some multimodal configs hold, are not read: write the spec by hand)")
    activation = family.get("activation") or r.activation()
    if "activation" in family:
        r.sources["activation"] = f"model_type = {json.dumps(r.model_type)}"
    return MoeConfig(
        name=name, model_type=r.model_type, activation=activation, dtype=r.dtype(dtype),
        swiglu_limit=r.swiglu_limit() if activation is Activation.SWIGLUOAI else None,
        bias=bool(family.get("bias", False)), router_weight_on_input=bool(family.get("router_weight_on_input")),
        sources=r.sources, notes=r.notes(), quant_method=r.quant_method(), num_layers=r.num_layers(), **sizes,
    )


class _Reader:
    """One config's values by quantity (`_KEYS`), recording the key each came from in `sources`."""

    def __init__(self, config: dict, source: str):
        self.root, self.config, self.source = config, config, source
        if not _has_any(config, _KEYS["num_experts"]) and isinstance(config.get("text_config"), dict):
            self.config, self.source = config["text_config"], f"{source} text_config"  # a multimodal model's LM
        self.model_type = str(self.config.get("model_type", "unknown"))
        self.sources: dict[str, str] = {}

    def value(self, quantity: str, required: bool = True):
        keys = _KEYS[quantity]
        found = [(k, self.config[k]) for k in keys if self.config.get(k) is not None]
        if not found and quantity == "dtype":  # a multimodal config may give it for the whole model only
            found = [(k, self.root[k]) for k in keys if self.root.get(k) is not None]
        if not found:
            if not required:
                return None
            what = "expert count" if quantity == "num_experts" else quantity.replace("_", " ")
            hint = " (a dense model? this builds MoE layers only)" if quantity == "num_experts" else ""
            raise BadInputError(f"{self.source} (model_type {self.model_type!r}) has no {what}{hint}: looked for "
                                f"{', '.join(keys)}; give the layer's sizes by hand (a spec; load_moe_layer and "
                                "MoeLayer)")
        if quantity in _AGREE and len({json.dumps(v) for _, v in found}) > 1:
            raise BadInputError(f"{self.source} disagrees with itself on {quantity.replace('_', ' ')}: "
                                + ", ".join(f"{k} = {v!r}" for k, v in found))
        key, value = found[0]
        self.sources[quantity] = f"{key} = {json.dumps(value)}"
        return value

    def num_layers(self) -> int | None:
        value = self.value("num_layers", required=False)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    def activation(self) -> Activation:
        activation = _ACTIVATIONS.get(str(self.value("activation")).lower())
        if activation is None:
            raise BadInputError(f"{self.source}: activation {self.sources['activation']} is not served; the kernels "
                                f"run {sorted(_ACTIVATIONS)} (and gpt-oss's SwiGLU-OAI)")
        return activation

    def swiglu_limit(self) -> float | None:
        """SwiGLU-OAI's clamp, None where it is the runtime's default (as the shipped specs leave it)."""
        limit = self.config.get("swiglu_limit", SWIGLUOAI_DEFAULT_LIMIT)
        self.sources["swiglu limit"] = f"swiglu_limit = {json.dumps(limit)}" if "swiglu_limit" in self.config \
            else "default"
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
            raise BadInputError(f"{self.source}: {self.sources['swiglu limit']} is not a positive number (SwiGLU-OAI "
                                "clamps its gate and up inputs by it; gpt-oss uses 7.0)")
        return None if float(limit) == SWIGLUOAI_DEFAULT_LIMIT else float(limit)

    def dtype(self, chosen: str | None) -> DType:
        if chosen is not None:
            found = DType.parse(chosen)
            if found is None:
                raise BadInputError(f"dtype {chosen!r} is not one of {[d.value for d in DType]} (or bfloat16 / float16)")
            self.sources["dtype"] = "--dtype"
            return found
        found = DType.parse(str(self.value("dtype", required=False)))
        if found is None:
            raise BadInputError(f"{self.source}: the activations' dtype {self.sources.get('dtype', '(none given)')} "
                                "is not bfloat16 or float16; choose one: dtype=\"bf16\" or \"fp16\" "
                                "(cuteaot spec --dtype)")
        return found

    def _quantization(self) -> dict:
        quant = self.root.get("quantization_config") or self.config.get("quantization_config") or {}
        return quant if isinstance(quant, dict) else {}

    def quant_method(self) -> str:
        return str(self._quantization().get("quant_method", "")).lower()

    def notes(self) -> tuple[str, ...]:
        """What the spec's reader should know: shared experts left out, a checkpoint that is not NVFP4."""
        notes = []
        if self.sources.get("hidden_size", "").startswith("moe_latent_size"):
            notes.append(f"Latent MoE: the routed experts run on {self.sources['hidden_size']}; the projections "
                         "to and from it (fc1_latent_proj, fc2_latent_proj) are outside this layer.")
        shared = [k for k in _SHARED_EXPERT_KEYS if self.config.get(k)]
        if shared:
            notes.append(f"Shared experts ({', '.join(shared)}) are a dense MLP outside this layer.")
        method, algo = self.quant_method(), str(self._quantization().get("quant_algo", "")).upper()
        if method == "mxfp4":
            notes.append("MXFP4 checkpoint: load_moe_layer packs its blocks for these NVFP4 kernels exactly.")
        elif not self._nvfp4():
            if method:
                what = f"{method} {algo or self._quantization().get('format', '')}".strip() + " checkpoint"
            else:
                what = "Unquantized checkpoint"
            notes.append(f"{what[0].upper()}{what[1:]}: the kernels read NVFP4 (or MXFP4) experts; serve an NVFP4 "
                         "export of this model (ModelOpt, or llm-compressor's compressed-tensors).")
        return tuple(notes)

    def _nvfp4(self) -> bool:
        """An NVFP4 checkpoint: ModelOpt's quant_algo NVFP4, or compressed-tensors weights of 4-bit floats
        with a scale per 16 (its "nvfp4-pack-quantized" format; W4A4 or W4A16 alike)."""
        quant = self._quantization()
        method = self.quant_method()
        if method == "modelopt":
            return "NVFP4" in str(quant.get("quant_algo", "")).upper()
        if method != "compressed-tensors":
            return False
        groups = quant.get("config_groups")
        weights = [g.get("weights") or {} for g in groups.values() if isinstance(g, dict)] \
            if isinstance(groups, dict) else []
        return quant.get("format") == "nvfp4-pack-quantized" or any(
            w.get("num_bits") == 4 and w.get("type") == "float" and w.get("group_size") == 16 for w in weights)


def _has_any(config: dict, keys: tuple[str, ...]) -> bool:
    return any(config.get(k) is not None for k in keys)
