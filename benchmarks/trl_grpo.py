"""One of our configs trained with TRL's `GRPOTrainer` (CPU, no vLLM), for a wall-clock baseline.

Everything comes from the config: the same model, either a warm-started built-in one (converted
into a Hugging Face `Qwen2ForCausalLM`, with our character tokenizer as a `PreTrainedTokenizerFast`)
or a pretrained `backend.model_path` (loaded from the same local checkpoint by `transformers`),
checked against ours on a sample prompt logit for logit and id for id; the same train and eval
data, prompt and reward, group size, optimizer-step batch, learning rate and warmup, sampling
temperature and completion length, seed, and bfloat16 autocast where our `backend.dtype` resolves
to it. Every `--eval-every` optimizer steps it measures held-out greedy
accuracy with the training clock paused, so only training time counts; it stops when the accuracy
reaches `--target`, after `--max-seconds` of training, or after `--steps` steps. Prints one JSON line
(progress goes to stderr).

`trl` is needed by this benchmark only: pip install trl==1.16.0

Usage: python benchmarks/trl_grpo.py [--config examples/countdown/local_async.yaml] [--target 0.55]
           [--max-seconds 1800] [--steps N] [--eval-every 25] [--eval-n 512] [--threads 2]
           [key=value ...]
       python benchmarks/trl_grpo.py --config examples/smollm2/word_problems.yaml --target 0.45
           --max-seconds 1500 --eval-every 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rllm_async.algorithms.schedule import learning_rate
from rllm_async.backends.local.backend import LocalBackend, LocalOptions
from rllm_async.backends.local.hf import checkpoint_dir, load_chat_tokenizer
from rllm_async.backends.local.learner import Learner
from rllm_async.backends.local.model import Transformer, hf_weights
from rllm_async.backends.local.options import dtype_of
from rllm_async.backends.toy_tokenizers import SPECIALS, CharTokenizer
from rllm_async.config import Config, load_config, validate_options
from rllm_async.data import TaskSource, load_tasks
from rllm_async.imports import import_object
from rllm_async.protocols import Tokenizer as ChatTokenizer
from rllm_async.workflows.prompt import task_messages

# Nothing leaves the machine: no Hub look-ups, no usage pings (read when huggingface_hub is imported).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

try:
    import trl
    from datasets import Dataset
    from tokenizers import Tokenizer, decoders, models
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
        TrainerCallback,
    )
    from transformers.trainer_callback import PrinterCallback
except ImportError as e:
    raise SystemExit(
        f"benchmarks/trl_grpo.py needs trl, an optional dependency of this benchmark only ({e}): "
        "pip install trl==1.16.0"
    ) from None

TRL_VERSION = "1.16.0"  # the version these settings were checked against
LOGITS_TOLERANCE = 1e-4  # float32 on both sides; a wrong conversion is off by far more
# Renders what `CharTokenizer.apply_chat_template` renders for plain-text messages without tools.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
NO_STEP_LIMIT = 1_000_000  # TRL needs a step count; the target and the time budget stop it first

RewardFn = Callable[[dict[str, Any], str], "float | tuple[float, bool]"]


# -- model and tokenizer ------------------------------------------------------------------------


@dataclass
class Policy:
    """The model TRL trains, its tokenizer, and ours (what the held-out evaluation decodes with)."""

    hf: PreTrainedModel
    hf_tok: PreTrainedTokenizerBase
    tokenizer: ChatTokenizer
    stop_ids: tuple[int, ...]


def local_model(config: Config, opts: LocalOptions) -> tuple[torch.nn.Module, ChatTokenizer]:
    """Our trainable model (after the cached warm start, if built-in), built by `LocalBackend`."""
    if config.backend.name != "local":
        raise SystemExit("this benchmark needs backend.name: local")
    # On a thread, so that the learner's model is here to take.
    backend = LocalBackend(config, opts.model_copy(update={"learner": "thread"}))
    asyncio.run(backend.close())  # only the weights are needed: stop its sampler thread
    assert isinstance(backend.learner, Learner)
    return backend.learner.model.eval(), backend.sampler.tokenizer


def hf_policy(ours: torch.nn.Module, tokenizer: ChatTokenizer, opts: LocalOptions) -> Policy:
    """The same model and tokenizer on the Hugging Face side."""
    if opts.model_path is None:
        assert isinstance(ours, Transformer) and isinstance(tokenizer, CharTokenizer)
        return Policy(
            to_qwen2(ours, tokenizer, opts.max_seq_len),
            hf_tokenizer(tokenizer),
            tokenizer,
            (tokenizer.eos_token_id,),
        )
    path = checkpoint_dir(Path(opts.model_path).expanduser())
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    hf_tok = AutoTokenizer.from_pretrained(path, local_files_only=True, padding_side="left")
    return Policy(hf.eval(), hf_tok, tokenizer, load_chat_tokenizer(path)[1])


def to_qwen2(model: Transformer, tokenizer: CharTokenizer, max_seq_len: int) -> Qwen2ForCausalLM:
    """A `Qwen2ForCausalLM` computing the same function: same shape and weights, zero q/k/v biases."""
    cfg = model.cfg
    if cfg.qk_norm or cfg.hdim * cfg.n_heads != cfg.dim:
        raise SystemExit(f"model shape {cfg} has no Qwen2 equivalent")
    hf_config = Qwen2Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings,
        attention_dropout=0.0,
        pad_token_id=tokenizer.vocab.index("<pad>"),
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    hf = Qwen2ForCausalLM(hf_config)
    state = {
        (k if k == "lm_head.weight" else f"model.{k}"): v.detach().clone()
        for k, v in hf_weights(model).items()
    }
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])  # tied
    for i in range(cfg.n_layers):
        for proj in ("q_proj", "k_proj", "v_proj"):
            weight = state[f"model.layers.{i}.self_attn.{proj}.weight"]
            state.setdefault(
                f"model.layers.{i}.self_attn.{proj}.bias", weight.new_zeros(len(weight))
            )
    hf.load_state_dict(state, strict=True)
    return hf.eval()


def hf_tokenizer(tokenizer: CharTokenizer) -> PreTrainedTokenizerFast:
    """Our character tokenizer as a fast tokenizer: the same id for every character and special.

    A BPE model without merges splits text into single characters (unknown ones into `<unk>`, one
    each), and the Fuse decoder joins tokens without the spaces a word-level decoder would insert.
    """
    vocab = {tok: i for i, tok in enumerate(tokenizer.vocab)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<|end|>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )


def check_conversion(
    ours: torch.nn.Module, policy: Policy, messages: list[dict[str, Any]]
) -> float:
    """Exit unless both tokenizers render `messages` to the same ids and both models agree on them;
    returns the largest logit difference."""
    tokenizer, hf = policy.tokenizer, policy.hf
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    rendered = policy.hf_tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    hf_ids = [int(i) for i in rendered]
    if hf_ids != ids:
        raise SystemExit(f"tokenizer mismatch on {messages!r}:\n  ours {ids}\n  hf   {hf_ids}")
    sample = torch.tensor([ids + tokenizer.encode("1+2*3") + [tokenizer.eos_token_id]])
    with torch.no_grad():
        diff = float((ours(sample) - hf(sample).logits).abs().max())
    if not diff < LOGITS_TOLERANCE:
        raise SystemExit(f"model conversion mismatch: max |logit diff| {diff:.3g}")
    return diff


# -- data and reward ----------------------------------------------------------------------------


def chat_prompt(task: dict[str, Any], workflow_args: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages `SingleTurnWorkflow` sends for `task`."""
    return task_messages(
        task, workflow_args.get("prompt_key", "prompt"), workflow_args.get("system_prompt")
    )


