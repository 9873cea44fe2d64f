"""Config loading: YAML + dotlist overrides, and errors that name the key and the fix."""

from __future__ import annotations

import pytest

from rllm_async.config import ConfigError, config_from_dict, load_config


def test_defaults_and_dotlist_overrides(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("name: x\ncoordinator:\n  pipeline_depth: 2\n  max_staleness: 3\n")
    cfg = load_config(path, ["coordinator.pipeline_depth=3", "train.groups_per_step=8"])
    assert cfg.name == "x"
    assert cfg.coordinator.pipeline_depth == 3 and cfg.coordinator.max_staleness == 3
    assert cfg.train.groups_per_step == 8
    assert cfg.rollout.group_size == 8  # a default


def test_unknown_key_suggests_the_close_one() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown key 'coordinator.pipline_depth': did you mean 'pipeline_depth'"
    ):
        load_config(None, ["coordinator.pipline_depth=2"])
    with pytest.raises(ConfigError, match=r"unknown key 'trian': did you mean 'train'"):
        config_from_dict({"trian": {}})


def test_wrong_type_names_the_key_and_value() -> None:
    with pytest.raises(ConfigError, match=r"rollout.group_size: .*integer.*'eight'"):
        load_config(None, ["rollout.group_size=eight"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["coordinator.pipeline_depth=3", "coordinator.max_staleness=1"],
            "max_staleness .1. must be >= .*pipeline_depth .3.",
        ),
        (
            ["mode=sync", "coordinator.pipeline_depth=2"],
            "mode: sync is strictly on-policy.*pipeline_depth",
        ),
        (
            ["mode=sync", "coordinator.weight_update=latest"],
            "mode: sync needs coordinator.weight_update: pin",
        ),
        (["rollout.min_group_size=9", "rollout.group_size=8"], "min_group_size .9. cannot exceed"),
        (
            ["train.micro_batch_groups=32", "train.groups_per_step=16"],
            "micro_batch_groups .32. cannot exceed",
        ),
        (
            ["coordinator.stall_timeout_s=500", "rollout.timeout_s=300"],
            r"coordinator.stall_timeout_s .500.0. is shorter .*rollout.timeout_s .300.0. x "
            r"\(rollout.retries .1. \+ 1\) = 600.0",
        ),
        (["coordinator.stale_policy=keep"], "coordinator.stale_policy"),
        (["rollout.max_failure_rate=1.5"], "rollout.max_failure_rate"),
    ],
)
def test_impossible_combinations_are_refused(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_the_default_stall_timeout_covers_every_attempt_of_a_rollout() -> None:
    assert load_config(None).coordinator.stall_timeout_s == 3600.0
    cfg = load_config(None, ["rollout.timeout_s=3000", "rollout.retries=2"])
    assert cfg.coordinator.stall_timeout_s == 9000.0


def test_sync_mode_is_async_with_d0_k0_pin() -> None:
    cfg = load_config(None, ["mode=sync"])
    co = cfg.coordinator
    assert (co.pipeline_depth, co.max_staleness, co.weight_update) == (0, 0, "pin")


def test_null_max_staleness_disables_the_hard_bound() -> None:
    cfg = load_config(None, ["coordinator.pipeline_depth=4", "coordinator.max_staleness=null"])
    assert cfg.coordinator.max_staleness is None


def test_missing_file_and_bad_yaml(tmp_path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(bad)


def test_dataset_needs_exactly_one_source() -> None:
    with pytest.raises(ConfigError, match="exactly one of `path`"):
        config_from_dict({"data": {"train": {"path": "a.jsonl", "generator": "m:f"}}})


def test_package_file_finds_a_file_an_installed_package_ships(tmp_path, monkeypatch) -> None:
    pkg = tmp_path / "shipsmodel"
    pkg.mkdir()
    # Importing the package would fail: the path is found without importing it.
    (pkg / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (pkg / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "c.yaml"
    path.write_text("backend:\n  model_path: ${package_file:shipsmodel,m.gguf}\n")
    assert load_config(path).backend.options["model_path"] == str(pkg / "m.gguf")
    # An override still replaces it.
    assert load_config(path, ["backend.model_path=/x"]).backend.options["model_path"] == "/x"
    path.write_text("backend:\n  model_path: ${package_file:shipsmodel,other.gguf}\n")
    with pytest.raises(ConfigError, match=r"has no file 'other\.gguf'"):
        load_config(path)
    path.write_text("backend:\n  model_path: ${package_file:no_such_package_xyz,m.gguf}\n")
    with pytest.raises(ConfigError, match="no installed package 'no_such_package_xyz'"):
        load_config(path)
