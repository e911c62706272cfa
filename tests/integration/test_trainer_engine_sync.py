"""The trainer's wiring of a separate generation engine (rollout.engine=sglang).

SGLang itself needs CUDA (tests/unit/rollout/test_rollout_sglang.py runs it where it can). Here the real
`SGLangEngine` adapter runs over a stand-in for `sglang.Engine` that keeps its own copy of
the weights, so the test can see what the trainer must do around each rollout: take the
engine's memory back, push the last update's weights before generating, free the memory
for training, and never generate from stale weights.
"""
from __future__ import annotations

import copy

import pytest
import torch
from rich.console import Console

import fastpo.rollout.sglang_engine as sg
from fastpo.config import load_config
from fastpo.config.fields import ConfigError
from fastpo.trainer import Trainer


class EngineDouble:
    """What the trainer touches of `sglang.Engine`, over a private copy of the policy."""

    def __init__(self, model, tokenizer):
        self.model = copy.deepcopy(model).eval()
        self.answer = tokenizer.encode("</think><answer>Left</answer>", add_special_tokens=False)
        self.released = False
        self.calls: list[str] = []

    def generate(self, input_ids, sampling_params, return_logprob):
        assert not self.released, "generate while the engine's memory is released"
        self.calls.append("generate")
        out = []
        for ids, sp in zip(input_ids, sampling_params):
            new = self.answer[: sp["max_new_tokens"]]
            with torch.no_grad():
                logits = self.model(torch.tensor([ids + new])).logits[0].float() / sp["temperature"]
            lp = torch.log_softmax(logits, -1)[len(ids) - 1:-1].gather(1, torch.tensor(new)[:, None])[:, 0]
            out.append({"meta_info": {"output_token_logprobs": [(float(x), t, None) for x, t in zip(lp, new)],
                                      "finish_reason": {"type": "stop", "matched": "</answer>"},
                                      "prompt_tokens": len(ids), "cached_tokens": 0}})
        return out

    def update_weights_from_tensor(self, named_tensors, flush_cache):
        assert not self.released, "weights pushed into released memory"
        self.calls.append("update")
        self.model.load_state_dict(dict(named_tensors))

    def release_memory_occupation(self):
        assert not self.released
        self.released = True
        self.calls.append("release")

    def resume_memory_occupation(self):
        assert self.released
        self.released = False
        self.calls.append("resume")

    def shutdown(self):
        self.calls.append("shutdown")


def _on_cpu(engine):
    engine.device = torch.device("cpu")  # the adapter's sampling generator lives on its device
    return engine


def _cfg(out, *overrides):
    return load_config(env="frozenlake", preset="tiny", overrides=[
        f"trainer.output_dir={out}", "model.name=random:tiny-llama", "rollout.engine=sglang",
        "rollout.max_turns=1", "trainer.plots=false", "algorithm.adv_estimator=drgrpo", *overrides])


def _train_over_double(tmp_path, monkeypatch, ignore_updates=False):
    """Two iterations with rollout.engine=sglang over an EngineDouble; (records, the double)."""
    doubles = []

    def from_model(cls, model, tokenizer, folder, **kwargs):
        doubles.append(EngineDouble(model, tokenizer))
        if ignore_updates:
            doubles[-1].update_weights_from_tensor = lambda named_tensors, flush_cache: None
        return _on_cpu(cls(engine=doubles[-1], tokenizer=tokenizer))

    monkeypatch.setattr(sg, "sglang_available", lambda: True)
    monkeypatch.setattr(sg.SGLangEngine, "from_model", classmethod(from_model))
    tr = Trainer(_cfg(tmp_path / "run", "trainer.iterations=2", "trainer.eval_every=0",
                      "optim.actor_lr=1e-2"), console=Console(quiet=True))
    return tr.run(), doubles[0]


def test_separate_engine_gets_each_update_before_it_generates(tmp_path, monkeypatch):
    records, eng = _train_over_double(tmp_path, monkeypatch)
    assert eng.calls == ["generate", "release", "resume", "update", "generate", "release", "shutdown"]
    # the engine's weights are the trained module's after each sync, so its recorded
    # log-probs equal the trainer's recomputed ones at both iterations
    for rec in records:
        assert rec["train/logprob_gap_max"] < 1e-4, rec["train/logprob_gap_max"]
    assert records[0]["actor/grad_norm"] > 0
    assert records[1]["time/weight_sync_s"] > 0 and records[0]["time/weight_sync_s"] == 0


def test_without_the_sync_the_gap_shows(tmp_path, monkeypatch):
    """The check above can fail: an engine that ignores weight updates gives a log-prob gap."""
    records, _ = _train_over_double(tmp_path, monkeypatch, ignore_updates=True)
    assert records[1]["train/logprob_gap_max"] > 1e-3


def test_sglang_engine_refused_clearly(tmp_path, monkeypatch):
    monkeypatch.setattr(sg, "sglang_available", lambda: False)
    tr = Trainer(_cfg(tmp_path / "run"), console=Console(quiet=True))
    with pytest.raises(ConfigError, match="needs CUDA and sglang"):
        tr.setup()
    assert not (tmp_path / "run").exists()  # refused before anything was written
    with pytest.raises(ConfigError, match="rollout.engine"):
        _cfg(tmp_path / "r2", "model.lora_rank=4")
    with pytest.raises(ConfigError, match="rollout.engine"):
        _cfg(tmp_path / "r3", "rollout.engine=vllm")


@pytest.mark.gpu
@pytest.mark.skipif(not sg.sglang_available(), reason="needs sglang and CUDA")
def test_trainer_on_real_sglang(tmp_path):
    tr = Trainer(load_config(env="frozenlake", preset="tiny", overrides=[
        f"trainer.output_dir={tmp_path / 'run'}", "model.name=random:smollm2-135m", "rollout.engine=sglang",
        "trainer.device=cuda", "trainer.iterations=2", "trainer.eval_every=0", "trainer.plots=false"]),
        console=Console(quiet=True))
    records = tr.run()
    # bf16 engine vs the trainer's recompute: loose, but a stale copy after the update would
    # show as a large gap at iteration 2
    assert all(rec["train/logprob_gap_mean"] < 0.05 for rec in records)
    assert records[1]["time/weight_sync_s"] > 0
