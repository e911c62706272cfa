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


class _FakeSGLang:
    """Stands in for sglang.Engine on the CPU: answers `generate` with fixed tokens, so the
    wrapper's session bookkeeping and result parsing run without a GPU."""

    def __init__(self):
        self.calls = []

    def generate(self, input_ids, sampling_params, return_logprob):
        self.calls.append((input_ids, sampling_params))
        out = []
        for ids, sp in zip(input_ids, sampling_params):
            toks = [5, 6, 7][: sp["max_new_tokens"]]
            fin = {"type": "length", "length": len(toks)} if len(toks) == sp["max_new_tokens"] else {"type": "stop"}
            out.append({"meta_info": {"output_token_logprobs": [(-0.5, t, None) for t in toks], "finish_reason": fin,
                                      "prompt_tokens": len(ids), "cached_tokens": len(ids) - 1}})
        return out


def test_sglang_engine_closes_refused_sessions_like_the_native_engine():
    from fastpo.rollout import SamplingParams

    eng = SGLangEngine(engine=_FakeSGLang())
    eng.start([list(range(30)), list(range(5))], 1)
    params = SamplingParams(temperature=1.0, max_new_tokens=3, max_context=40)
    outs = eng.generate([0, 1], [[2] * 20, [3]], params)
    assert outs[0].stop_reason == "context" and outs[0].token_ids == []
    assert outs[1].token_ids == [5, 6, 7] and outs[1].stop_reason == "length" and outs[1].logprobs == [-0.5] * 3
    assert eng.session_length(1) == 5 + 1 + 3
    assert eng.sgl.calls[0][0] == [list(range(5)) + [3]]  # only the admitted session was sent
    with pytest.raises(ValueError, match="sessions"):  # the refused session is closed
        eng.generate([0], None, params)
    # near the limit: max_new_tokens is cut to the room left and ends as "context"
    outs = eng.generate([1], [[4] * 29], params)  # 9 + 29 = 38 of 40: room for 2
    assert eng.sgl.calls[-1][1][0]["max_new_tokens"] == 2 and outs[0].stop_reason == "context"


def test_sglang_engine_warns_when_its_logprob_convention_differs(monkeypatch):
    import warnings

    from fastpo.rollout import SamplingParams

    monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB", raising=False)
    eng = SGLangEngine(engine=_FakeSGLang())
    eng.start([[1, 2]], 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # full vocabulary at T: the conventions agree, no warning
        eng.generate([0, 1], None, SamplingParams(temperature=0.7, top_k=20, max_new_tokens=3, max_context=64))
    with pytest.warns(UserWarning, match="top_p=0.9 < 1.*nucleus"):
        eng.generate([0, 1], None, SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=3, max_context=64))
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    eng = SGLangEngine(engine=_FakeSGLang())
    eng.start([[1, 2]], 1)
    with pytest.warns(UserWarning, match="temperature 1, not at the sampling temperature 0.5"):
        eng.generate([0], None, SamplingParams(temperature=0.5, max_new_tokens=3, max_context=64))


@pytest.mark.gpu
@pytest.mark.skipif(not sglang_available(), reason="needs sglang and CUDA")
def test_sglang_rollout_token_in_token_out(tmp_path):
    from fastpo.model_loading import load_model_and_tokenizer
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
