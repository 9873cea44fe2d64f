"""`backend.lora`: adapters on a frozen base, merged for sampling, checkpointed and exported."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.func import functional_call

from rllm_async.backends.local import LocalBackend
from rllm_async.backends.local.backend import CHECKPOINT_FILE
from rllm_async.backends.local.lora import TARGETS, LoRA, LoRAOptions
from rllm_async.backends.local.model import Transformer, build_model, preset_config
from rllm_async.backends.toy_tokenizers import CharTokenizer
from rllm_async.cli import main as cli
from rllm_async.config import ConfigError, config_from_dict
from rllm_async.protocols import SamplingParams
from rllm_async.trainer import UnifiedTrainer
from tests.backends.local.test_local_backend import make_config, sample_groups
from tests.backends.local.test_local_sampler import full_forward_logprobs

TOKENS = torch.tensor([[5, 17, 3, 40, 41, 9, 2, 60], [7, 7, 7, 1, 2, 3, 4, 5]])


def tiny(seed: int = 0) -> Transformer:
    return build_model(preset_config("tiny", CharTokenizer().vocab_size), seed)


def randomize(lora: LoRA, seed: int = 1) -> None:
    """Non-zero B, so that the adapters change the model and A gets gradients."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in lora.B:
            b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


def lora_config(**backend: Any) -> Any:
    lora = {"rank": 4, "alpha": 8.0, **backend.pop("lora", {})}
    # A KL penalty, so that the reference model (the frozen base) takes part.
    return make_config({"lora": lora, **backend}, algorithm={"loss": {"kl_coef": 0.05}})


def test_adapters_start_as_the_base_model_exactly() -> None:
    model = tiny()
    with torch.no_grad():
        before = model(TOKENS)
        LoRA(model, LoRAOptions(rank=4))
        assert torch.equal(model(TOKENS), before)


@pytest.mark.parametrize("targets", [list(TARGETS), ["k_proj", "up_proj", "o_proj"]])
def test_gradients_equal_those_of_the_merged_weights(targets: list[str]) -> None:
    """d loss / d(A, B) through the hooks equals plain torch's through W + alpha/r * B A."""
    model = tiny()
    opts = LoRAOptions(rank=4, alpha=6.0, target_modules=targets)
    lora = LoRA(model, opts)
    randomize(lora)

    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        return -logp.gather(-1, TOKENS[:, 1:].unsqueeze(-1)).sum()

    loss_of(model(TOKENS)).backward()
    # The reference: a plain model whose fused weights are built from leaf copies of A and B.
    plain = tiny()
    a = [p.detach().clone().requires_grad_() for p in lora.A]
    b = [p.detach().clone().requires_grad_() for p in lora.B]
    by_name = dict(zip(lora.names, zip(a, b, strict=True), strict=True))
    cfg = plain.cfg
    q, kv = cfg.n_heads * cfg.hdim, cfg.kv_heads * cfg.hdim
    fused = {
        "qkv_proj": [("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
        "o_proj": [("o_proj", cfg.dim)],
        "gate_up_proj": [("gate_proj", cfg.ffn_dim), ("up_proj", cfg.ffn_dim)],
        "down_proj": [("down_proj", cfg.dim)],
    }
    weights: dict[str, torch.Tensor] = {}
    for name, w in plain.named_parameters():
        module = name.removesuffix(".weight").rsplit(".", 1)
        if len(module) == 2 and module[1] in fused:
            rows, start = [], 0
            for part, size in fused[module[1]]:
                row = w[start : start + size]
                if f"{module[0]}.{part}" in by_name:
                    pa, pb = by_name[f"{module[0]}.{part}"]
                    row = row + opts.scale * pb @ pa
                rows.append(row)
                start += size
            weights[name] = torch.cat(rows)
        else:
            weights[name] = w
    loss_of(functional_call(plain, weights, (TOKENS,))).backward()
    assert len(lora.A) == cfg.n_layers * len(targets)
    for ours, theirs in zip([*lora.A, *lora.B], [*a, *b], strict=True):
        assert ours.grad is not None and theirs.grad is not None
        assert ours.grad.abs().max() > 0
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())


def test_merged_copy_computes_the_adapted_model_and_leaves_the_base_alone() -> None:
    model = tiny()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    lora = LoRA(model, LoRAOptions(rank=4, alpha=8.0, dropout=0.1))
    randomize(lora)
    lora.eval()  # no dropout: the merged copy is the adapted model at inference
    merged = lora.merged_copy(model)
    with torch.no_grad():
        adapted, plain = model(TOKENS), merged(TOKENS)
        assert not torch.allclose(adapted, tiny()(TOKENS), atol=1e-3)
    torch.testing.assert_close(plain, adapted, rtol=0, atol=1e-5)
    assert all(torch.equal(base[k], v) for k, v in model.state_dict().items())
    assert not merged._forward_hooks and all(not m._forward_hooks for m in merged.modules())


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="unknown LoRA target modules"):
        LocalBackend.from_config(lora_config(lora={"target_modules": ["qkv_proj"]}))
    with pytest.raises(ConfigError, match="rank"):
        LocalBackend.from_config(lora_config(lora={"rank": 0}))


