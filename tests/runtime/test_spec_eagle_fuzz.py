"""The engine fuzz test's workloads (tests/runtime/test_engine_fuzz.py) with an EAGLE-3 head in place of the draft
model: each seed whose engine draws a draft model runs a random head instead (the tiny model's two layers, so the
head names its layers: 0, 1, 1), and the same checks hold: the overlapped engine gives the synchronous engine's
outputs, a greedy or seeded request gives alone what it gives in the crowd, refusals leave nothing behind, no block,
row or request is left. `-m slow` (about 20 s a seed on 2 cores)."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("peft")

import tests.runtime.test_engine_fuzz as fuzz  # noqa: E402
from tests.runtime.test_engine_fuzz import setup  # noqa: E402,F401,F811 (its fixture)
from tests.runtime.test_spec_eagle import write_head  # noqa: E402

DRAFT_SEEDS = [s for s in range(60) if "model" in (fuzz._engine_options(random.Random(s), "x").get("speculative") or {})]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return write_head(tmp_path_factory.mktemp("eagle-fuzz") / "head", 64, 4096, scale=0.3,
                      eagle_aux_hidden_state_layer_ids=[0, 1, 1])


@pytest.mark.slow
@pytest.mark.parametrize("seed", DRAFT_SEEDS)
def test_random_workloads_agree_with_an_eagle_head(setup, head, seed, monkeypatch):  # noqa: F811
    draw = fuzz._engine_options

    def with_head(rng, artifact):
        options = draw(rng, artifact)
        options["speculative"] |= {"method": "eagle3", "model": str(head)}
        return options

    monkeypatch.setattr(fuzz, "_engine_options", with_head)
    fuzz.check_seed(setup, seed)
