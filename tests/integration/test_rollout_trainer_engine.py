"""The trainer's rollout engine samples the trainer's own module: no copy, no weight
transfer, so an in-place update changes the very next rollout."""
from __future__ import annotations

import pytest
import torch
from rich.console import Console

from fastpo.config import load_config
from fastpo.trainer import Trainer


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_engine_is_the_trainer_module_and_sees_in_place_updates(tmp_path, lora_rank):
    cfg = load_config(env="frozenlake", preset="tiny", overrides=[
        f"trainer.output_dir={tmp_path / 'run'}", "model.name=random:tiny-llama", "rollout.group_size=2",
        "rollout.env_groups=1", "rollout.max_new_tokens=6", "rollout.max_turns=2", "trainer.plots=false",
        f"model.lora_rank={lora_rank}"])
    tr = Trainer(cfg, console=Console(quiet=True))
    tr.setup()
    assert tr.parts.sampler.engine.model is tr.model and tr.parts.sampler.rollout.engine is tr.parts.sampler.engine
    a = tr.parts.sampler.generate([3], 2, 1.0, seed=0)
    b = tr.parts.sampler.generate([3], 2, 1.0, seed=0)
    assert all(torch.equal(x, y) for x, y in zip(a.sample_logprobs, b.sample_logprobs))  # reproducible
    # in-place changes to the trained parameters (LoRA: the adapters only), as an optimizer step makes
    trained = [(n, p) for n, p in tr.model.named_parameters() if p.requires_grad]
    assert trained and (lora_rank == 0 or all("lora" in n for n, _ in trained))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in trained:
            p.add_(0.5 * torch.randn(p.shape, generator=gen))
    c = tr.parts.sampler.generate([3], 2, 1.0, seed=0)
    first = [float(x.sample_logprobs[i][x.loss_mask[i]][0]) for x in (a, c) for i in range(2)]
    assert first[0] != first[2] and first[1] != first[3], first
