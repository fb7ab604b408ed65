"""`cuteaot spec`: a spec from a Hugging Face config.json.

The configs below carry the MoE keys of the real models' config.json files (and their dense-MLP
sizes, which must not be taken for the experts'); each written spec must describe the same layer
as the hand-written problem of the shipped specs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cuteaot.codegen.cli import main
from cuteaot.codegen.from_config import spec_name, token_buckets, write_spec
from cuteaot.codegen.spec import load_spec
from cuteaot.runtime.errors import BadInputError
from cuteaot.runtime.model_config import moe_config
from cuteaot.runtime.types import Activation

ROOT = Path(__file__).resolve().parents[1]
BF16 = {"torch_dtype": "bfloat16"}
MODELOPT = {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}
CONFIGS = {
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                      "hidden_act": "silu", **BF16, **MODELOPT},
    "gpt-oss-120b": {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
                     "num_local_experts": 128, "num_experts_per_tok": 4, "experts_per_token": 4, "swiglu_limit": 7.0,
                     "hidden_act": "silu", **BF16, "quantization_config": {"quant_method": "mxfp4"}},
    "glm-4.5-air": {"model_type": "glm4_moe", "hidden_size": 4096, "intermediate_size": 10944,
                    "moe_intermediate_size": 1408, "n_routed_experts": 128, "n_shared_experts": 1,
                    "num_experts_per_tok": 8, "hidden_act": "silu", **BF16},
    "nemotron-3-nano": {"model_type": "nemotron_h", "hidden_size": 2688, "moe_intermediate_size": 1856,
                        "n_routed_experts": 128, "num_experts_per_tok": 6, "mlp_hidden_act": "relu2", **BF16},
    "mixtral-8x7b": {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                     "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_act": "silu", **BF16},
    "llama-4-scout": {"model_type": "llama4", **BF16,
                      "text_config": {"model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192,
                                      "intermediate_size_mlp": 16384, "num_local_experts": 16,
                                      "num_experts_per_tok": 1, "hidden_act": "silu"}},
    "ernie-4.5-21b-a3b": {"model_type": "ernie4_5_moe", "hidden_size": 2560, "intermediate_size": 12288,
                          "moe_intermediate_size": 1536, "moe_num_experts": 64, "moe_k": 6,
                          "moe_num_shared_experts": 2, "hidden_act": "silu", **BF16},
    "deepseek-v3": {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
                    "num_experts_per_tok": 8, "hidden_act": "silu", **BF16,
                    "quantization_config": {"quant_method": "fp8"}},
}
# model -> (shipped spec, its problem's name, options of `cuteaot spec`)
SHIPPED = {
    "qwen3-30b-a3b": ("moe-models.yaml", "qwen3-30b-a3b", {}),
    "gpt-oss-120b": ("moe-models.yaml", "gpt-oss-120b", {}),
    "glm-4.5-air": ("moe-models.yaml", "glm-4.5-air", {}),
    "nemotron-3-nano": ("moe-models.yaml", "nemotron-3-nano", {}),
    "mixtral-8x7b": ("moe-models.yaml", "mixtral-8x7b", {}),
    "llama-4-scout": ("bench-edge.yaml", "llama-4-scout", {}),
    "ernie-4.5-21b-a3b": ("bench-edge.yaml", "ernie-4.5-21b-a3b", {"dtype": "fp16"}),  # the edge spec's fp16 case
    "deepseek-v3": ("bench-unseen.yaml", "deepseek-v3-tp8", {"tp": (8,)}),
}
SHAPE = ("hidden_size", "intermediate_size", "num_experts", "top_k", "activation", "swiglu_alpha", "swiglu_beta",
         "swiglu_limit", "dtypes")


def _model_dir(tmp_path: Path, name: str, config: dict) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("model", sorted(CONFIGS))
def test_a_real_config_gives_the_shipped_layer(tmp_path, model):
    spec_file, problem, options = SHIPPED[model]
    text, written = write_spec(_model_dir(tmp_path, model, CONFIGS[model]), tmp_path / "out" / f"{model}.yaml",
                               **options)
    assert written.read_text() == text
    (mine,) = load_spec(written).moe
    want = next(p for p in load_spec(ROOT / "specs" / spec_file).moe if p.name == problem)
    assert mine.name == problem
    assert {f: getattr(mine, f) for f in SHAPE} == {f: getattr(want, f) for f in SHAPE}
    assert set(mine.biases) <= set(want.biases)
    assert mine.tokens == want.tokens or spec_file == "bench-edge.yaml"  # (the edge spec lists other buckets)
    assert (True in mine.biases) == (model == "gpt-oss-120b")  # its checkpoints carry expert biases
    on_input = {variant[0] for variant in mine.fused}
    assert on_input == ({True} if model == "llama-4-scout" else {False})  # Llama 4 weights the expert input


def test_the_header_says_where_each_value_came_from(tmp_path):
    text, _ = write_spec(_model_dir(tmp_path, "glm", CONFIGS["glm-4.5-air"]))
    assert "intermediate_size 1408  <- moe_intermediate_size = 1408" in text  # not the dense 10944
    assert "num_experts 128" in text and "<- n_routed_experts = 128" in text
    assert "Shared experts (n_shared_experts) are a dense MLP outside this layer." in text
    assert "Unquantized checkpoint: the kernels read NVFP4" in text and "serve an NVFP4 export" in text
    qwen, _ = write_spec(_model_dir(tmp_path, "qwen", CONFIGS["qwen3-30b-a3b"]))
    assert "NVFP4 export" not in qwen and "MXFP4" not in qwen
    oss, _ = write_spec(_model_dir(tmp_path, "oss", CONFIGS["gpt-oss-120b"]))
    assert "activation swigluoai    <- model_type = \"gpt_oss\"" in oss and "packs its blocks" in oss
    assert "swiglu limit 7.0        <- swiglu_limit = 7.0" in oss


def test_options_reach_the_spec(tmp_path):
    d = _model_dir(tmp_path, "Qwen3-30B-A3B-FP4", CONFIGS["qwen3-30b-a3b"])
    text, _ = write_spec(d, targets=("h200",), tp=(1, 2), ep=True, weights="modelopt", max_tokens=3000)
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(text)
    spec = load_spec(spec_file)
    assert spec.bundle == "qwen3-30b-a3b-fp4" and [t.name for t in spec.targets] == ["h200"]
    assert [p.name for p in spec.moe] == ["qwen3-30b-a3b-fp4-tp1", "qwen3-30b-a3b-fp4-tp2"]
    assert spec.moe[1].intermediate_size == 384 and spec.moe[0].weights[0].value == "modelopt"
    assert spec.moe[0].tokens[-2:] == (2048, 3000)
    assert {variant[1] for variant in spec.moe[0].fused} == {False, True}  # expert_map layers too
    assert token_buckets(1) == [1] and token_buckets(16) == [1, 2, 4, 8, 16]


@pytest.mark.parametrize("config, message", [
    ({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "hidden_act": "silu", **BF16},
     r"has no expert count \(a dense model\?"),
    ({**CONFIGS["mixtral-8x7b"], "num_experts": 16}, "disagrees with itself on num experts: num_local_experts = 8, "
                                                      "num_experts = 16"),
    ({**CONFIGS["mixtral-8x7b"], "hidden_act": "gelu"}, "activation hidden_act = \"gelu\" is not served"),
    ({**CONFIGS["mixtral-8x7b"], "torch_dtype": "float32"},
     r"is not bfloat16 or float16; choose one: dtype=\"bf16\" or \"fp16\" \(cuteaot spec --dtype\)"),
    ({**CONFIGS["ernie-4.5-21b-a3b"], "moe_num_experts": [64, 64]}, "is not a positive integer"),
    ({key: v for key, v in CONFIGS["mixtral-8x7b"].items() if key != "num_experts_per_tok"},
     "has no top k: looked for num_experts_per_tok, experts_per_token, moe_k, moe_top_k"),
])
def test_configs_that_cannot_be_read_say_why(config, message):
    with pytest.raises(BadInputError, match=message):
        moe_config(config, "m")


def test_an_mxfp4_checkpoint_refuses_tensor_parallel_degrees_that_cut_its_blocks(tmp_path):
    d = _model_dir(tmp_path, "oss", CONFIGS["gpt-oss-120b"])  # I = 2880: 1440 a rank at TP 2, 720 (22.5 blocks) at 4
    with pytest.raises(BadInputError, match=r"MXFP4 checkpoint\), tp=4: .* 720 is not a multiple of the MXFP4 block \(32\)"):
        write_spec(d, tp=(1, 2, 4))
    text, _ = write_spec(d, tp=(1, 2))
    assert "tp: [1, 2]" in text


def test_a_spec_that_would_not_build_is_not_written(tmp_path):
    d = _model_dir(tmp_path, "qwen", CONFIGS["qwen3-30b-a3b"])
    with pytest.raises(BadInputError, match=r"would not build: moe\[0\]\.tp: intermediate_size 768 is not divisible"):
        write_spec(d, tmp_path / "never.yaml", tp=(5,))
    assert not (tmp_path / "never.yaml").exists()


def test_the_command_writes_or_prints_the_spec(tmp_path, capsys):
    d = _model_dir(tmp_path, "mixtral", CONFIGS["mixtral-8x7b"])
    assert main(["spec", str(d / "config.json"), "--name", "mix", "-o", str(tmp_path / "mix.yaml")]) == 0
    assert "cuteaot build" in capsys.readouterr().out and load_spec(tmp_path / "mix.yaml").bundle == "mix"
    assert main(["spec", str(d), "--targets", "h200,b200", "--dtype", "fp16"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# mixtral:") and "targets: [h200, b200]" in printed and "dtype: fp16" in printed
    assert main(["spec", str(tmp_path / "missing")]) == 1
    assert "cannot read" in capsys.readouterr().err
    assert main(["spec", str(d), "-o", str(d)]) == 1  # a folder, or a file where a folder must be: said, no traceback
    assert f"{d} is a directory; -o takes the spec file to write" in capsys.readouterr().err
    assert main(["spec", str(d), "-o", str(d / "config.json" / "x.yaml")]) == 1
    assert "cannot write the spec to" in capsys.readouterr().err
    assert not [p for p in d.iterdir() if p.name.endswith(".tmp")]


def test_a_name_yaml_would_read_as_a_number_stays_a_name(tmp_path):
    text, _ = write_spec(_model_dir(tmp_path, "1.5", CONFIGS["mixtral-8x7b"]), tmp_path / "s.yaml")
    assert load_spec(tmp_path / "s.yaml").bundle == "1.5" and 'bundle: "1.5"' in text


def test_names_come_from_the_directory_or_the_config():
    assert spec_name(Path("/models/Qwen3-30B-A3B"), {}) == "qwen3-30b-a3b"
    assert spec_name(Path("/x/config.json"), {"_name_or_path": "openai/gpt-oss-120b"}) == "gpt-oss-120b"
    assert spec_name(Path("/models/Mixtral 8x7B/config.json"), {}) == "mixtral-8x7b"
    assert Activation.RELU2 is moe_config(CONFIGS["nemotron-3-nano"], "n").activation


# llm-compressor's NVFP4 export (RedHatAI's checkpoints): W4A4 and W4A16 schemes, as its config.json says them
_FP4_WEIGHTS = {"num_bits": 4, "type": "float", "group_size": 16, "strategy": "tensor_group", "symmetric": True}


@pytest.mark.parametrize("quant, nvfp4", [
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": _FP4_WEIGHTS,
                                    "input_activations": dict(_FP4_WEIGHTS, dynamic="local")}}}, True),
    ({"quant_method": "compressed-tensors", "format": "mixed-precision",  # NVFP4A16 beside another group
      "config_groups": {"group_0": {"weights": _FP4_WEIGHTS, "input_activations": None},
                        "group_1": {"weights": {"num_bits": 8, "type": "float"}}}}, True),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",  # int4 GPTQ-style: not ours
      "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "group_size": 128}}}}, False),
])
def test_a_compressed_tensors_nvfp4_config_is_recognised(tmp_path, quant, nvfp4):
    config = dict(CONFIGS["qwen3-30b-a3b"], quantization_config=quant)
    text, _ = write_spec(_model_dir(tmp_path, "q", config))
    assert ("serve an NVFP4 export" in text) is not nvfp4
    if not nvfp4:
        assert "Compressed-tensors pack-quantized checkpoint" in text



def test_a_modelopt_export_that_states_its_quantization_beside_the_config(tmp_path):
    """Older ModelOpt exports keep quant_algo in hf_quant_config.json, not in config.json."""
    plain = {k: v for k, v in CONFIGS["qwen3-30b-a3b"].items() if k != "quantization_config"}
    for algo, nvfp4 in (("NVFP4", True), ("FP8", False)):
        d = _model_dir(tmp_path, f"q-{algo}", plain)
        (d / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "0.29.0"},
             "quantization": {"quant_algo": algo, "group_size": 16, "exclude_modules": ["lm_head"]}}))
        text, _ = write_spec(d)
        assert ("serve an NVFP4 export" in text) is not nvfp4
        assert nvfp4 or "Modelopt FP8 checkpoint" in text
    (d / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}}))
    with pytest.raises(BadInputError, match="hf_quant_config.json has no 'quantization' object"):
        write_spec(d)
    (d / "hf_quant_config.json").write_text("[1, 2]")
    with pytest.raises(BadInputError, match="holds a JSON list, not a ModelOpt quantization config object"):
        write_spec(d)


@pytest.mark.parametrize("edit, message", [({"hidden_size": 520}, "hidden_size 520 is not a multiple of 16"),
                                           ({"num_experts": 1024}, "num_experts 1024 exceeds 512")])
def test_a_layer_the_runtime_would_refuse_gets_no_spec(tmp_path, edit, message):
    with pytest.raises(BadInputError, match=f"would not build: .*{message}"):
        write_spec(_model_dir(tmp_path, "m", dict(CONFIGS["qwen3-30b-a3b"], **edit)))


def test_what_the_header_notes_is_said_when_the_spec_is_written_to_a_file(tmp_path, capsys):
    config = dict(CONFIGS["deepseek-v3"])  # FP8 and shared experts: two notes
    assert main(["spec", str(_model_dir(tmp_path, "ds", config)), "-o", str(tmp_path / "ds.yaml"), "--tp", "8",
                 "--targets", "H200"]) == 0  # profile names in any case
    captured = capsys.readouterr()
    notes = [line for line in captured.err.splitlines() if line.startswith("note: ")]
    assert len(notes) == 2 and "Shared experts" in notes[0] and "Fp8 checkpoint" in notes[1]
    assert "serve an NVFP4 export" in notes[1] and "wrote" in captured.out


def test_names_a_bundle_can_take(tmp_path, monkeypatch):
    d = _model_dir(tmp_path, "qwen", CONFIGS["qwen3-30b-a3b"])
    with pytest.raises(BadInputError, match=r"--name 'My Model': .* lower-case .* e\.g\. 'my-model'"):
        write_spec(d, name="My Model")
    # the Hugging Face cache keeps the repository's name above the commit: that names the bundle
    repo = tmp_path / "hub" / "models--nvidia--Qwen3-30B-A3B-FP4"
    snapshot, blob = repo / "snapshots" / "0a1b2c3d4e5f", repo / "blobs" / "9f8e7d"
    snapshot.mkdir(parents=True)
    blob.parent.mkdir()
    blob.write_text(json.dumps(CONFIGS["qwen3-30b-a3b"]))
    (snapshot / "config.json").symlink_to(blob)  # as huggingface_hub lays files out
    for path in (snapshot, snapshot / "config.json"):
        assert spec_name(path, CONFIGS["qwen3-30b-a3b"]) == "qwen3-30b-a3b-fp4"
    monkeypatch.chdir(snapshot)  # `cuteaot spec .`
    assert spec_name(Path("."), CONFIGS["qwen3-30b-a3b"]) == "qwen3-30b-a3b-fp4"
    monkeypatch.chdir(tmp_path / "hub")
    assert spec_name(Path("."), CONFIGS["qwen3-30b-a3b"]) == "hub"


def test_a_repository_id_is_not_a_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadInputError, match=r"nvidia/Qwen3-30B-A3B-FP4 does not exist here; .*huggingface-cli "
                                            r"download nvidia/Qwen3-30B-A3B-FP4"):
        write_spec("nvidia/Qwen3-30B-A3B-FP4")


def test_a_model_directory_or_config_given_to_build_or_list_points_to_spec(tmp_path, capsys):
    d = _model_dir(tmp_path, "qwen", dict(CONFIGS["qwen3-30b-a3b"], architectures=["Qwen3MoeForCausalLM"]))
    assert main(["list", str(d / "config.json")]) == 1
    assert "this is a Hugging Face model config, not a cuteaot spec; `cuteaot spec MODEL_DIR" in capsys.readouterr().err
    assert main(["list", str(d)]) == 1
    assert "is a directory; pass a spec YAML file (a model directory: `cuteaot spec DIR" in capsys.readouterr().err


def test_config_values_of_the_wrong_kind_are_bad_input():
    oss = dict(CONFIGS["gpt-oss-120b"], swiglu_limit=None)
    with pytest.raises(BadInputError, match=r"swiglu_limit = null is not a positive number"):
        moe_config(oss, "oss")
    qwen = CONFIGS["qwen3-30b-a3b"]
    assert moe_config(qwen, "q", dtype="bfloat16").dtype.value == "bf16"
    with pytest.raises(BadInputError, match="dtype 'float32' is not one of"):
        moe_config(qwen, "q", dtype="float32")



def test_a_latent_moe_serves_its_experts_at_the_latent_width():
    config = {**CONFIGS["nemotron-3-nano"], "moe_latent_size": 1024}
    found = moe_config(config, "m")
    assert found.hidden_size == 1024 and found.sources["hidden_size"] == "moe_latent_size = 1024"
    assert any("Latent MoE" in note for note in found.notes)
    assert moe_config({**config, "moe_latent_size": None}, "m").hidden_size == CONFIGS["nemotron-3-nano"]["hidden_size"]
