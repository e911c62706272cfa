"""The optional SGLang backend; runs only where sglang and CUDA are importable."""
from __future__ import annotations

import pytest
import torch

from fastpo.rollout.sglang_engine import SGLangEngine, sglang_available


def test_sglang_engine_reports_what_is_missing():
    if sglang_available():
        pytest.skip("sglang and CUDA are present; the error path does not apply")
    with pytest.raises(ImportError, match="CUDA|sglang"):
        SGLangEngine("some/folder")


@pytest.mark.gpu
@pytest.mark.skipif(not sglang_available(), reason="needs sglang and CUDA")
def test_sglang_rollout_token_in_token_out(tmp_path):
    from fastpo.models import load_model_and_tokenizer
    from fastpo.rollout import MultiTurnRollout, RolloutConfig

    model, tok, _ = load_model_and_tokenizer("random:smollm2-135m", device="cuda", dtype=torch.bfloat16)
    engine = SGLangEngine.from_model(model, tok, str(tmp_path / "m"), dtype="bfloat16")
    try:
        cfg = RolloutConfig(max_turns=2, max_new_tokens=16)
        batch = MultiTurnRollout(engine, tok, "frozenlake", {}, cfg).generate([0, 1], group_size=4)
        assert len(batch) == 8
        for i in range(8):
            ids, m = batch.input_ids[i], batch.loss_mask[i]
            assert torch.equal(ids[m], torch.cat(batch.responses[i]))
            with torch.no_grad():
                logits = model(ids[None].cuda()).logits[0].float()
            lp = torch.log_softmax(logits, -1)[:-1].gather(1, ids[1:, None].cuda())[:, 0].cpu()
            # bf16 engines: loose tolerance
            assert (batch.sample_logprobs[i][1:][m[1:]] - lp[m[1:]]).abs().mean() < 0.1
        # the shared prompt is cached: far fewer prefilled than prompt tokens x trajectories
        prompt_tokens = sum(int((~batch.loss_mask[i]).sum()) for i in range(8))
        assert batch.metrics["prefilled_tokens"] < prompt_tokens
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        engine.update_weights(model)
        engine.release_memory()
        engine.resume_memory()
        MultiTurnRollout(engine, tok, "frozenlake", {}, cfg).generate([0], group_size=2)
    finally:
        engine.shutdown()
