"""The language-model tutorials (LoRA on Llama, chat SFT, ZeRO from scratch) run as their pages
write them, by tests/test_tutorials.py's runner: a file of its own, so that pytest-xdist (one file
per worker) runs them beside the policy tutorials rather than after them."""

import pytest

from test_tutorials import JOURNEYS, run_journey


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, (_, _, family) in JOURNEYS.items() if family is None])
def test_the_tutorial_runs(name, tmp_path):
    run_journey(name, tmp_path)