@pytest.mark.parametrize("learner", ["thread", "process"])
def test_a_step_trains_the_adapters_only_and_the_sampler_gets_them_merged(learner: str) -> None:
    cfg = lora_config()

    async def main() -> None:
        backend = LocalBackend.from_config(lora_config(learner=learner))
        reference = LocalBackend.from_config(lora_config())  # a thread learner, same start
        try:
            groups = await sample_groups(backend, 3)
            base = [p.detach().clone() for p in reference.learner.model.parameters()]
            for b in (backend, reference):
                await b.forward_backward(groups, cfg.algorithm.loss)
                await b.optim_step()
                await b.on_policy_updated(1)
            ref_learner = reference.learner
            lora = getattr(ref_learner, "lora", None)
            assert lora is not None
            # The optimizer sees the adapters only; the base did not move, B did.
            optimized = [p for g in ref_learner.optimizer.param_groups for p in g["params"]]
            assert {id(p) for p in optimized} == {id(p) for p in lora.parameters()}
            assert all(
                torch.equal(a, b) for a, b in zip(base, ref_learner.model.parameters(), strict=True)
            )
            assert all(not p.requires_grad for p in ref_learner.model.parameters())
            assert any(b.abs().max() > 0 for b in lora.B)
            # Both learners publish the same merged weights, unlike the base's.
            snapshot = backend.store.get(1)[1]
            expected = reference.store.get(1)[1]
            for ours, theirs in zip(snapshot.parameters(), expected.parameters(), strict=True):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
            assert any(
                not torch.allclose(p, s) for p, s in zip(snapshot.parameters(), base, strict=True)
            )
            # The sampler's logprobs are those of the adapted model (hooks, no merge).
            policy = backend.policy()
            p = policy.tokenizer.apply_chat_template([{"role": "user", "content": "12+3"}])
            out = await policy.generate(p, SamplingParams(max_tokens=10, seed=3))
            assert out.versions == [1] * len(out.ids)
            adapted = full_forward_logprobs(ref_learner.model, p, out)
            assert (torch.tensor(out.logprobs) - adapted).abs().max() < 1e-5
        finally:
            await backend.close()
            await reference.close()

    asyncio.run(main())


def test_checkpoints_restore_the_adapters_and_refuse_a_mismatch(tmp_path: Path) -> None:
    async def main() -> None:
        first, second = (LocalBackend.from_config(lora_config()) for _ in range(2))
        plain = LocalBackend.from_config(make_config())
        try:
            groups = await sample_groups(first, 2)
            await first.forward_backward(groups, cfg.algorithm.loss)
            await first.optim_step()
            await first.save(tmp_path / "ckpt")
            await second.load(tmp_path / "ckpt")
            for b in (first, second):  # the next step is the same from the restored state
                await b.forward_backward(groups, cfg.algorithm.loss)
                await b.optim_step()
            adapters = [getattr(b.learner, "lora", None) for b in (first, second)]
            assert adapters[0] is not None and adapters[1] is not None
            for x, y in zip(adapters[0].parameters(), adapters[1].parameters(), strict=True):
                assert torch.equal(x, y)
            with pytest.raises(ValueError, match="saved with LoRA adapters"):
                await plain.load(tmp_path / "ckpt")
        finally:
            for b in (first, second, plain):
                await b.close()

    cfg = lora_config()
    asyncio.run(main())


