"""The run planner (trainer/plan, `emapg plan`): component arithmetic against hand-computed figures and against the
tensors the real code allocates, the refusal of `emapg train`, `--probe` on the tiny preset, the docs table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from emapg.config import load_config
from trainer.config import TrainConfig
from trainer.plan.catalogue import ModelShape, get_device, model_shape
from trainer.plan.memory import layout, memory_phases, stored_stats_bytes
from trainer.plan.planner import GIB, estimate, plan_run

ROOT = Path(__file__).resolve().parents[2]
TINY_CPU = ROOT / "configs" / "math_tiny_cpu.yaml"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

# h = 8, i = 16, 2 layers, 2 heads of 4 (q 8), 1 kv head (kv 4), V = 32, tied, q/k/v biases (Qwen2)
SMALL = ModelShape(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                   vocab_size=32, tie_word_embeddings=True, attention_bias=True)


def tiny_cfg(*overrides: str) -> TrainConfig:
    return load_config(TrainConfig, TINY_CPU, ["run.device=cpu", *overrides])


def test_parameter_and_lora_counts_by_hand():
    # per layer: q 8*8 + k 8*4 + v 8*4 + o 8*8 = 192, biases 8 + 4 + 4 = 16, MLP 3 * 8 * 16 = 384, two norms 16 -> 608
    assert SMALL.layer_params == 608
    assert SMALL.params == 32 * 8 + 2 * 608 + 8 == 1480  # embedding (tied head), layers, final norm
    # LoRA r = 2 on q and v: 2 layers x (2 * (8 + 8) + 2 * (8 + 4)) = 2 * 56
    assert SMALL.lora_params(2, ["q_proj", "v_proj"]) == 112
    assert SMALL.lora_params(1, ["all-linear"]) == 2 * (16 + 12 + 12 + 16 + 24 + 24 + 24)


def test_memory_components_by_hand():
    """Adam states, gradients, the EMA anchor (full and over adapters) and Top-k buffers for the small shape."""
    cpu = get_device("cpu")
    cfg = tiny_cfg("rollout.engine=remote", "rollout.engine_urls=[http://127.0.0.1:9]", "algorithm.kl.type=topk_reverse",
                   "algorithm.kl.topk=4", "rollout.max_prompt_tokens=6", "rollout.max_response_tokens=5",
                   "rollout.max_tokens_per_turn=5", "data.prompts_per_step=2", "rollout.n_samples=2",
                   "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=4")
    lay = layout(cfg, 1)
    update = memory_phases(cfg, SMALL, lay, cpu, None)["update"]
    # the anchor also blends the rotary embedding's float buffers (inv_freq, original_inv_freq: head_dim / 2 each)
    assert update["weights"] == 1480 * 4 and update["optimizer"] == 2 * 1480 * 4 and update["anchor"] == (1480 + 4) * 4
    # 4 rows x 5 response tokens x (old_logp, entropy, behaviour log-prob, advantage: 4 x 4 B + top-4 int64 + fp32
    # logits: 4 x 12 B + anchor logp, logsumexp: 8 B) + the batch: 4 rows x 11 tokens x (8 + 8 + 4) B
    assert stored_stats_bytes(cfg, SMALL, lay, cpu) == 4 * 5 * (16 + 48 + 8) + 4 * 11 * 20
    lora = tiny_cfg("model.lora.enabled=true", "model.lora.rank=2", "model.lora.target_modules=[q_proj,v_proj]",
                    "algorithm.ema.decay=0.9")
    phases = memory_phases(lora, SMALL, layout(lora, 1), cpu, None)["update"]
    assert phases["weights"] == (1480 + 112) * 4 and phases["optimizer"] == 2 * 112 * 4 and phases["anchor"] == 112 * 4
    frozen = tiny_cfg("model.lora.enabled=true", "algorithm.ema.decay=1.0")
    assert memory_phases(frozen, SMALL, layout(frozen, 1), cpu, None)["update"]["anchor"] == 0  # adapters off: no tensors
    # FSDP2 over 4 ranks shards weights, gradients, optimizer states and the anchor
    sharded = memory_phases(cfg, SMALL, layout(cfg, 4), cpu, None)["update"]
    assert sharded["weights"] == 1480 * 4 // 4 and sharded["optimizer"] == 2 * 1480 * 4 // 4



def test_checkpointing_activations_and_flops_by_hand():
    """Gradient checkpointing: the update's live set peaks in the top layer's backward (every layer's input and that
    layer's recomputed set less its input; no logits buffer), and the recompute runs the layers (not the lm_head) up
    to down_proj's input; the lm_head projects the response positions only."""
    from trainer.plan.timing import update_flops

    cpu = get_device("cpu")
    shapes = ["rollout.engine=remote", "rollout.engine_urls=[http://127.0.0.1:9]", "algorithm.kl.enabled=false",
              "rollout.max_prompt_tokens=6", "rollout.max_response_tokens=5", "rollout.max_tokens_per_turn=5",
              "data.prompts_per_step=2", "rollout.n_samples=2", "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=4"]
    ckpt, plain = tiny_cfg(*shapes, "model.gradient_checkpointing=true"), tiny_cfg(*shapes)
    assert SMALL.recomputed_layer_params == 608 - 16 * 8  # all but down_proj
    update = memory_phases(ckpt, SMALL, layout(ckpt, 1), cpu, None)["update"]
    # 4 rows x 11 tokens, one pass per row; a layer saves 7h + 6kv + 4i + 11 key positions = 155 values per token; the
    # MLP's backward adds the layer output's gradient and two of the intermediate width: h + 2i = 40
    assert update["activations"] == 4 * 11 * (2 * 8 + 155 - 8 + 40) * 4 and update["logits"] == 0
    assert update["gradients"] == 32 * 8 * 4  # the lm_head's (tied embedding), produced before the layers' backward
    # per trained token: 6 x 1216 layer parameters + 3 x attention (2 x 2 layers x 11 x 8), the recompute 2 x 480 x 2
    # layers + one more attention; the lm_head: 6 x 256 on 4 x 5 response positions
    attention = 2 * 2 * 11 * 8
    assert update_flops(ckpt, SMALL, layout(ckpt, 1), None) == 44 * (6 * 1216 + 3 * attention + 2 * 480 * 2 + attention) + 20 * 6 * 256
    # without checkpointing the group's prompt runs once: 2 prompts x 6 + 4 x 5 tokens
    assert update_flops(plain, SMALL, layout(plain, 1), None) == 32 * (6 * 1216 + 3 * attention) + 20 * 6 * 256

def test_the_components_are_the_tensors_the_trainer_allocates(tiny_model_dir):
    """The planner's static components against the real policy: parameters, Adam states after a step, the anchor
    (full, and over LoRA adapters), counted from the tensors themselves."""
    import torch

    from trainer import distributed as D
    from trainer.policy import build_policy

    dist = D.init_distributed("cpu", "auto")
    for extra in ([], ["model.lora.enabled=true", "model.lora.rank=4"]):
        cfg = tiny_cfg(f"model.policy={tiny_model_dir}", "algorithm.ema.decay=0.9", *extra)
        policy = build_policy(cfg, dist, str(tiny_model_dir), bf16=False)
        plan = memory_phases(cfg, model_shape(str(tiny_model_dir)), layout(cfg, 1), get_device("cpu"), None)["update"]
        params = sum(p.numel() * p.element_size() for p in policy.model.parameters())
        assert plan["weights"] == params
        trainable = [p for p in policy.model.parameters() if p.requires_grad]
        loss = sum((p.float() ** 2).sum() for p in trainable)
        loss.backward()
        policy.optimizer.step()
        adam = sum(t.numel() * t.element_size() for s in policy.optimizer.state.values() for t in s.values()
                   if torch.is_tensor(t) and t.dim() > 0)
        assert plan["optimizer"] == adam
        assert plan["anchor"] == sum(t.numel() * t.element_size() for t in policy.anchor.tensors.values())



def test_checkpointed_backward_peak_is_the_recompute_count(tiny_model_dir):
    """The live tensor bytes of a checkpointed forward+backward of the policy's hidden states (torch profiler, above
    what was live before) against the planner's update-phase count: the top layer's backward (every layer's input and
    that layer's recomputed set) and the tied embedding's gradient."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from trainer import distributed as D
    from trainer.batch import build_token_batch
    from trainer.model_forward import causal_lm_hidden
    from trainer.plan.memory import recompute_activation_bytes
    from trainer.plan.probe import live_peak
    from trainer.policy import build_policy

    cfg = tiny_cfg(f"model.policy={tiny_model_dir}", "model.gradient_checkpointing=true", "rollout.max_prompt_tokens=64",
                   "rollout.max_response_tokens=64", "rollout.max_tokens_per_turn=64", "data.prompts_per_step=1",
                   "rollout.n_samples=4", "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=4")
    policy = build_policy(cfg, D.init_distributed("cpu", "auto"), str(tiny_model_dir), bf16=False)
    policy.model.train()
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(10, 1000, (64,), generator=g).tolist() for _ in range(8)]
    batch = build_token_batch(ids[:4], ids[4:], [[1] * 64] * 4, pad_id=0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        hidden, _ = causal_lm_hidden(policy.model, batch.input_ids, batch.attention_mask, 64, share_prompt=True)
        (hidden.float() ** 2).mean().backward()
        del hidden
    peak = live_peak(prof)[0]
    update = memory_phases(cfg, model_shape(str(tiny_model_dir)), layout(cfg, 1), get_device("cpu"), None)["update"]
    assert update["activations"] == recompute_activation_bytes(cfg, model_shape(str(tiny_model_dir)), layout(cfg, 1),
                                                               get_device("cpu")) and update["logits"] == 0
    predicted = update["activations"] + update["gradients"]  # with the tied embedding's (V, h) gradient
    assert abs(predicted - peak) <= 0.1 * peak, (predicted, peak)

def test_the_cpu_peak_is_the_allocators_records_in_time_order():
    """The probe's CPU peak: allocations and frees in the order they happened, not each op's net bytes at its start
    (a composite op that frees what its children allocated would hide the moment they were all live)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from trainer.plan.probe import live_peak

    mib = 2**20
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("emapg_plan::update"):  # two 4 MiB tensors live together, freed inside the range
            a, b = torch.ones(mib), torch.ones(mib)
            del a, b
        kept = torch.ones(mib // 4)
    peak, at, ranges = live_peak(prof, "emapg_plan::")
    assert peak == 8 * mib
    assert [name for *_, name in ranges] == ["update"] and ranges[0][0] <= at <= ranges[0][1]
    events = sorted(prof.events(), key=lambda e: e.time_range.start)  # the net-bytes-at-start sum misses it
    running = [sum(e.self_cpu_memory_usage for e in events[: i + 1]) for i in range(len(events))]
    assert max(running) < 8 * mib
    del kept


def test_plan_json_contract_and_refusal_knob():
    proc = subprocess.run([sys.executable, "-m", "app.cli", "plan", "configs/search_qwen2.5-3b_emapg.yaml", "--device", "h100-80gb",
                           "--devices", "8", "--json", "--out", "-"], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    j = json.loads(proc.stdout)
    assert j["memory_bytes"]["total"] == sum(v for k, v in j["memory_bytes"].items() if k != "total")
    assert set(j["step_seconds"]) == {"rollout", "update", "sync", "total"} and j["fits"] is True
    assert j["device"]["name"] == "NVIDIA H100 80GB SXM" and j["model"]["params"] == 3_085_938_688  # Qwen2.5-3B's count
    assert j["step_seconds"]["total"] == pytest.approx(sum(v for k, v in j["step_seconds"].items() if k != "total"))


def test_train_refuses_what_cannot_fit_naming_the_override(tmp_path):
    """A config whose activations do not fit a small memory limit, which gradient checkpointing would fit."""
    overrides = ["rollout.max_response_tokens=1024", "rollout.max_tokens_per_turn=1024", f"run.output_dir={tmp_path}"]
    cfg = tiny_cfg(*overrides)
    cpu = get_device("cpu")
    without = estimate(cfg, cpu).peak_bytes
    with_ckpt = estimate(tiny_cfg(*overrides, "model.gradient_checkpointing=true"), cpu).peak_bytes
    assert with_ckpt < without
    limit = (with_ckpt + without) / 2 / GIB
    proc = subprocess.run([sys.executable, "-m", "app.cli", "train", "--config", str(TINY_CPU), *overrides, "run.device=cpu",
                           "--device-memory", f"{limit:.9f}"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert "does not fit" in line and "largest component activations" in line
    assert "try model.gradient_checkpointing=true" in line and f"{without:,}" in line and "--no-plan" in line
    assert not (tmp_path / "metrics.jsonl").exists()



def test_no_plan_skips_the_refusal_and_trains(tmp_path):
    """End to end: under a memory limit too small for the weights and Adam states, `emapg train` refuses before anything
    loads; the same command with --no-plan skips the plan (no plan.json) and trains its one step."""
    small = ["data.prompts_per_step=2", "rollout.n_samples=2", "rollout.max_response_tokens=8", "rollout.max_tokens_per_turn=8",
             "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=4", "run.total_steps=1", "run.save_every=0",
             "logging.progress=false", "run.device=cpu"]
    cfg = tiny_cfg(*small)
    plan = estimate(cfg, get_device("cpu"))
    limit = (plan.memory_bytes["weights"] + plan.memory_bytes["optimizer"]) / 2 / GIB  # below what certainly stays live
    runs = {}
    for name, flag in (("refused", []), ("no_plan", ["--no-plan"])):
        out = tmp_path / name
        runs[name] = out, subprocess.run(
            [sys.executable, "-m", "app.cli", "train", "--config", str(TINY_CPU), *small, f"run.output_dir={out}",
             "--device-memory", f"{limit:.9f}", *flag], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    out, proc = runs["refused"]
    assert proc.returncode == 2 and "does not fit" in proc.stderr and "--no-plan" in proc.stderr, proc.stderr[-3000:]
    assert not (out / "metrics.jsonl").exists() and not (out / "plan.json").exists()
    out, proc = runs["no_plan"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "does not fit" not in proc.stderr and not (out / "plan.json").exists()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == 1 and rows[0]["step"] == 1


def test_refitted_rates_reproduce_the_probed_step():
    """The probe's refit: planned again with the refitted rates (the decode latency scaled with them), the probed
    shapes take exactly the measured seconds -- for a model whose rollout is mostly the fixed per-token latency too."""
    from trainer.plan.probe import StepTimes, refit

    cpu = get_device("cpu")
    cfg = tiny_cfg("data.prompts_per_step=2", "rollout.n_samples=4")
    before = plan_run(cfg, cpu)
    assert before.step_seconds["rollout"] > 0.5 * before.step_seconds["total"]  # the tiny model: latency-bound decoding
    measured = StepTimes(rollout=before.step_seconds["rollout"] / 3, update=before.step_seconds["update"] * 2, sync=None)
    after = plan_run(cfg, cpu, rates=refit(before, measured))
    assert after.step_seconds["rollout"] == pytest.approx(measured.rollout)
    assert after.step_seconds["update"] == pytest.approx(measured.update, rel=0.02)  # + the memory-bound optimizer pass

def test_probe_on_the_tiny_preset():
    proc = subprocess.run([sys.executable, "-m", "app.cli", "plan", str(TINY_CPU), "data.prompts_per_step=2",
                           "--probe", "--json", "--out", "-"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    j = json.loads(proc.stdout[proc.stdout.index("{"):])
    probe = j["probe"]
    assert len(probe["steps"]) == 4 and all(s["update"] > 0 and s["rollout"] > 0 for s in probe["steps"])
    # the measured peak holds at least what is certainly live: weights, Adam states, anchor, the engine's weights
    static = sum(probe["unprobed"]["memory_bytes"].get(k, 0) for k in ("weights", "optimizer", "anchor"))
    assert probe["measured_peak_bytes"] >= static
    assert "refitted" in j["rates"]["source"] and j["step_seconds"]["update"] > 0
    assert probe["memory_error"] == pytest.approx((probe["unprobed"]["memory_bytes"]["total"] - probe["measured_peak_bytes"])
                                                  / probe["measured_peak_bytes"])


def _gen_plan_table():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_plan_table", ROOT / "scripts" / "gen_plan_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_table_is_the_planners_json():
    gen = _gen_plan_table()
    page = (ROOT / "docs" / "planning.md").read_text()
    assert gen.render(page) == page, "run python scripts/gen_plan_table.py"
    j = gen.preset_plan(ROOT / "configs" / "search_qwen2.5-3b_emapg.yaml", "h100-80gb", 8)
    row = next(line for line in page.splitlines() if line.startswith("| `search_qwen2.5-3b_emapg` | 8x"))
    assert f"**{j['memory_bytes']['total'] / 2**30:.1f}**" in row and f"${j['run']['cost']:,.0f}" in row
    assert "predicted, not yet measured on a GPU" in page or "measured by `make gpu-check`" in page
    presets = {p.stem for p in (ROOT / "configs").glob("*.yaml") if not p.name.startswith("sft_")}
    assert all(sum(f"| `{name}` |" in line for line in page.splitlines()) == 3 for name in presets)


def test_the_planner_imports_no_torch():
    code = ("import sys; import trainer.plan.planner, trainer.plan.cli, trainer.plan.compare; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_a_plan_that_does_not_fit_names_a_knob_and_largest_values():
    cfg = load_config(TrainConfig, ROOT / "configs" / "search_qwen2.5-3b_emapg.yaml", [])
    plan = plan_run(cfg, get_device("a100-40gb"))
    assert not plan.fits and plan.knob and plan.knob in plan.refusal()
    roomy = plan_run(cfg, get_device("h100-80gb"), devices=8)
    assert roomy.fits and roomy.largest["micro_batch_size"] >= cfg.algorithm.micro_batch_size
