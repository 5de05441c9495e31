"""``SFTConfig``: the schema of ``emapg sft`` configs (``configs/sft_*.yaml``).

Supervised warm start of a search agent on trajectories with the observation tokens
masked out of the loss. The ``rollout`` section is the agent loop's own
(:class:`agent.rollout.RolloutConfig`): copy it from the RL config the policy will be
trained with next, so the warm-start tokens are exactly the tokens RL will see.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agent.rollout import RolloutConfig
from emapg.config import ConfigError, option
from tasks.task import get_task
from trainer.config import LoraConfig, RetrieverConfig
from trainer.algo import DEFAULT_CHUNK_SIZE


@dataclass
class SFTRunConfig:
    name: str = option("sft", help="run name; the default output folder is runs/<name>")
    output_dir: str | None = option(None, help="folder for the fine-tuned policy, the data record and the loss curve (default runs/<name>)")
    seed: int = option(0, help="seed for the held-out split, the data order and LoRA initialisation")
    device: Literal["auto", "cpu", "cuda"] = option("auto", help="training device; auto picks cuda when available")
    threads: int | None = option(None, help="torch CPU threads (default: torch's choice, i.e. OMP_NUM_THREADS)")

    def validate(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ConfigError("run.threads must be >= 1")


@dataclass
class SFTModelConfig:
    policy: str = option("tiny-qwen2", help="model to fine-tune: a local HF folder, an alias (tiny-qwen2, smollm2-135m-instruct, "
                        "smollm2-135m-search-starter), a peft adapter folder, or a run/checkpoint folder")
    lora: LoraConfig = option(
        default_factory=LoraConfig,
        help="LoRA adapters (trainer.lora); the output's policy/ is then the merged model and adapter/ the peft adapter",
    )
    chunk_size: int = option(DEFAULT_CHUNK_SIZE, help="tokens per chunk of the fused lm_head log-prob pass")
    gradient_checkpointing: bool = option(False, help="recompute activations in the backward pass (less memory, slower)")

    def validate(self) -> None:
        if not self.policy:
            raise ConfigError("model.policy must name a model")
        if self.chunk_size < 1:
            raise ConfigError("model.chunk_size must be >= 1")


@dataclass
class SFTDataConfig:
    source: Literal["construct", "file"] = option(
        "construct",
        help="construct: trajectories built from QA training pairs through the live retriever (question -> search -> "
        "retrieved passages -> gold answer), kept only when the passages contain the answer; file: a trajectories jsonl",
    )
    path: str | None = option(
        None, help="source=file: jsonl with rows {question, turns: [model turn texts]} (observations from the retriever) "
        "or {question, response: Search-R1 text with <information> blocks} (observations replayed from the text)",
    )
    datasets: list[str] = option(["nq", "hotpotqa"], help="source=construct: registered QA datasets whose train split supplies questions")
    limit: int | None = option(None, help="source=construct: at most this many questions per dataset (seeded sample), before filtering")
    max_trajectories: int | None = option(None, help="use at most this many trajectories after filtering (None: all)")
    heldout_fraction: float = option(0.1, gt=0, lt=1, help="fraction of the trajectories held out to measure the SFT loss")
    exclude_eval_questions: bool = option(
        True, help="drop questions whose normalised text is in the held-out split of a bundled QA set (data/qa/heldout.json; always on for constructed data)"
    )

    def validate(self) -> None:
        if self.source == "file" and not self.path:
            raise ConfigError("data.source=file needs data.path (a trajectories .jsonl)")
        if self.path and not Path(self.path).expanduser().is_file():
            raise ConfigError(f"data.path: file not found: {self.path}")
        if self.source == "construct" and not self.datasets:
            raise ConfigError("data.datasets must name at least one dataset for data.source=construct")
        if self.limit is not None and self.limit < 1:
            raise ConfigError("data.limit must be >= 1 when set")
        if self.max_trajectories is not None and self.max_trajectories < 2:
            raise ConfigError("data.max_trajectories must be >= 2 (one to train on, one held out)")


@dataclass
class SFTOptimConfig:
    lr: float = option(1e-5, gt=0, help="AdamW learning rate (constant after warm-up)")
    epochs: int = option(1, help="passes over the training trajectories")
    batch_size: int = option(4, help="trajectories per optimizer step (token-mean loss over their model tokens)")
    weight_decay: float = option(0.0, ge=0, help="AdamW weight decay")
    grad_clip: float = option(1.0, ge=0, help="clip the global gradient norm to this value (0: off)")
    warmup_steps: int = option(0, help="linear learning-rate warm-up over this many optimizer steps")
    eval_every: int = option(0, help="measure the held-out loss every N optimizer steps (0: only before and after)")

    def validate(self) -> None:
        if self.epochs < 1 or self.batch_size < 1:
            raise ConfigError("optim.epochs and optim.batch_size must be >= 1")
        if self.warmup_steps < 0 or self.eval_every < 0:
            raise ConfigError("optim.warmup_steps and optim.eval_every must be >= 0")


@dataclass
class SFTConfig:
    """Everything ``emapg sft`` needs; see ``configs/sft_*.yaml`` for presets."""

    run: SFTRunConfig = option(default_factory=SFTRunConfig, help="run bookkeeping")
    model: SFTModelConfig = option(default_factory=SFTModelConfig, help="the policy to fine-tune")
    data: SFTDataConfig = option(default_factory=SFTDataConfig, help="where the trajectories come from")
    rollout: RolloutConfig = option(default_factory=RolloutConfig, help="the agent loop the trajectories are assembled by (copy the RL config's)")
    retriever: RetrieverConfig = option(default_factory=RetrieverConfig, help="search backend for constructed trajectories and file rows without observations")
    optim: SFTOptimConfig = option(default_factory=SFTOptimConfig, help="optimizer and schedule")

    def validate(self) -> None:
        if not get_task(self.rollout.task).searches:
            raise ConfigError("rollout.task must be search: emapg sft fine-tunes search agents")
        if self.rollout.n_samples != 1:
            raise ConfigError("rollout.n_samples must be 1 for supervised trajectories")
        if self.data.source == "construct" and not (self.retriever.urls or self.retriever.index_dir):
            raise ConfigError("data.source=construct needs retriever.urls or retriever.index_dir (the live retriever)")

    @property
    def output_path(self) -> Path:
        return Path(self.run.output_dir or Path("runs") / self.run.name)
