"""A family declares what it is (`models/family.py`'s `Family`), and the rest of zerojax asks the
registry, never naming one (docs/design.md "Adding a policy family"). No compilation here: the
records, the registry's answers, and a policy family added as one module and one registry line
reaching data, config and serve."""

import dataclasses

import pytest
from conftest import ROOT, one_error_line

from zerojax import config
from zerojax.data import sources
from zerojax.errors import ConfigError
from zerojax.models import family as family_lib
from zerojax.models import registry
from zerojax.serve import loaders

LEROBOT_TINY = ROOT / "tests" / "fixtures" / "lerobot" / "tiny"
POLICY_KEYS = ["model.vocab_size=256", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
               "model.head_dim=8", "model.d_ff=32", "model.expert.d_model=16", "model.expert.d_ff=32",
               "model.vision.image_size=8", "model.vision.patch_size=4", "model.vision.d_model=16",
               "model.vision.n_layers=1", "model.vision.n_heads=2", "model.vision.d_ff=32", "model.action.horizon=2",
               "model.action.prompt_len=16", "model.action.max_state_dim=8", "model.action.max_action_dim=4",
               "model.action.cameras=3", "data.image_size=8", "data.action_horizon=2", "data.prompt_len=16",
               f"data.source=lerobot:{LEROBOT_TINY}", "train.global_batch=4"]


def test_every_built_in_family_declares_a_record_of_its_kind():
    for name in registry.FAMILIES:
        record = registry.family(name)
        assert isinstance(record, family_lib.Family) and record.kind in family_lib.KINDS
        assert registry.kind(name) == record.kind
        assert registry.is_policy(name) == (record.adapter is not None)
    assert registry.kind("my_model:build") is None and not registry.is_policy("my_model:build")
    kinds = {kind: registry.of_kind(kind) for kind in family_lib.KINDS}
    assert sorted(sum(kinds.values(), ())) == sorted(registry.FAMILIES)  # each family is of exactly one kind
    assert all(kinds.values()), kinds  # and each kind has a family


def test_a_record_that_contradicts_itself_is_refused():
    build = check = lambda *a, **k: None  # noqa: E731
    with pytest.raises(ValueError, match="Family.kind"):
        family_lib.Family(kind="robot", build=build, check_config=check)
    with pytest.raises(ValueError, match="declares its PolicyAdapter"):
        family_lib.Family(kind=family_lib.POLICY, build=build, check_config=check)
    adapter = registry.adapter(registry.of_kind(family_lib.POLICY)[0])
    with pytest.raises(ValueError, match="declares its PolicyAdapter"):
        family_lib.Family(kind=family_lib.LANGUAGE_MODEL, build=build, check_config=check, adapter=adapter)


def test_the_families_sections_are_model_keys():
    """The sections a family declares (registry.SECTIONS) load, override and check themselves
    like the shared keys, and a saved model section (dicts) builds the same config."""
    assert set(registry.sections()) <= {f.name for f in dataclasses.fields(config.ModelConfig)}
    cfg = config.load(overrides=["model.action.horizon=7"])
    assert cfg.model.action.horizon == 7
    assert config.ModelConfig(**dataclasses.asdict(cfg.model)) == cfg.model
    with pytest.raises(ConfigError, match="model.action.horizon=0"):
        config.load(overrides=["model.action.horizon=0"])
    with pytest.raises(ConfigError, match="did you mean 'model.action.horizon'"):
        config.load(overrides=["model.action.horizn=3"])


@pytest.fixture
def new_policy(tmp_path, monkeypatch):
    """A policy family added as a module of its own and one registry line: here it declares the
    built-in policy's record as its own (what it computes does not matter to who asks)."""
    built_in = registry.of_kind(family_lib.POLICY)[0]
    (tmp_path / "my_policy.py").write_text(
        "from zerojax.models import registry\n"
        f"FAMILY = registry.family({built_in!r})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.FAMILIES, "my_policy", "my_policy")
    return "my_policy"


def test_a_new_policy_family_reaches_data_config_and_serve_through_the_registry(new_policy):
    cfg = config.load(overrides=[f"model.family={new_policy}", *POLICY_KEYS])
    assert registry.is_policy(new_policy) and new_policy in registry.of_kind(family_lib.POLICY)
    spec = sources.batch_spec(cfg)  # the adapter's batch, not the dataset's features
    assert {"images", "image_masks", "state", "actions", "noise", "time"} <= set(spec)
    assert "observation.state" not in spec
    loaders.check_family({"model": {"family": new_policy}}, "a run")  # serve and rollout take it
    with pytest.raises(ConfigError, match=f"model.family={' or '.join(registry.of_kind(family_lib.POLICY))}"):
        loaders.check_family({"model": {"family": registry.DEFAULT}}, "a run")


def test_a_model_of_the_users_reads_the_datasets_features_as_they_are():
    """A family that declares no kind (module:factory) gets the LeRobot reader's own features; a
    built-in language model is refused (test_a_family_and_a_source_that_do_not_fit...)."""
    cfg = config.load(overrides=["model.family=twostack_model:build", f"data.source=lerobot:{LEROBOT_TINY}",
                                 "train.global_batch=4", "data.image_size=8", "data.action_horizon=2",
                                 "data.prompt_len=16"])
    spec = sources.batch_spec(cfg)
    assert {"observation.state", "action", "action_is_pad"} <= set(spec)
    assert "images" not in spec and "tokens" not in spec  # no adapter made a policy's batch (or prompt) of it


FIT = [  # (command, what the line must say): each refused before anything is traced or compiled
    (["train", "--config", str(ROOT / "configs" / "pi0.yaml")],  # analyze and plan compile its widest batch
     "model.family=pi0 is a robot policy: it trains on a LeRobot dataset (data.source=lerobot:DIR) or a source of "
     "your own (data.source=module:factory); data.source='stdlib' is a text corpus"),
    (["train", f"data.source=lerobot:{ROOT / 'tests' / 'fixtures' / 'lerobot' / 'tiny'}", "train.steps=1"],
     "is a LeRobot dataset of robot episodes, which a policy family reads (pi0"),
]


@pytest.mark.parametrize("argv, message", FIT, ids=["train pi0 on text", "train gpt on lerobot"])
def test_a_family_and_a_source_that_do_not_fit_are_one_line_before_compiling(argv, message, tmp_path, capsys):
    line = one_error_line([*argv, f"train.out_dir={tmp_path / 'run'}"], capsys)
    assert message in line, line
    assert not (tmp_path / "run").exists()
