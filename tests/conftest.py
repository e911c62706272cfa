"""Fixtures shared by several test files."""
import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on two cores: one thread each (and in their subprocesses),
    # set before torch loads, so that the workers do not oversubscribe the cores
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"

import pytest  # noqa: E402

import torch  # noqa: E402

import fastpo.model_loading  # noqa: E402
from run_helpers import ModelLoadReached  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # in case a plugin loaded torch before this file


@pytest.fixture
def no_model(monkeypatch):
    """Any model load raises ModelLoadReached: reaching it means validation passed."""
    def boom(*a, **k):
        raise ModelLoadReached("model load reached")
    monkeypatch.setattr(fastpo.model_loading, "load_model_and_tokenizer", boom)


@pytest.fixture(scope="module")
def tiny():
    """(model, tokenizer) of the random tiny Llama (seed 0): fast, for wiring; one per test file."""
    model, tok, _ = fastpo.model_loading.load_model_and_tokenizer("random:tiny-llama", seed=0)
    return model, tok


@pytest.fixture(scope="module")
def embedded():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct; one per test file."""
    model, tok, _ = fastpo.model_loading.load_model_and_tokenizer("smollm2-135m-instruct")
    return model, tok


@pytest.fixture(scope="session")
def probe_model(tmp_path_factory):
    """The run folder of the tiny random model taught the probe games' answer format
    (tests/probe_helpers.py), made once per test session: under xdist in the folder above the
    worker's, which every worker of the session shares."""
    from probe_helpers import format_model

    root = tmp_path_factory.getbasetemp()
    return format_model(root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root)