def reward_function(config: Config) -> RewardFn:
    """The workflow's reward function; only a single-turn workflow is comparable."""
    if not config.workflow.cls.endswith("SingleTurnWorkflow"):
        raise SystemExit(f"workflow.cls {config.workflow.cls} is not SingleTurnWorkflow")
    fn = config.workflow.args["reward_fn"]
    return import_object(fn, "workflow.args.reward_fn") if isinstance(fn, str) else fn


def score(reward_fn: RewardFn, task: dict[str, Any], text: str) -> tuple[float, bool]:
    """(reward, correct); a reward without a correctness flag counts as correct at >= 1."""
    scored = reward_fn(task, text)
    reward, correct = scored if isinstance(scored, tuple) else (scored, None)
    return float(reward), bool(reward >= 1.0 if correct is None else correct)


def train_dataset(config: Config, tasks: list[dict[str, Any]]) -> Dataset:
    """One epoch of the training tasks in the order our `TaskSource` serves them.

    TRL's own shuffle is turned off so that both trainers see the same problems in the same order;
    a task is referenced by its index so that its fields need not fit an Arrow schema.
    """
    spec = config.data.train
    source = TaskSource(
        tasks, seed=config.seed, shuffle=spec.shuffle if spec else True, total_epochs=1
    )
    index = {task["id"]: i for i, task in enumerate(tasks)}
    args = config.workflow.args
    rows = []
    while (task := source.pop()) is not None:
        rows.append({"prompt": chat_prompt(task, args), "task_index": index[task["id"]]})
    return Dataset.from_list(rows)


