"""Fixtures shared by several test files."""
import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on two cores: one thread each (and in their subprocesses),
    # set before torch loads, so that the workers do not oversubscribe the cores
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"

import pytest  # noqa: E402

import torch  # noqa: E402

import fastpo.models  # noqa: E402
from run_helpers import ModelLoadReached  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # in case a plugin loaded torch before this file


@pytest.fixture
def no_model(monkeypatch):
    """Any model load raises ModelLoadReached: reaching it means validation passed."""
    def boom(*a, **k):
        raise ModelLoadReached("model load reached")
    monkeypatch.setattr(fastpo.models, "load_model_and_tokenizer", boom)
