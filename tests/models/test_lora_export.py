"""LoRA adapters in PEFT's format (export.save_peft / load_peft / save_merged)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from fedjax_pfl import export, models
from fedjax_pfl.models import lora
from fedjax_pfl.models.tasks import Task


def adapted_transformer():
    task = Task(kind="sequence", num_classes=11, inputs="tokens", vocab_size=11)
    model = models.get("transformer", (5,), 11, task=task,
                       options={"width": 8, "heads": 2, "layers": 2})
    base = model.init(jax.random.key(0))
    adapted, config = lora.lora(model, base, jnp.ones((1, 5), jnp.int32),
                                targets=["qkv", "mlp_in"], rank=2, alpha=16.0, dropout=0.1)
    rng = np.random.default_rng(0)
    adapters = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), jnp.float32),
                            adapted.init(jax.random.key(1)))
    return model, base, adapters, config


@pytest.mark.slow
def test_peft_names_shapes_config_and_round_trip(tmp_path):
    _, _, adapters, config = adapted_transformer()
    written = export.save_peft(str(tmp_path), adapters, config)
    tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert sorted(tensors) == sorted(
        f"base_model.model.Block_{i}.{m}.lora_{ab}.weight"
        for i in (0, 1) for m in ("qkv", "mlp_in") for ab in "AB")
    # PEFT's shapes: lora_A [r, d_in], lora_B [d_out, r] (qkv: 8 -> 24, mlp_in: 8 -> 32)
    assert tensors["base_model.model.Block_0.qkv.lora_A.weight"].shape == (2, 8)
    assert tensors["base_model.model.Block_0.qkv.lora_B.weight"].shape == (24, 2)
    assert tensors["base_model.model.Block_1.mlp_in.lora_B.weight"].shape == (32, 2)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg == written
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"], cfg["bias"],
            cfg["task_type"]) == ("LORA", 2, 16.0, 0.1, "none", "CAUSAL_LM")
    assert cfg["target_modules"] == ["mlp_in", "qkv"]
    back = export.load_peft(str(tmp_path), config)
    for a, b in zip(jax.tree.leaves(adapters), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert jax.tree.structure(back) == jax.tree.structure(adapters)


@pytest.mark.slow
def test_per_client_folders_and_merged_weights(tmp_path):
    model, base, adapters, config = adapted_transformer()
    personal = jax.tree.map(lambda a: jnp.stack([a, 2 * a, -a]), adapters)
    out = export.save_peft_run(str(tmp_path), adapters, personal, config)
    assert out["clients"] == 3
    client2 = export.load_peft(str(tmp_path / "clients" / "2"), config)
    np.testing.assert_array_equal(client2["Block_1"]["qkv"]["lora_B"],
                                  -np.asarray(adapters["Block_1"]["qkv"]["lora_B"]))
    names = export.save_merged(str(tmp_path / "merged"), base, adapters, config)
    tensors = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert sorted(names) == sorted(tensors)
    a = np.asarray(adapters["Block_0"]["qkv"]["lora_A"], np.float64)
    b = np.asarray(adapters["Block_0"]["qkv"]["lora_B"], np.float64)
    w = np.asarray(base["Block_0"]["qkv"]["kernel"], np.float64)
    np.testing.assert_allclose(tensors["Block_0/qkv/kernel"], w + 8.0 * (b @ a).T, rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_array_equal(tensors["Block_0/attn_out/kernel"],
                                  np.asarray(base["Block_0"]["attn_out"]["kernel"]))


def test_a_missing_tensor_is_named(tmp_path):
    _, _, adapters, config = adapted_transformer()
    export.save_peft(str(tmp_path), adapters, config._replace(targets=config.targets[:1]))
    try:
        export.load_peft(str(tmp_path), config)
    except export.ExportError as e:
        assert "base_model.model.Block_0.mlp_in.lora_A.weight" in str(e)
    else:
        raise AssertionError("no error")