def trl_reward(
    reward_fn: RewardFn, tasks: list[dict[str, Any]]
) -> Callable[..., list[float | None]]:
    """Our reward as a TRL reward function over conversational completions."""

    def task_reward(
        completions: list[list[dict[str, str]]], task_index: list[int], **_: Any
    ) -> list[float | None]:
        return [
            score(reward_fn, tasks[i], completion[-1]["content"])[0]
            for completion, i in zip(completions, task_index, strict=True)
        ]

    return task_reward


# -- held-out evaluation ------------------------------------------------------------------------


@dataclass
class HeldOut:
    """Greedy accuracy on the eval tasks, decoding prompts of equal length together (no padding)."""

    tasks: list[dict[str, Any]]
    prompts: list[list[int]]
    tokenizer: ChatTokenizer
    stop_ids: tuple[int, ...]
    reward_fn: RewardFn
    max_new_tokens: int
    batch: int

    def accuracy(self, model: PreTrainedModel) -> float:
        gen = GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            do_sample=False,
            eos_token_id=list(self.stop_ids),
            pad_token_id=self.stop_ids[0],  # only after a stop, and cut off below
        )
        by_length: dict[int, list[int]] = defaultdict(list)
        for i, ids in enumerate(self.prompts):
            by_length[len(ids)].append(i)
        correct = 0
        was_training = model.training
        model.eval()
        try:
            for length, rows in by_length.items():
                for start in range(0, len(rows), self.batch):
                    chunk = rows[start : start + self.batch]
                    prompts = torch.tensor([self.prompts[i] for i in chunk])
                    with torch.no_grad():
                        out = model.generate(
                            prompts, attention_mask=torch.ones_like(prompts), generation_config=gen
                        )
                    for i, completion in zip(chunk, out[:, length:].tolist(), strict=True):
                        # What follows the first stop token is padding.
                        ends = [completion.index(s) for s in self.stop_ids if s in completion]
                        completion = completion[: min(ends, default=len(completion))]
                        text = self.tokenizer.decode(completion)
                        correct += score(self.reward_fn, self.tasks[i], text)[1]
        finally:
            model.train(was_training)
        return correct / len(self.tasks)


