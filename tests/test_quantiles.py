"""Quantile normalization (LeRobot's QUANTILES: q01/q99 -> [-1, 1]; QUANTILE10: q10/q90), both ways,
against LeRobot 0.6.1's own NormalizerProcessorStep and UnnormalizerProcessorStep:
tests/fixtures/lerobot/quantiles/ is a π0 policy directory's config.json and processor files
written by LeRobot 0.6.1, with the statistics of tests/fixtures/lerobot/tiny/meta/stats.json made
degenerate in one column each, and what its pre- and post-processor made of fixed numbers
(scripts/fixtures/make_quantile_fixtures.py, run in LeRobot 0.6.1's venv). No torch here."""

import json
from pathlib import Path

import numpy as np
import pytest

from zerojax.config.normalization import CONFIG_NAMES, V03_MODES, NormalizationMode
from zerojax.data import lerobot
from zerojax.errors import ConfigError
from zerojax.interop import lerobot as interop

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "lerobot"
POLICY = FIXTURE / "quantiles"
REF = {k: np.asarray(v, np.float32) if isinstance(v, list) else v
       for k, v in json.loads((POLICY / "reference.json").read_text()).items()}
STATE, ACTION = "observation.state", "action"


def norms() -> dict:
    """The directory's {feature: {mode, statistics}}, as `interop.read_policy` and `zerojax serve` take
    them (features_of over config.json's normalization_mapping and the processor files' statistics)."""
    config = interop.read_config(POLICY)
    return interop.features_of(config, interop.read_stats(POLICY), str(POLICY))[1]


def test_a_lerobot_06_policy_directory_names_quantile_modes_and_their_statistics():
    found = norms()  # from policy_preprocessor.json's normalizer step and its safetensors
    assert found[STATE]["mode"] == "quantiles" and set(found[STATE]) == {"mode", "q01", "q99"}
    assert found[ACTION]["mode"] == "quantile10" and set(found[ACTION]) == {"mode", "q10", "q90"}
    for key, stats in REF["stats"].items():
        for stat, value in stats.items():
            if stat in found[key]:
                np.testing.assert_array_equal(found[key][stat], np.float32(value), err_msg=f"{key} {stat}")


@pytest.mark.parametrize("key", [STATE, ACTION])
def test_normalization_in_equals_lerobot_061s_preprocessor(key):
    norm = norms()[key]
    short = key.split(".")[-1]
    out = lerobot.normalize(REF[short], norm, norm["mode"])
    assert out.dtype == np.float32
    # the degenerate column: LeRobot puts eps (1e-8) in place of a zero denominator, no eps elsewhere
    np.testing.assert_allclose(out, REF[f"normalized_{short}"], rtol=1e-6, atol=0)


def test_actions_out_equal_lerobot_061s_postprocessor():
    norm = norms()[ACTION]
    back = lerobot.unnormalize(REF["policy_action"], norm, norm["mode"])
    np.testing.assert_allclose(back, REF["unnormalized_action"], rtol=1e-6, atol=1e-7)
    # the degenerate column comes back as (x + 1) * eps / 2 + q10: q10 within float32's spacing
    np.testing.assert_allclose(back[..., 0], norm["q10"][0], rtol=0, atol=1e-6)


def test_a_datasets_stats_json_quantiles_give_lerobots_numbers():
    """The same modes read from meta/stats.json (data.norm_state / norm_action), on the columns the
    fixture left as the dataset has them."""
    stats = json.loads((FIXTURE / "tiny" / "meta" / "stats.json").read_text())
    state = lerobot.normalize(REF["state"], stats[STATE], "quantiles")
    np.testing.assert_allclose(state[:, :-1], REF["normalized_state"][:, :-1], rtol=1e-6, atol=0)
    action = lerobot.normalize(REF["action"], stats[ACTION], "quantile10")
    np.testing.assert_allclose(action[..., 1:], REF["normalized_action"][..., 1:], rtol=1e-6, atol=0)


def test_the_modes_map_both_ways_for_an_export():
    """One NormalizationMode, LeRobot 0.6.1's names (lerobot.configs.types), each spelled once on
    each side: data.norm_*'s spelling and LeRobot's come back to the same mode, and the modes
    LeRobot 0.6.1 wrote into this fixture's config.json read as the modes zerojax applies."""
    assert [m.name for m in NormalizationMode] == ["IDENTITY", "MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10"]
    for mode in NormalizationMode:
        assert NormalizationMode.of_config(mode.config) is mode
        assert NormalizationMode.of_lerobot(mode.value) is mode
    assert len(set(CONFIG_NAMES)) == len(NormalizationMode)
    mapping = interop.read_config(POLICY)["normalization_mapping"]
    assert {k: NormalizationMode.of_lerobot(v).config for k, v in mapping.items()} == {
        "VISUAL": "identity", "STATE": "quantiles", "ACTION": "quantile10"}
    assert [m.config for m in V03_MODES] == ["identity", "mean_std", "min_max"]  # LeRobot 0.3.x has no quantiles
    assert NormalizationMode.of_lerobot("quantiles") is None  # LeRobot's spelling only
    with pytest.raises(ConfigError, match="'QUANTILES' is not one of identity, mean_std, min_max, quantiles, quantile10"):
        NormalizationMode.of_config("QUANTILES")