def coin(task: dict[str, Any], text: str) -> float:
    """A reward that varies within a group, so that every group trains."""
    return float(len(text) % 2)


def lora_run(tmp_path: Path, **backend: Any) -> Path:
    """A two-step run with adapters at a large learning rate, checkpointed at the end."""
    config = config_from_dict(
        {
            "name": "lora",
            "run_dir": str(tmp_path),
            "backend": {"name": "local", "max_seq_len": 64, **backend},
            "workflow": {"args": {"reward_fn": f"{__name__}:coin"}},
            "data": {
                "train": {"generator": "rllm_async.tasks.countdown:generator", "args": {"n": 8}}
            },
            "rollout": {"group_size": 4, "max_tokens": 8},
            "train": {"total_steps": 2, "groups_per_step": 2},
            "algorithm": {"filter_zero_variance": False},
            "optim": {"lr": 0.05},
            "logging": {"progress_bar": False, "jsonl": False},
        }
    )
    UnifiedTrainer(config).run()
    return config.run_path


def test_export_writes_the_merged_model_a_peft_adapter_and_its_base(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    run_dir = lora_run(tmp_path, lora={"rank": 4, "alpha": 8})
    out = tmp_path / "export"
    assert cli(["export", str(run_dir), "--out", str(out)]) == 0
    (ckpt,) = (run_dir / "checkpoints").glob("step_*")
    state = torch.load(ckpt / "backend" / CHECKPOINT_FILE, weights_only=True)
    model = tiny()
    model.load_state_dict(state["model"])
    lora = LoRA(model, LoRAOptions(rank=4, alpha=8))
    lora.load_state_dict(state["lora"])
    assert any(b.abs().max() > 0 for b in lora.B)
    ids = CharTokenizer().apply_chat_template([{"role": "user", "content": "3 5 7 -> 22"}])
    tokens = torch.tensor([[*ids, *CharTokenizer().encode("3*5+7")]])
    with torch.no_grad():
        expected = torch.log_softmax(model(tokens), dim=-1)
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        got = torch.log_softmax(merged.eval()(tokens).logits, dim=-1)
        assert (got - expected).abs().max() < 1e-4
    adapter_config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["r"] == 4 and adapter_config["lora_alpha"] == 8
    assert sorted(adapter_config["target_modules"]) == sorted(TARGETS)
    peft = pytest.importorskip("peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(out / "base"), dtype=torch.float32)
    with torch.no_grad():
        base_lp = torch.log_softmax(base.eval()(tokens).logits, dim=-1)
        assert (base_lp - expected).abs().max() > 1e-3  # the adapters matter
        adapted = peft.PeftModel.from_pretrained(base, str(out / "adapter")).eval()
        got = torch.log_softmax(adapted(tokens).logits, dim=-1)
        assert (got - expected).abs().max() < 1e-4


def test_a_checkpoint_directory_is_the_base_of_its_exported_adapter(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from rllm_async.backends.local.hf import load_checkpoint
    from rllm_async.models.tiny_qwen import build_tiny_qwen

    source = build_tiny_qwen(tmp_path / "tiny-qwen", hidden=128)
    lora = {"rank": 2, "alpha": 4, "target_modules": ["k_proj", "v_proj", "up_proj"]}
    run_dir = lora_run(tmp_path, model_path=str(source), lora=lora)
    out = tmp_path / "export"
    assert cli(["export", str(run_dir), "--out", str(out)]) == 0
    assert not (out / "base").exists()
    adapter_config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(source)
    assert adapter_config["target_modules"] == ["k_proj", "up_proj", "v_proj"]
    ckpt = load_checkpoint(source)
    ids = ckpt.tokenizer.apply_chat_template([{"role": "user", "content": "what is 2 plus 3?"}])
    tokens = torch.tensor([[*ids, *ckpt.tokenizer.encode("the answer is 5.")]])
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        expected = torch.log_softmax(merged.eval()(tokens).logits, dim=-1)
        base = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
        plain = torch.log_softmax(base.eval()(tokens).logits, dim=-1)
        assert (plain - expected).abs().max() > 1e-3  # the adapters matter
        adapted = peft.PeftModel.from_pretrained(base, str(out / "adapter")).eval()
        got = torch.log_softmax(adapted(tokens).logits, dim=-1)
        assert (got - expected).abs().max() < 1e-4