@dataclass
class Progress(TrainerCallback):
    """Evaluates every `eval_every` steps on a paused training clock and decides when to stop."""

    held_out: HeldOut
    eval_every: int
    target: float
    max_seconds: float
    evals: list[tuple[int, float, float]] = field(default_factory=list)
    time_to_target: float | None = None
    steps: int = 0
    train_seconds: float = 0.0
    eval_seconds: float = 0.0  # all evaluations, the one before training included
    wall_seconds: float = 0.0  # training and the evaluations during it
    _start: float = 0.0
    _paused: float = 0.0  # evaluation time since `_start`, kept off the training clock

    def _train_wall(self) -> float:
        return time.perf_counter() - self._start - self._paused

    def _evaluate(self, step: int, model: PreTrainedModel) -> float:
        t0 = time.perf_counter()
        acc = self.held_out.accuracy(model)
        elapsed = time.perf_counter() - t0
        self.eval_seconds += elapsed
        self._paused += elapsed
        self.evals.append((step, round(self.train_seconds, 2), acc))
        if acc >= self.target and self.time_to_target is None:
            self.time_to_target = self.train_seconds
        print(
            f"eval step {step}: accuracy {acc:.3f} at {self.train_seconds:.1f}s of training "
            f"({elapsed:.1f}s to evaluate)",
            file=sys.stderr,
        )
        return acc

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._evaluate(0, kwargs["model"])  # the warm start's accuracy, before any update
        self._start = time.perf_counter()
        self._paused = 0.0

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.train_seconds = self._train_wall()
        step = self.steps = state.global_step
        out_of_time = self.train_seconds >= self.max_seconds
        last = out_of_time or step >= state.max_steps
        if step % self.eval_every == 0 or last:
            self._evaluate(step, kwargs["model"])
        if self.time_to_target is not None or out_of_time:
            control.should_training_stop = True
        self.wall_seconds = time.perf_counter() - self._start

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        logs = kwargs.get("logs") or {}
        if "reward" in logs:
            print(
                f"step {state.global_step}: reward {logs['reward']:.3f}, "
                f"{self._train_wall():.1f}s of training",
                file=sys.stderr,
            )


# -- the trainer --------------------------------------------------------------------------------


def grpo_config(
    config: Config, micro_batch: int, max_steps: int, out_dir: str, bf16: bool
) -> trl.GRPOConfig:
    """TRL settings mirroring ours as far as TRL allows.

    loss_type "dapo": the summed token losses of the whole optimizer step over its total loss-token
    count, which is our token mean per step. With num_iterations=1 the old logprobs are the current
    ones (TRL takes them detached), so the ratio is exactly 1 and PPO-clip, plain importance
    sampling and CISPO all give the same gradient; clip bounds are still passed for the record.
    Advantages are the reward minus the group mean, divided by the group std only when our
    `algorithm.normalize_std` asks for it.

    Not matched, because TRL has no such setting: TRL is strictly on-policy (no pipeline depth or
    staleness, so no importance-sampling correction either), and it keeps zero-variance groups
    (zero advantage, but their tokens still count in the step's token mean) where our
    `filter_zero_variance` replaces them with fresh groups.
    """
    ro, algo = config.rollout, config.algorithm
    if ro.temperature <= 0:
        raise SystemExit("rollout.temperature must be > 0: GRPO samples its groups")
    batch = config.train.groups_per_step * ro.group_size
    return trl.GRPOConfig(
        output_dir=out_dir,
        seed=config.seed,
        use_cpu=True,
        bf16=bf16,  # autocast, as our learner's; the weights stay float32 on both sides
        fp16=False,
        activation_checkpointing=False,  # TRL turns it on by default; our learner does not
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        max_steps=max_steps,
        # One optimizer step = groups_per_step groups, generated at once, trained in micro-batches.
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=batch // micro_batch,
        num_generations=ro.group_size,
        max_completion_length=ro.max_tokens,
        temperature=ro.temperature,
        top_p=ro.top_p,
        top_k=0,
        shuffle_dataset=False,
        remove_unused_columns=False,
        learning_rate=config.optim.lr,  # the optimizer and schedule are ours, passed in below
        max_grad_norm=config.optim.grad_clip or 0.0,
        beta=algo.loss.kl_coef,  # TRL's per-token KL is the same k3 estimator as ours
        num_iterations=1,
        loss_type="dapo",
        epsilon=algo.loss.clip_low,
        epsilon_high=algo.loss.clip_high,
        scale_rewards="group" if algo.normalize_std else "none",
        mask_truncated_completions=False,
        log_completions=False,
    )


