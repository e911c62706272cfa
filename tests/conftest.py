"""Fixtures shared by several test files."""
import pytest

import fastpo.models
from run_helpers import ModelLoadReached


@pytest.fixture
def no_model(monkeypatch):
    """Any model load raises ModelLoadReached: reaching it means validation passed."""
    def boom(*a, **k):
        raise ModelLoadReached("model load reached")
    monkeypatch.setattr(fastpo.models, "load_model_and_tokenizer", boom)
