"""One checked LM-head lookup (fastpo.kernels.hf.lm_head_weight) for the kernels' adapter and
the trainer: heads that transform their logits after the linear map (Cohere's logit_scale,
Gemma 2's final logit soft-capping, Granite's logits_scaling) or carry a bias are refused with
a clear error, since the fused kernels would score other log-probs than the model samples with.
Tiny randomly initialised models of those architectures."""
import pytest
import torch
import transformers
from rich.console import Console

from fastpo.config import load_config
from fastpo.config.fields import ConfigError
from fastpo.kernels import causal_lm_logprob_entropy, decoder_body, lm_head_weight

SHAPE = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _cohere(**kw):
    torch.manual_seed(0)
    return transformers.CohereForCausalLM(transformers.CohereConfig(**SHAPE, **kw))


def _gemma2(**kw):
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**SHAPE, head_dim=8, **kw))


def _granite(**kw):
    torch.manual_seed(0)
    return transformers.GraniteForCausalLM(transformers.GraniteConfig(**SHAPE, **kw))


@pytest.mark.parametrize("make,attr", [(_cohere, "logit_scale"), (_gemma2, "final_logit_softcapping"),
                                       (lambda: _granite(logits_scaling=4.0), "logits_scaling")])
def test_transformed_logits_are_refused(make, attr):
    model = make()
    with pytest.raises(ValueError, match=attr):
        lm_head_weight(model)
    ids = torch.randint(3, 64, (1, 6))
    with pytest.raises(ValueError, match=attr):
        causal_lm_logprob_entropy(model, ids)


@pytest.mark.parametrize("make", [lambda: _cohere(logit_scale=1.0), lambda: _gemma2(final_logit_softcapping=None),
                                  _granite])
def test_neutral_settings_give_the_models_own_log_probs(make):
    model = make().eval()
    assert lm_head_weight(model) is model.get_output_embeddings().weight
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    lp, _ = causal_lm_logprob_entropy(model, ids)
    with torch.no_grad():
        want = torch.log_softmax(model(ids).logits.float()[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(lp[:, 1:], want, atol=1e-5, rtol=1e-5)
    assert isinstance(decoder_body(model), torch.nn.Module)


def test_biased_head_is_refused():
    model = _granite()
    model.lm_head = torch.nn.Linear(16, 64, bias=True)
    with pytest.raises(ValueError, match="bias"):
        lm_head_weight(model)


def test_trainer_refuses_a_scaled_head_before_training(tmp_path):
    """The trainer's head lookup is the checked one: a Cohere model (logits * logit_scale) is
    refused at set-up with an error naming model.name and the setting; nothing is left behind."""
    from transformers import AutoTokenizer

    from fastpo.model_loading import embedded_tokenizer_dir
    from fastpo.trainer import Trainer

    tok = AutoTokenizer.from_pretrained(embedded_tokenizer_dir())
    folder = tmp_path / "cohere-tiny"
    shape = {**SHAPE, "vocab_size": len(tok), "pad_token_id": tok.pad_token_id or 0,
             "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    torch.manual_seed(0)
    transformers.CohereForCausalLM(transformers.CohereConfig(**shape)).save_pretrained(folder)
    tok.save_pretrained(folder)
    cfg = load_config(env="bandit", preset="tiny",
                      overrides=[f"trainer.output_dir={tmp_path / 'run'}", f"model.name={folder}"])
    with pytest.raises(ConfigError, match=r"model.name=.*logit_scale=0.0625"):
        Trainer(cfg, console=Console(quiet=True)).setup()
    assert not (tmp_path / "run").exists()