def optimizer(
    model: PreTrainedModel, config: Config
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """Our learner's AdamW (decay on every parameter) and our schedule, warmup included."""
    opt = config.optim
    adamw = torch.optim.AdamW(
        model.parameters(), lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay
    )
    total = config.train.total_steps
    schedule = torch.optim.lr_scheduler.LambdaLR(
        adamw, lambda step: learning_rate(opt, step, total) / opt.lr
    )
    return adamw, schedule


def micro_batch_size(config: Config, opts: LocalOptions) -> int:
    """Our learner's sequences per forward/backward, if it divides the step's batch."""
    batch = config.train.groups_per_step * config.rollout.group_size
    return opts.train_batch if batch % opts.train_batch == 0 else batch


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = load_config(args.config, args.overrides)
    opts: LocalOptions = validate_options(LocalOptions, config.backend.options, "backend")
    ours, tokenizer = local_model(config, opts)
    torch.set_num_threads(args.threads)  # after the backend's threads set their own
    policy = hf_policy(ours, tokenizer, opts)
    bf16 = dtype_of(opts.dtype, torch.device("cpu")) == torch.bfloat16
    reward_fn = reward_function(config)
    assert config.data.train is not None and config.data.eval is not None
    train_tasks = load_tasks(config.data.train, "train")
    eval_tasks = load_tasks(config.data.eval, "eval")[: args.eval_n]
    diff = check_conversion(ours, policy, chat_prompt(eval_tasks[0], config.workflow.args))
    del ours
    print(f"conversion checked: max |logit diff| {diff:.2e}, same token ids", file=sys.stderr)
    held_out = HeldOut(
        eval_tasks,
        [tokenizer.apply_chat_template(chat_prompt(t, config.workflow.args)) for t in eval_tasks],
        tokenizer,
        policy.stop_ids,
        reward_fn,
        config.eval.max_tokens or config.rollout.max_tokens,
        opts.max_batch,
    )
    progress = Progress(
        held_out,
        args.eval_every or config.eval.every_steps or 25,
        args.target,
        args.max_seconds,
    )
    with tempfile.TemporaryDirectory() as out_dir:
        # TRL builds its KL reference from the policy's `name_or_path`: point it at a saved copy
        # of the warm-started weights (the reference our learner keeps).
        policy.hf.save_pretrained(f"{out_dir}/reference")
        policy.hf.config.name_or_path = f"{out_dir}/reference"
        steps = args.steps or NO_STEP_LIMIT
        trainer = trl.GRPOTrainer(
            model=policy.hf,
            reward_funcs=trl_reward(reward_fn, train_tasks),
            args=grpo_config(config, micro_batch_size(config, opts), steps, out_dir, bf16),
            train_dataset=train_dataset(config, train_tasks),
            processing_class=policy.hf_tok,
            callbacks=[progress],
            optimizers=optimizer(policy.hf, config),
        )
        trainer.remove_callback(PrinterCallback)  # progress is ours, on stderr
        trainer.train()
    steps = progress.steps
    return {
        "trl_version": trl.__version__,
        "torch_threads": torch.get_num_threads(),
        "bf16": bf16,
        "config": args.config,
        "steps": steps,
        "train_wall_s": round(progress.train_seconds, 2),
        "s_per_step": round(progress.train_seconds / steps, 3) if steps else None,
        "eval_wall_s": round(progress.eval_seconds, 2),
        "wall_s": round(progress.wall_seconds, 2),
        "eval_n": len(eval_tasks),
        "eval": [list(e) for e in progress.evals],
        "time_to_target_s": (
            None if progress.time_to_target is None else round(progress.time_to_target, 2)
        ),
        "target": args.target,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/countdown/local_async.yaml")
    parser.add_argument("--target", type=float, default=0.55, help="held-out accuracy to reach")
    parser.add_argument("--max-seconds", type=float, default=1800.0, help="training wall budget")
    parser.add_argument(
        "--steps", type=int, default=None, help="optimizer steps (default: no limit)"
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="steps between evals (default: eval.every_steps)",
    )
    parser.add_argument("--eval-n", type=int, default=None, help="evaluate the first N eval tasks")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    if trl.__version__ != TRL_VERSION:
        print(f"warning: written for trl=={TRL_VERSION}, found {trl.__version__}", file=sys.stderr)
    torch.set_num_threads(args.threads)
    stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):  # libraries print; stdout carries only the result
        result = run(args)
    print(json.dumps(result), file=stdout)


if __name__ == "__main__":
    main()
