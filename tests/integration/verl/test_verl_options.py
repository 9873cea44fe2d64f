"""Start-up refusals: impossible layouts, options the backend cannot honour, verl missing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rllm_async.backends.verl.options import check_config
from rllm_async.config import Config, ConfigError, config_from_dict
from rllm_async.plan.fit import engine_slots, shared_device
from rllm_async.plan.record import Workload


def make_config(coordinator: dict[str, Any] | None = None, **backend: Any) -> Config:
    return config_from_dict(
        {
            "backend": {"name": "verl", "model_path": "/nonexistent", **backend},
            "rollout": {"max_tokens": 8},
            "coordinator": coordinator or {},
        }
    )


LATEST = {"weight_update": "latest"}
# The project's vLLM engine over a server of the user's (no interpreter needed to check options).
ENGINE = {"rollout": "vllm", "vllm": {"urls": ["http://127.0.0.1:8000"]}}


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ({"gpus_per_node": 4, "fsdp": {"fsdp_size": 3}}, "fsdp_size (3) must divide the 4"),
        (
            {"gpus_per_node": 2, "tensor_parallel_size": 4, "rollout": "verl-vllm"},
            "exceeds backend.gpus_per_node",
        ),
        (
            {"gpus_per_node": 6, "tensor_parallel_size": 4, "rollout": "verl-vllm"},
            "must divide backend.gpus_per_node",
        ),
        (
            {
                "rollout": "verl-sglang",
                "rollout_nodes": 1,
                "rollout_gpus_per_node": 2,
                "tensor_parallel_size": 4,
            },
            "exceeds the rollout GPUs per node (2)",
        ),
        (
            {"tensor_parallel_size": 2, "gpus_per_node": 2},
            "backend.tensor_parallel_size applies to verl's rollout servers",
        ),
        ({"rollout_nodes": 1}, "backend.rollout_nodes applies to verl's rollout servers"),
        (
            {**ENGINE, "device": "cpu", "checkpoint_engine": "naive"},
            "backend.checkpoint_engine applies to verl's rollout servers (rollout: "
            "verl-vllm|verl-sglang), not to rollout: vllm",
        ),
        ({"rollout": "verl-sglang", "device": "cpu"}, "runs verl's sglang servers on GPUs"),
        ({"rollout": "verl-vllm", "rollout_gpus_per_node": 4}, "set rollout_nodes, or remove"),
        (
            {"rollout": "verl-vllm", "rollout_nodes": 1, "checkpoint_engine": "naive"},
            "checkpoint_engine: naive loads weights in the training process",
        ),
        ({"rollout": "verl-vllm"}, "set coordinator.weight_update: latest"),
        (ENGINE, "set coordinator.weight_update: latest"),
        ({"vllm": {"dtype": "float32"}}, "remove backend.vllm, or set rollout: vllm"),
        (
            {"rollout": "vllm", "vllm": {"python": "/nonexistent/python"}},
            "starts vLLM servers with /nonexistent/python, which does not exist",
        ),
        ({"nodes": 2}, "a Ray started here has one node"),
        ({"ray_address": "auto", "ray_num_cpus": 4}, "remove ray_num_cpus"),
        ({"device": "cpu", "fsdp": {"param_offload": True}}, "mean nothing on cpu"),
        ({"max_seq_len": 8}, "leaves no room for a prompt"),
        ({"device": "cpu", "use_remove_padding": True}, "sdpa would attend across them"),
    ],
)
def test_impossible_layouts_are_refused(backend: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match="backend verl cannot run this config") as err:
        check_config(make_config(**backend))
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("backend", "coordinator", "mode"),
    [
        ({"rollout": "verl-vllm", "gpus_per_node": 4, "tensor_parallel_size": 2}, LATEST, "async"),
        (
            {"rollout": "verl-sglang", "rollout_nodes": 2, "rollout_gpus_per_node": 8},
            LATEST,
            "async",
        ),
        ({"rollout": "verl-vllm"}, {"pipeline_depth": 0, "max_staleness": 0}, "async"),
        ({"rollout": "verl-vllm"}, {}, "sync"),  # sync is pinned, but no episode spans a sync
        ({**ENGINE, "device": "cpu"}, LATEST, "async"),
        ({**ENGINE, "device": "cpu"}, {}, "sync"),
    ],
)
def test_server_rollouts_are_accepted(
    backend: dict[str, Any], coordinator: dict[str, Any], mode: str
) -> None:
    cfg = config_from_dict(
        {
            "mode": mode,
            "backend": {"name": "verl", "model_path": "/x", **backend},
            "rollout": {"max_tokens": 8},
            "coordinator": coordinator,
        }
    )
    opts = check_config(cfg)
    assert opts.rollout == backend["rollout"]


def test_the_old_sglang_name_says_what_it_is_now() -> None:
    with pytest.raises(ConfigError, match="sglang is now verl-sglang"):
        check_config(make_config(rollout="sglang"))


def test_kl_penalty_is_refused() -> None:
    cfg = config_from_dict(
        {
            "backend": {"name": "verl", "model_path": "/x"},
            "algorithm": {"loss": {"kl_coef": 0.1}},
        }
    )
    with pytest.raises(ConfigError, match="builds no reference model"):
        check_config(cfg)


def test_recomputed_old_logprobs_are_refused() -> None:
    cfg = config_from_dict(
        {
            "backend": {"name": "verl", "model_path": "/x"},
            "algorithm": {"loss": {"behaviour_logprobs": "recomputed"}},
        }
    )
    with pytest.raises(ConfigError, match=r"behaviour_logprobs is recomputed.*set it to sampler"):
        check_config(cfg)


def test_unknown_option_gets_a_suggestion() -> None:
    with pytest.raises(ConfigError, match="did you mean 'gpus_per_node'"):
        check_config(make_config(gpu_per_node=2))


def test_missing_verl_names_the_extra(tmp_path: Path) -> None:
    """With verl unimportable, choosing the backend says how to install it."""
    code = (
        "import sys; sys.modules['verl'] = None\n"
        "from rllm_async.backends import get_backend_factory\n"
        "from rllm_async.config import ConfigError\n"
        "try:\n    get_backend_factory('verl')\n"
        "except ConfigError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert "pip install 'rllm-async[verl]'" in out.stdout, out.stdout + out.stderr


def test_missing_server_package_names_the_extra(tmp_path: Path) -> None:
    """verl's servers without their package are refused before Ray starts, naming the install."""
    code = (
        "from rllm_async.backends import get_backend_factory\n"
        "from rllm_async.config import ConfigError, config_from_dict\n"
        "for name in ('vllm', 'sglang'):\n"
        "    cfg = config_from_dict({'backend': {'name': 'verl', 'model_path': '/nonexistent',\n"
        "        'rollout': 'verl-' + name}, 'coordinator': {'weight_update': 'latest'}})\n"
        "    try:\n        get_backend_factory('verl').from_config(cfg)\n"
        "    except ConfigError as e:\n        print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    for name in ("vllm", "sglang"):
        assert f"pip install 'verl[{name}]==0.9.1'" in out.stdout, out.stdout + out.stderr


def test_colocated_servers_refuse_a_sync_interval() -> None:
    every = {**LATEST, "sync_every": 2, "max_staleness": 2}
    with pytest.raises(ConfigError, match=r"sync_every \(2\) > 1 would leave them asleep"):
        check_config(make_config(every, rollout="verl-vllm"))
    check_config(make_config(every, rollout="verl-vllm", rollout_nodes=1, device="cuda"))
    check_config(make_config(every, **ENGINE))


def test_servers_refuse_pinned_episodes_across_mini_batches() -> None:
    cfg = config_from_dict(
        {
            "mode": "sync",
            "backend": {"name": "verl", "model_path": "/x", **ENGINE},
            "rollout": {"max_tokens": 8},
            "train": {"mini_batches": 2},
        }
    )
    with pytest.raises(ConfigError, match=r"train.mini_batches \(2\) steps the optimizer"):
        check_config(cfg)


def test_evaluations_during_training_are_refused_on_vllm_servers() -> None:
    cfg = config_from_dict(
        {
            "backend": {"name": "verl", "model_path": "/x", **ENGINE, "device": "cpu"},
            "rollout": {"max_tokens": 8},
            "coordinator": LATEST,
            "eval": {"every_steps": 5},
        }
    )
    with pytest.raises(ConfigError, match=r"eval.every_steps 5.*eval.at_end"):
        check_config(cfg)


def test_a_verl_runs_config_tells_the_plan_its_devices_and_decode_slots() -> None:
    """`rllm-async plan` asks the recorded run's backend, through its entry point."""

    def ask(**backend: Any) -> tuple[bool | None, int | None]:
        config = {"backend": {"name": "verl", "model_path": "/nonexistent", **backend}}
        workload = Workload({"mode": "async"}, config=config)
        return shared_device(workload), engine_slots(workload)

    assert ask() == (False, 32)  # the local sampler on the CPU, the workers on GPUs
    assert ask(device="cpu", max_batch=8) == (True, 8)
    assert ask(sampler_device="cuda:0") == (True, 32)
    assert ask(sampler_device="auto") == (None, 32)
    assert ask(rollout="verl-vllm") == (True, None)  # colocated: asleep while the workers train
    assert ask(rollout="verl-sglang", rollout_nodes=1) == (False, None)
    flag = ["--max-num-seqs", "48"]
    assert ask(rollout="vllm", vllm={"servers": 2, "extra_args": flag}) == (None, 96)
    assert ask(no_such_option=1) == (None, None)
