"""tests/test_deterministic.py's engine checks once more on a model holding its weights packed as the checkpoint
stores them (`dsv41.model.packed_weights`): batch, chunking, CED-exact, speculation, prefix-cache resume and the
training forward change no token and no log-prob bit. Slow (the same ~2 minutes as the original file); the
default suite checks packed == dense logits in the deterministic mode (tests/test_weights_packed.py)."""

from __future__ import annotations

import pytest

import tests.test_deterministic as td
from dsv41.config import load_config
from dsv41.model.init import random_model
from dsv41.model.packed_weights import is_packed, pack_weights
from tests.test_deterministic import alone, prompts  # noqa: F401  (fixtures, evaluated on the packed model)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model():
    m = pack_weights(random_model(load_config("debug"), seed=2))      # master weights rounded as for serving
    assert is_packed(m)
    return m


def test_batch_of_8_and_chunking_change_nothing_packed(model, prompts, alone):  # noqa: F811
    td.test_batch_of_8_and_chunking_change_nothing(model, prompts, alone)


def test_speculation_changes_nothing_packed(model, prompts, alone):  # noqa: F811
    td.test_speculation_changes_nothing(model, prompts, alone)


def test_prefix_cache_resume_changes_nothing_packed(model, prompts, alone, tmp_path):  # noqa: F811
    td.test_prefix_cache_resume_changes_nothing(model, prompts, alone, tmp_path)


def test_engine_logprobs_equal_the_training_forward_packed(model, prompts, alone):  # noqa: F811
    td.test_engine_logprobs_equal_the_training_forward(model, prompts, alone)
