"""The native engine against the behaviour recorded from its earlier, dense-buffer version.

`tests/data/engine_recorded.json` holds what the engine of commit 0986306 (a [rows, H, capacity,
D] buffer per layer, every row padded to the longest) produced in the scenarios of
`tests/engine_scenarios.py`, fp32 on the CPU, drawing its tokens with the inverse-CDF sampler
(`fastpo/rollout/sampling.py` of the commit the file names as `sampling_module_of`, copied into
a checkout of 0986306, whose own sampling module was the one before it). The paged cache must
give the same tokens, stop reasons, session lengths and contexts exactly, and the same
log-probs, entropies and readout values to fp32 rounding (its attention sums in another order).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine_scenarios import embedded_scenarios, tiny_scenarios

RECORDED = json.loads((Path(__file__).resolve().parents[1] / "data" / "engine_recorded.json").read_text())


def _same_outputs(got: dict, want: dict, where: str) -> None:
    assert got["sessions"] == want["sessions"], where
    for s, g, w in zip(got["sessions"], got["outputs"], want["outputs"]):
        at = f"{where}, session {s}"
        assert (g["tokens"], g["stop"]) == (w["tokens"], w["stop"]), at
        for key in ("logprobs", "entropies", "values"):
            assert len(g[key]) == len(w[key]), (at, key)
            if w[key]:
                torch.testing.assert_close(torch.tensor(g[key]), torch.tensor(w[key]), atol=2e-5, rtol=1e-5,
                                           msg=f"{at}: {key}")


@pytest.mark.parametrize("name", sorted(RECORDED["tiny"]))
def test_tiny_model_scenarios_as_recorded(tiny, name):
    model, tok = tiny
    got = _tiny_results(model, tok)[name]
    want = RECORDED["tiny"][name]
    assert len(got["turns"]) == len(want["turns"])
    for k, (g, w) in enumerate(zip(got["turns"], want["turns"])):
        _same_outputs(g, w, f"{name}, turn {k + 1}")
    for key in ("lengths", "contexts"):
        if key in want:
            assert got[key] == want[key], key


def test_tiny_model_scenarios_as_recorded_with_pytorch_attention(tiny, monkeypatch):
    """The same with the decode steps on PyTorch's attention over gathered blocks (what runs on
    CUDA, in bf16 and without a C compiler) instead of the compiled routine."""
    from fastpo.kernels import cpu_attention

    monkeypatch.setattr(cpu_attention, "usable", lambda *a: False)
    model, tok = tiny
    got = json.loads(json.dumps(tiny_scenarios(model, tok)))
    for name, want in RECORDED["tiny"].items():
        for k, (g, w) in enumerate(zip(got[name]["turns"], want["turns"])):
            _same_outputs(g, w, f"{name}, turn {k + 1}")


_CACHE: dict = {}


def _tiny_results(model, tok) -> dict:
    if "tiny" not in _CACHE:
        _CACHE["tiny"] = json.loads(json.dumps(tiny_scenarios(model, tok)))
    return _CACHE["tiny"]


@pytest.mark.slow
def test_embedded_model_rollouts_as_recorded(embedded):
    """A Sokoban rollout of the embedded model (2 groups x 2 trajectories, 2 turns), greedy and
    sampled: the same token ids, the same stops, log-probs to fp32 rounding."""
    model, tok = embedded
    got = embedded_scenarios(model, tok)
    for name, want in RECORDED["embedded"].items():
        g = got[name]
        assert g["input_ids"] == want["input_ids"], name
        assert g["stops"] == want["stops"] and g["success"] == want["success"], name
        for a, b in zip(g["logprobs"], want["logprobs"]):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=5e-5, rtol=1e-5, msg=name)
