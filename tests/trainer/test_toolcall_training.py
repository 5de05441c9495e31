"""`emapg train` with rollout.format=tool_calls: the config key is checked, one step trains on tool-call rollouts.

Real parts: the scripted tiny tool-call searcher (tests/fixtures/toolcalls.py) as the policy, the real
retriever server over HTTP, the real trainer.
"""

from __future__ import annotations

import pytest
import torch

from emapg.config import ConfigError, load_config
from emapg.paths import CONFIG_DIR
from trainer.config import TrainConfig
from trainer.loop import Trainer

FAST = ["logging.progress=false", "data.prompts_per_step=2", "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=2",
        "rollout.max_tokens_per_turn=24", "rollout.max_obs_tokens=96", "rollout.max_response_tokens=400",
        "rollout.max_prompt_tokens=768", "run.save_every=0", "run.total_steps=1"]


def test_the_format_key_is_checked():
    with pytest.raises(ConfigError, match="rollout.format"):
        load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", ["rollout.format=json"])
    with pytest.raises(ConfigError, match="rollout.tool_parser"):
        load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", ["rollout.format=tool_calls", "rollout.tool_parser=x"]).validate()


def test_one_step_on_tool_call_rollouts(tmp_path, tool_searcher_dir, retriever_server):
    cfg = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", [
        f"run.output_dir={tmp_path}", f"model.policy={tool_searcher_dir}", f"retriever.urls=[{retriever_server.url}]",
        "rollout.format=tool_calls", *FAST])
    trainer = Trainer(cfg).setup()
    try:
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        m = trainer.train_step()
        assert m["search/failures"] == 0 and m["reward/rollout_errors"] == 0 and m["actor/updates"] == 2
        assert m["search/per_traj"] == 2  # every rollout called the search tool (max_turns times)
        after = trainer.model.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)
        card = trainer.provenance["protocol_card"]
        assert card["settings"]["format"] == "tool_calls" and card["settings"]["tool_parser"] == "hermes"
    finally:
        trainer.close()
