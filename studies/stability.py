"""Collapse, measured and caught early: GRPO, EMA-PG and its two halves under a stress setting (issue #42).

PRE-REGISTERED PROTOCOL (written and committed before any run of it; 2026-12-05)
================================================================================

Question. Under a training setting harsh enough that plain GRPO collapses in a real fraction of seeds, how often
does each algorithm collapse, which half of EMA-PG (the moving anchor or the Top-k estimator) carries any
difference, and which per-step signal sees a collapse before the reward does?

Collapse (:class:`trainer.collapse.CollapseDefinition`, defaults): a run has collapsed at step s when its mean
reward stays below 0.5 x its starting level (the mean over its first 2 steps) for 3 consecutive steps from s, or
when its non-text share (``response/non_text_share``) exceeds 0.5 at s; the earlier of the two.

Arms (``ARMS``; each a set of overrides of the production trainer, same seeds, same questions):

* ``grpo``        -- K3 KL to the frozen reference (eta = 1), no importance weight;
* ``emapg``       -- Top-k reverse KL (k = 32, tail + IW) to an EMA anchor (eta = 0.9, period 2);
* ``ema_k3``      -- the anchor half: K3 to the EMA anchor (eta = 0.9, period 2);
* ``frozen_topk`` -- the estimator half: Top-k reverse KL (k = 32, tail + IW) to the frozen reference;
* ``emapg_guard`` -- ``emapg`` with the stability guard on, every detector's action ``rollback`` (checkpoints
  every step);
* ``grpo_entropy_ctl`` -- (added 2026-12-05 before any protocol run, item 4 of the issue) ``grpo`` with the
  target-entropy controller (``algorithm.entropy_target=0.3``, start coefficient 0.001, rate 0.5, range
  [1e-4, 0.1]; :mod:`trainer.entropy_control`). The coefficient is never negative: it can only push entropy up.

Every run logs ``kl/to_start`` (``logging.kl_to_start``) and probes 8 fixed training questions greedily every 2
steps (``logging.probe_size``), so every signal of :mod:`trainer.health_signals` is in its metrics.

Task and stress setting. The toy search task of ``tests/fixtures/trainer.py`` (8 synthetic facts behind a real
``emapg serve``; tiny-qwen2 warm-started for ``WARM_CACHE_STEPS`` steps so that it answers about half right),
``configs/search_tiny_cpu.yaml``, 8 prompts x 4 samples per step, one optimizer step per batch. The stress setting
is chosen by a short sweep *before* the protocol's runs, by a fixed rule: GRPO at every (lr, beta) of
``SWEEP_LR`` x ``SWEEP_BETA`` (beta = ``algorithm.kl.coef``), 2 sweep seeds (100, 101, never protocol seeds),
``--steps`` steps; grid points in order of increasing lr, then decreasing beta; the first point at which GRPO
collapses in at least one of the two sweep seeds is the stress setting (none: the last, harshest point). The
number of steps is fixed by the budget (``--steps``, default 12), not swept. The sweep's runs are reported.

AMENDMENT (2026-12-05, before any protocol run; what was tried). The machine is shared with a CPU benchmark that
has priority: a toy step (8 prompts x 4 samples) takes 3 s when the CPU is free and 20-35 s when it is not, about
1 step/min per process with several processes. A first GRPO probe at the first grid point (lr 1e-3, beta 0.1, seed
100, stopped after 7 of 12 steps) went reward 0.69, 0.25, 0.34, 0.125, 0.03, 0.25, 0.44 (start level 0.47: two
steps below half of it, then back: not a collapse), entropy 0.31 -> 1.05 (rising: the policy turns to noise, not
to a single answer), kl/to_start 0.3-0.9, probe answers flipping 88-100% between probes. So that the sweep and 5
seeds of all six toy arms fit the session, the steps are cut from 12 to **8** (``--steps 8``) for the sweep and the
arms alike, and the arms run in parallel processes over one ``--work`` (``--arms``). Everything else as above.

SWEEP RESULT (2026-12-05, 8 steps; GRPO mean reward per step, collapse step by the definition above):

* lr 1e-3, beta 0.1: seed 100 0.69 0.25 0.34 0.12 0.03 0.25 0.44 0.34 (none); seed 101 0.66 0.06 0.19 0.41 0.22
  0.28 0.06 0.19 (none) -- entropy rose 0.3 -> 0.6-1.1 in both;
* lr 1e-3, beta 0.001: seed 100 0.69 0.25 0.19 0.19 0.03 0.00 0.00 0.00 (**collapsed at step 3**); seed 101 0.66
  0.06 0.22 0.22 0.12 0.19 0.12 0.03 (none: below half its start in 2 consecutive steps twice, never 3).

So the stress setting is **lr 1e-3, beta 0.001, 8 steps** (the first grid point with a collapsed sweep seed; the
later grid points were started in parallel and stopped once this was known). Off-protocol, before the sweep had
decided, GRPO seeds 0 and 1 were run at lr 1e-3, beta 0.1: seed 0 did not collapse (0.53 0.41 0.44 0.06 0.31 0.34
0.38 0.38), seed 1 collapsed at step 3 (0.66 0.00 0.00 0.00 0.00 0.09 0.19 0.19); they are not protocol runs.

Seeds. 5 per arm on the toy task (0-4), then 2 per arm (0, 1) of ``grpo``, ``emapg``, ``ema_k3`` and
``frozen_topk`` on the SmolLM2 search task (the shipped starter, ``configs/demo_search_smollm2.yaml``, the
answerable training pool and the bundled index) at the same lr and beta, with ``rollout.uniform_groups=topup`` (the
demo drops groups of equal rewards; here every signal and the reward are over all sampled trajectories).

Estimates. Per arm: the collapse rate with a 95% Wilson interval, the steps to collapse of each collapsed run;
EMA-PG - GRPO and each half - GRPO with Newcombe's hybrid Wilson interval on the difference. Per signal (each
detector of :data:`trainer.guard.DETECTORS` at its default thresholds, replayed alone over a run's metrics by
:func:`trainer.guard.first_trips`; the guarded arm is left out, its runs are changed by the guard): over the
collapsed runs, its lead time (collapse step - first trip; negative: after) -- the median and the share of
collapses it saw at least 2 steps ahead -- and its false-trip rate: the share of the runs that did not collapse on
which it tripped at all.

Targets (issue #42): GRPO collapses in >= 30% of seeds at the stress setting; at least one signal fires >= 2 steps
before the reward falls in >= 80% of collapses with <= 5% false trips. Whatever comes out is committed.

AMENDMENT 2 (2026-12-05, written before its runs). At beta = 0.001 the KL term barely acts, so the arms differ
little by construction. A second stress point where the KL term is strong: **lr 1e-3, beta 1.0, 8 steps**, the four
contract arms, seeds 0-4, the same collapse definition and estimates, in its own work folder and report
(``--lr 1e-3 --beta 1 --arms grpo,emapg,ema_k3,frozen_topk --out benchmarks/results/stability_beta1.json``). The
issue's one-seed lead was at beta = 1 (SmolLM2, lr 1e-4: GRPO -3.4 pp held-out greedy, EMA-PG -0.3). Question:
does the moving anchor or the Top-k estimator change the collapse rate when the KL term is strong?

AMENDMENT 3 (2026-12-05, after amendment 2's result, before these runs). At beta = 1 both Top-k arms collapsed (5
of 10 runs, every K3 run healthy), their token entropy jumping to 1-4.5 nats after the first update. Hypothesis from
trainer/algo/topk_kl.py: the default ``algorithm.kl.tail_grad=paper`` reproduces the release's gradient, which is
grad KL + grad pi(q) (q the top-k set): at pi = pi_ref the KL's gradient vanishes but beta x grad pi(q) does not, and
descending it pushes probability out of the top-k. Prediction: with ``tail_grad=exact`` (unbiased, same values) the
Top-k arm does not blow up. Arm ``frozen_topk_exact`` (frozen reference + Top-k, ``tail_grad=exact``), beta = 1,
seeds 0-4, into the same work folder and report as amendment 2.

AMENDMENT 4 (2026-12-06, written and committed before its runs). A slow stress. At lr 1e-3 the toy reward halves
at the first update in every run (all 25 protocol runs at beta 0.001: step 2 below step 1, by 0.1-0.7), so the
"collapses" at steps 3-6 are the tail of an immediate break; no signal can lead one at step 3 by 2 steps (step 1 is
the starting point), and the healthy runs are broken too. The failure users hurt from comes after a learning
phase. Sweep (``--grid slow``): GRPO at lr ``SLOW_SWEEP_LR`` = 1e-4, 2e-4, 4e-4, beta 0.001, the sweep seeds 100 and
101, **24 steps**; the same rule (lr ascending; the first point where a sweep seed collapses is the stress; none: the
last). Then the four contract arms at seeds 0-4 at that point, 24 steps, in their own work folder and report
(``benchmarks/results/stability_slow.json``); the same collapse definition, estimates and targets; no SmolLM2 arms
(``--smollm2-seeds 0``). If no sweep point collapses, the arms still run at the last point and the report says how
many runs collapsed, possibly none.

    python studies/stability.py --grid slow --steps 24 --smollm2-seeds 0 --arms grpo,emapg,ema_k3,frozen_topk \
        --work runs/stability_slow --out benchmarks/results/stability_slow.json

AMENDMENT 5 (2026-12-06 01:24 UTC, after amendment 4's sweep, before these runs). Amendment 4's sweep: no run
collapsed; at every lr of 1e-4 to 4e-4 GRPO learned (reward 0.66-0.69 -> 0.59-0.81 after 24 steps, entropy 0.31 ->
0.23-0.26), and the arms run at 4e-4 as its rule says. Between 4e-4 (learns) and 1e-3 (breaks at the first
update) lies the regime this benchmark wants. Sweep ``--grid mid``: GRPO at lr 6e-4, 8e-4, beta 0.001, seeds 100
and 101, 24 steps, the same rule; then the four contract arms at seeds 0-4 at the chosen point, 24 steps
(``benchmarks/results/stability_mid.json``, work folder ``runs/stability_mid``). A toy step takes under a second
on a free CPU, so this costs minutes.

AMENDMENT 6 (2026-12-06 07:25 UTC, written and committed before its runs). A late stress. Amendments 4 and 5 found
the two regimes but not the one between: at lr 8e-4 and above the reward halves at the first update (collapses at
steps 3-7, the tail of an immediate break, which no signal can lead by 2 steps); at 4e-4 and 6e-4 GRPO learned or
wandered for 24 steps without collapsing, but the last steps of a 6e-4 sweep run fell (seed 101: 0.53, 0.28, 0.09
at steps 22-24) and a 4e-4 run dipped at step 24. The collapse users report comes after a learning phase, late.
Sweep ``--grid late``: GRPO at lr ``LATE_SWEEP_LR`` = 4e-4, 6e-4, beta 0.001, the sweep seeds 100 and 101, **64
steps**. Rule: lr ascending, the first point where a sweep seed collapses at step >= ``LATE_MIN_COLLAPSE_STEP`` = 12
(a collapse after a learning phase; an earlier one does not count); none: the last point. Then the four contract
arms at seeds 0-4 at that point, 64 steps, in their own work folder and report (``runs/stability_late``,
``benchmarks/results/stability_late.json``), the same collapse definition, estimates and targets (the signals' lead
times and false trips are the question here: a late collapse leaves room for a 2-step lead), no SmolLM2 arms. If the
arms do not fit the session they run in the next one from the same sweep result.

    python studies/stability.py --grid late --steps 64 --smollm2-seeds 0 --arms grpo,emapg,ema_k3,frozen_topk \
        --work runs/stability_late --out benchmarks/results/stability_late.json

RESULT (2026-12-06, ``stability_late.json``, ``stability_late.png``). Sweep: no late collapse at either lr; GRPO
ended at 0.97 and 0.97 (4e-4), 0.97 and 0.62 (6e-4) at step 64, so the rule's last point, **lr 6e-4**, ran. Arms, seeds
0-4, 64 steps: GRPO 2/5 collapsed (0.40 [0.12, 0.77]), EMA-PG, EMA anchor + K3 and frozen reference + Top-k 1/5 each
(0.20 [0.04, 0.62]; each - GRPO -0.20 [-0.60, +0.31]). Four of the five collapses are seed 1's first-update break
(step 3, every arm); of those, GRPO recovered to 0.88 and EMA-PG to 0.69 by step 64, the two others ended at 0.
**One collapse came after a learning phase**: GRPO seed 2 at step 41, reward 0.91 -> 0.00 in one update (no-answer
rate 0.06 -> 0.97; step 40's gradient norm 0.22, ordinary) and 0 for the remaining 23 steps: every group had equal
rewards, so GRPO had no advantage left to climb back with. Nothing led it: ``format_errors``, ``reward_drop`` and
``kl_to_start`` all tripped at step 41 (lead 0). On the 15 runs that did not collapse: ``kl_to_start`` tripped on all,
``format_errors`` 7, ``reward_drop`` and ``repetition`` 4, ``kl_spike`` 3, ``gibberish`` and ``entropy_explosion`` 1
(single-step dips that recovered: the plot's spikes).

Not measured here: the SmolLM2 arms' end-of-run held-out change (greedy and sampled); see amendment 7.

AMENDMENT 7 (2026-12-06 09:25 UTC, written and committed before any SmolLM2 run). The SmolLM2 arms. The protocol
above ran them "at the same lr and beta" as the toy stress; that was written before amendments 2-6 showed that at
beta 0.001 the arms differ little by construction (the KL term barely acts) and that the toy's stress lr is a
property of the toy warm start, not of a model: no SmolLM2 run at lr 1e-3 exists to say what it does there. The one
SmolLM2 setting where a difference between the algorithms was measured is the issue's lead
(``learning_search_lever_beta1.json``: lr 1e-4, beta 1, 12 steps, one seed; held-out greedy EM GRPO -3.4 pp
[-6.3, -0.6], EMA-PG -0.3 [-2.9, +2.3]). The question here: does that lead hold on 2 seeds and, with the two
halves, which half carries it; and does any run collapse.

* Setting (``SMOLLM2_LR``, ``SMOLLM2_BETA``, ``SMOLLM2_STEPS``): **lr 1e-4, beta 1, 12 steps**; the four contract
  arms (``ARMS``: k = 32 tail + IW, the default ``tail_grad=paper``; EMA eta 0.9, period 2); seeds 0 and 1,
  seed-major (grpo, emapg, ema_k3, frozen_topk at seed 0, then at seed 1). The shipped starter
  (``emapg.models.STARTER``), ``configs/demo_search_smollm2.yaml`` (bf16 autocast), the answerable training pool,
  the bundled index behind a real retriever, one shared ``emapg engine serve`` (vLLM) for training and scoring;
  4 prompts x 4 samples per step, ``rollout.uniform_groups=topup``, ``logging.kl_to_start``, 8 probe questions
  every 2 steps.
* Held-out scoring (the reader slice, ``data/qa/reader_slice.json``, 181 held-out questions no training, warm start
  or selection touched; ``studies/distill.py``'s scoring): **greedy EM** and **sampled mean@2 EM** at T = 1.0,
  top_p 1.0, sampling seed 1; the starter scored once, each run's end checkpoint once.
* Estimates: per arm, end - start on each scoring, paired by question, with a 95% paired-bootstrap interval (pooled:
  the per-question score averaged over seeds; and per seed); each arm - GRPO at the end, the same way; the collapse
  rate (Wilson) and the signals' lead times and false trips as above, over the SmolLM2 runs alone.
* Known limit of the instrument, stated before the runs: at 16 trajectories per step and a starting reward near
  0.15, "below half the start for 3 consecutive steps" can happen by sampling noise alone (P(at most 1 of 16
  right) ~ 0.28 per step at p = 0.15); a SmolLM2 "collapse" is read with the held-out change beside it.
* Prediction from the lead (one seed, so weak): GRPO's greedy end - start below EMA-PG's. Whatever comes out is
  committed: ``benchmarks/results/stability_smollm2.json`` and ``.png`` (work folder ``runs/stability_smollm2``);
  then ``stability.json`` is rebuilt from its own records with the SmolLM2 section added
  (``--resume-from benchmarks/results/stability.json --report-only --steps 8 --work runs/stability_smollm2``).

    python studies/stability.py --smollm2-only --work runs/stability_smollm2

RESULT (2026-12-06, ``stability_smollm2.json``, ``.png``; the SmolLM2 section of ``stability.json``). Starter on the
reader slice (181 questions): greedy 34.3, sampled mean@2 20.2. End - start, pooled over seeds 0 and 1 [95% paired
bootstrap]; per seed:

* ``grpo``        greedy -4.1 [-8.8, +0.6] (0.0, -8.3); sampled -4.0 [-6.8, -1.4] (+1.1, -9.1)
* ``emapg``       greedy -2.5 [-6.6, +1.7] (-1.1, -3.9); sampled -5.9 [-9.0, -3.2] (-6.4, -5.5)
* ``ema_k3``      greedy -4.4 [-8.8, +0.0] (-1.7, -7.2); sampled -1.1 [-3.9, +1.7] (0.0, -2.2)
* ``frozen_topk`` greedy -2.2 [-6.4, +1.7] (-1.7, -2.8); sampled -3.3 [-6.1, -0.7] (+0.3, -6.9)

Arm - GRPO at the end: EMA-PG greedy +1.7 [-2.5, +5.8], sampled -1.9 [-4.6, +0.6]; EMA anchor + K3 greedy -0.3
[-3.6, +3.3], sampled **+2.9 [+0.6, +5.2]** (the one resolved difference); frozen reference + Top-k greedy +1.9
[-2.8, +6.6], sampled +0.7 [-1.9, +3.3]. This setting harms every arm on held-out questions within 12 steps. The
lead's GRPO-below-EMA-PG on greedy EM points the same way pooled (+1.7) but is not resolved, and GRPO's seed 0 lost
nothing. Collapse by the definition: 1 of 2 runs in every arm (steps 8, 4, 6, 4). As stated before the runs, these
are the batches' difficulty, not the policies: each seed's reward series has the same shape in all four arms (seed
0: 0.38 at step 1, then 0-0.19; seed 1: 0 at step 1, 0.25-0.44 at steps 4-6, then 0-0.19), since each seed draws the
same questions in every arm. No detector tripped on any of the 8 runs; ``kl/to_start`` stayed below 0.13.

Cost: about 150 min on 2 cores (sweep ~12 min, toy protocol ~30 min, SmolLM2 ~100 min; amendment 7's SmolLM2 arms
took 132 min, about 15 min a run: 12 steps of ~55 s and two reader-slice scorings of ~5 min together). Runs are kept in
``--work``: a finished run (its ``history.json``) is not run again. The report keeps every toy run's record, so
``--resume-from benchmarks/results/stability.json`` continues in an empty work folder (added 2026-12-05, after a
machine was lost with its work folder; it checks the stress setting and keeps the earlier sweep and replay).

Outputs: ``benchmarks/results/stability.json`` (contract: ``collapse_definition``; for each of ``grpo``,
``emapg``, ``ema_k3``, ``frozen_topk``: ``seeds``, ``collapse_rate``, ``collapse_rate_ci``; ``signals``: a list of
{``name``, ``median_lead_steps``, ``false_trip_rate``}) and ``stability.png``.

    python studies/stability.py                 # the protocol (long)
    python studies/stability.py --quick --out /tmp/stability.json   # 2 seeds x 3 steps, tiny-qwen2, no sweep
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from studies import harness  # noqa: E402
from studies.harness import RESULTS, difference, pct, per_question, seed_difference, seed_mean  # noqa: E402

TOPK = ["algorithm.kl.type=topk_reverse", "algorithm.kl.topk=32", "algorithm.kl.importance_weight=true"]
K3 = ["algorithm.kl.type=k3", "algorithm.kl.importance_weight=false"]
EMA = ["algorithm.ema.decay=0.9", "algorithm.ema.period=2"]
FROZEN = ["algorithm.ema.decay=1.0"]
ARMS: dict[str, list[str]] = {
    "grpo": ["algorithm.name=grpo", *K3, *FROZEN],
    "emapg": ["algorithm.name=emapg", *TOPK, *EMA],
    "ema_k3": ["algorithm.name=emapg", *K3, *EMA],
    "frozen_topk": ["algorithm.name=emapg", *TOPK, *FROZEN],
    # amendment 3: the estimator half with the unbiased Top-k gradient (the default reproduces the release's bias)
    "frozen_topk_exact": ["algorithm.name=emapg", *TOPK, "algorithm.kl.tail_grad=exact", *FROZEN],
    # GRPO with the target-entropy controller (trainer.entropy_control): target 0.3 nats/token, about the warm
    # start's step-1 entropy on the toy task (0.31 in the first sweep probe, seed 100)
    "grpo_entropy_ctl": ["algorithm.name=grpo", *K3, *FROZEN, "algorithm.entropy_target=0.3", "algorithm.entropy_coef=0.001",
                         "algorithm.entropy_rate=0.5", "algorithm.entropy_coef_range=[0.0001,0.1]"],
}
GUARDED = "emapg_guard"
CONTRACT_ARMS = ("grpo", "emapg", "ema_k3", "frozen_topk")
SMOLLM2_ARMS = CONTRACT_ARMS
# amendment 7: the SmolLM2 arms' setting (the issue's one-seed lead, learning_search_lever_beta1.json) and scoring
SMOLLM2_LR, SMOLLM2_BETA, SMOLLM2_STEPS = 1e-4, 1.0, 12
SMOLLM2_SAMPLES = 2  # sampled mean@2 on the reader slice (studies/distill.py's scoring)
SWEEP_LR = (1e-3, 3e-3, 1e-2)
SWEEP_BETA = (0.1, 0.001)
# amendment 4: the slow stress (collapse after a learning phase)
SLOW_SWEEP_LR = (1e-4, 2e-4, 4e-4)
SLOW_SWEEP_BETA = (0.001,)
# amendment 5: between the slow grid (learns) and the protocol's 1e-3 (breaks at the first update)
MID_SWEEP_LR = (6e-4, 8e-4)
# amendment 6: a collapse after a learning phase (64 steps); only a collapse at step >= LATE_MIN_COLLAPSE_STEP counts
LATE_SWEEP_LR = (4e-4, 6e-4)
LATE_MIN_COLLAPSE_STEP = 12
#: --grid -> (the lrs, the betas) of the sweep
GRIDS = {"protocol": (SWEEP_LR, SWEEP_BETA), "slow": (SLOW_SWEEP_LR, SLOW_SWEEP_BETA), "mid": (MID_SWEEP_LR, SLOW_SWEEP_BETA),
         "late": (LATE_SWEEP_LR, SLOW_SWEEP_BETA)}
#: --grid -> the earliest collapse step its sweep's rule counts
MIN_COLLAPSE_STEP = {"late": LATE_MIN_COLLAPSE_STEP}
SWEEP_SEEDS = (100, 101)
ALSO = ["studies/distill.py"]  # the SmolLM2 arms score with distill.evaluate
Z95 = 1.959963984540054


def wilson(k: int, n: int, z: float = Z95) -> list[float]:
    """The Wilson score interval of a proportion k/n ([0, 1] when n = 0)."""
    if n == 0:
        return [0.0, 1.0]
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def newcombe(k1: int, n1: int, k2: int, n2: int, z: float = Z95) -> list[float]:
    """Newcombe's hybrid score interval of p1 - p2 (method 10), from the two Wilson intervals."""
    p1, p2 = (k1 / n1 if n1 else 0.0), (k2 / n2 if n2 else 0.0)
    (l1, u1), (l2, u2) = wilson(k1, n1, z), wilson(k2, n2, z)
    d = p1 - p2
    return [d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)]


def run_record(history: list[dict[str, float]]) -> dict[str, Any]:
    """One run's series, collapse step and each detector's first trip (defaults, replayed alone)."""
    from trainer.collapse import collapse_step
    from trainer.guard import GuardConfig, first_trips

    def series(name: str) -> list[float | None]:
        return [h.get(name) for h in history]

    rewards = [float(h["reward/mean"]) for h in history]
    non_text = [float(h.get("response/non_text_share", 0.0)) for h in history]
    return {"reward": rewards, "non_text_share": non_text, "repeated_ngram_share": series("response/repeated_ngram_share"),
            "length_drift": series("response/length_drift"), "kl_to_start": series("kl/to_start"), "kl": series("kl/mean"),
            "entropy": series("actor/entropy"), "no_answer_rate": series("response/no_answer_rate"),
            "probe_flip_rate": series("probe/flip_rate"),
            "collapse_step": collapse_step(rewards, non_text), "first_trips": first_trips(history, GuardConfig(enabled=True))}


def summarise(runs: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Per arm the collapse rate (Wilson), steps to collapse; differences to GRPO (Newcombe); per signal its lead
    times and false-trip rate over the unguarded arms' runs. ``runs[arm][seed]``: :func:`run_record`'s."""
    from trainer.collapse import CollapseDefinition
    from trainer.guard import DETECTORS

    out: dict[str, Any] = {"collapse_definition": CollapseDefinition().describe()}
    counts = {}
    for arm, by_seed in runs.items():
        steps = [r["collapse_step"] for r in by_seed.values()]
        k, n = sum(s is not None for s in steps), len(steps)
        counts[arm] = (k, n)
        out[arm] = {"seeds": sorted(by_seed), "collapsed": k, "collapse_rate": k / n if n else None,
                    "collapse_rate_ci": wilson(k, n), "steps_to_collapse": [s for s in steps if s is not None]}
    if "grpo" in counts:
        for arm in counts:
            if arm != "grpo":
                out[arm]["minus_grpo_collapse_rate_ci"] = newcombe(*counts[arm], *counts["grpo"])
    pool = [r for arm, by_seed in runs.items() if arm != GUARDED for r in by_seed.values()]
    collapsed = [r for r in pool if r["collapse_step"] is not None]
    healthy = [r for r in pool if r["collapse_step"] is None]
    signals = []
    for name in DETECTORS:
        leads = [r["collapse_step"] - r["first_trips"][name] for r in collapsed if r["first_trips"].get(name) is not None]
        signals.append({
            "name": name, "metrics": list(DETECTORS[name][0]),
            "median_lead_steps": statistics.median(leads) if leads else None,
            "lead_steps": leads,
            "seen_2_ahead_frac": sum(x >= 2 for x in leads) / len(collapsed) if collapsed else None,
            "false_trip_rate": sum(r["first_trips"].get(name) is not None for r in healthy) / len(healthy) if healthy else None,
        })
    out["signals"] = signals
    out["runs_pooled"] = {"collapsed": len(collapsed), "healthy": len(healthy)}
    return out


#: the issue's leading signals that no detector reads (replayed runs are checked for them too)
LEADING_SIGNALS = ("loss/clip_frac", "probe/flip_rate", "probe/lost_rate")


def read_metrics(path: Path) -> list[dict[str, float]]:
    """A run's ``metrics.jsonl`` as its step metrics in step order (a step logged twice, as after a resume: the
    last line wins)."""
    by_step: dict[int, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_step[int(row["step"])] = row
    return [by_step[s] for s in sorted(by_step)]


def _arm_and_seed(name: str) -> tuple[str, int | None]:
    arm, sep, seed = name.rpartition("-seed")
    return (arm, int(seed)) if sep and seed.isdigit() else (name, None)


def replay_false_trips(folder: Path, control_arms: tuple[str, ...] = ("control",)) -> dict[str, Any]:
    """Every guard detector (defaults, each replayed alone by :func:`trainer.guard.first_trips`, the guard's own
    code) over the runs of ``folder`` (``<arm>-seed<N>/metrics.jsonl``, e.g. ``runs/learning_search``): per
    detector, its false-trip rate on the runs that did not collapse (collapse: :func:`trainer.collapse.collapse_step`
    on ``reward/mean``), the training arms pooled and ``control_arms`` (shuffled reward) apart. Only the runs with
    the folder's largest step count are replayed (the others are still running: listed, not counted). A detector
    whose metrics a run did not log cannot trip: its rate is over the runs that logged them, and the series that
    are missing are named."""
    from trainer.collapse import collapse_step
    from trainer.guard import DETECTORS, GuardConfig, first_trips

    found = {d.name: read_metrics(d / "metrics.jsonl") for d in sorted(folder.iterdir())
             if (d / "metrics.jsonl").is_file() and _arm_and_seed(d.name)[1] is not None}
    found = {name: h for name, h in found.items() if h}
    steps = max((len(h) for h in found.values()), default=0)
    in_progress = {name: len(h) for name, h in found.items() if len(h) < steps}
    runs: dict[str, dict[str, Any]] = {}
    for name, history in found.items():
        if name in in_progress:
            continue
        arm, seed = _arm_and_seed(name)
        rewards = [float(h["reward/mean"]) for h in history]
        non_text = [float(h.get("response/non_text_share", 0.0)) for h in history]
        trips = first_trips(history, GuardConfig(enabled=True))
        logged = {det: all(any(m in h for m in metrics) for h in history) for det, (metrics, _) in DETECTORS.items()}
        runs[name] = {"arm": arm, "seed": seed, "steps": len(history), "collapse_step": collapse_step(rewards, non_text),
                      "first_trips": trips, "logged": logged,
                      "trip_values": {det: _trip_value(history[step - 1], DETECTORS[det][0])
                                      for det, step in trips.items() if step is not None}}

    def rates(names: list[str]) -> dict[str, Any]:
        healthy = [runs[n] for n in names if runs[n]["collapse_step"] is None]
        per: list[dict[str, Any]] = []
        for det, (metrics, direction) in DETECTORS.items():
            with_series = [r for r in healthy if r["logged"][det]]
            tripped = [r for r in with_series if r["first_trips"][det] is not None]
            per.append({"name": det, "metrics": list(metrics), "direction": direction, "runs_with_series": len(with_series),
                        "false_trips": len(tripped),
                        "false_trip_rate": len(tripped) / len(with_series) if with_series else None,
                        "false_trip_rate_ci": wilson(len(tripped), len(with_series)),
                        "tripped": {f"{r['arm']}-seed{r['seed']}": r["first_trips"][det] for r in tripped}})
        return {"runs": sorted(names), "collapsed": sorted(n for n in names if runs[n]["collapse_step"] is not None),
                "healthy_runs": len(healthy), "signals": per}

    training = [n for n in runs if runs[n]["arm"] not in control_arms]
    control = [n for n in runs if runs[n]["arm"] in control_arms]
    watched = dict.fromkeys([*(m for metrics, _ in DETECTORS.values() for m in metrics), *LEADING_SIGNALS])
    missing = [m for m in watched if any(not any(m in h for h in found[n]) for n in runs)]
    return {"date": harness.now(), "folder": str(folder), "steps": steps, "in_progress": in_progress,
            "collapse": "trainer.collapse.collapse_step on reward/mean (and response/non_text_share)",
            "detectors": "trainer.guard.first_trips, every detector alone at its default thresholds",
            "missing_series": missing, "training_arms": rates(training), "control_arms": rates(control),
            "per_run": runs}


def _trip_value(metrics: dict[str, float], names: tuple[str, ...]) -> float | None:
    values = [float(metrics[m]) for m in names if isinstance(metrics.get(m), (int, float))]
    return max(values) if values else None


def print_false_trips(replay: dict[str, Any]) -> None:
    print(f"replayed {replay['folder']}: {len(replay['per_run'])} runs of {replay['steps']} steps"
          + (f"; still running, not counted: {replay['in_progress']}" if replay["in_progress"] else ""))
    if replay["missing_series"]:
        print(f"  series some of these runs did not log (a detector cannot trip on them): {', '.join(replay['missing_series'])}")
    for group in ("training_arms", "control_arms"):
        g = replay[group]
        print(f"  {group}: {len(g['runs'])} runs, {g['healthy_runs']} did not collapse, collapsed: {g['collapsed'] or 'none'}")
        for s in g["signals"]:
            rate = "n/a (no run logged it)" if s["false_trip_rate"] is None else (
                f"{s['false_trips']}/{s['runs_with_series']} = {s['false_trip_rate']:.2f}")
            print(f"    {s['name']:18s} false trips {rate}" + (f"  first trip steps {s['tripped']}" if s["tripped"] else ""))


def plot(runs: dict[str, dict[int, dict[str, Any]]], path: Path, title: str) -> Path:
    """Per arm (columns): the reward and the leading signals (rows) of every seed; collapsed runs dashed, their
    collapse step marked."""
    rows = [("reward", "mean reward"), ("repeated_ngram_share", "repeated 4-grams"), ("non_text_share", "non-text words"),
            ("length_drift", "length drift"), ("kl_to_start", "KL to start")]
    arms = list(runs)
    fig, axes = harness.figure(len(rows), len(arms), figsize=(3.4 * len(arms), 2.2 * len(rows)), squeeze=False)
    for j, arm in enumerate(arms):
        for seed, r in sorted(runs[arm].items()):
            c = r["collapse_step"]
            for i, (key, label) in enumerate(rows):
                ax = axes[i][j]
                ys = [y if y is not None else math.nan for y in r[key]]
                xs = list(range(1, len(ys) + 1))
                ax.plot(xs, ys, linestyle="--" if c else "-", linewidth=1.2, label=f"seed {seed}")
                if c:
                    ax.axvline(c, color="tab:red", alpha=0.4, linewidth=1)
                if j == 0:
                    ax.set_ylabel(label, fontsize=8)
                if i == 0:
                    ax.set_title(arm, fontsize=10)
                ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(title)
    return harness.save_figure(fig, path, dpi=100)


def toy_base(task: Any, url: str, work: Path) -> list[str]:
    """The toy arms' common overrides: ``task`` (a :class:`tests.fixtures.trainer.ToyTask`) behind the retriever at
    ``url``, from the cached tiny-qwen2 warm start (built the first time); each run sets its own output folder."""
    from emapg.models import resolve_model
    from tests.fixtures.trainer import WARM_CACHE_STEPS, cached_warm_start, toy_overrides

    start = cached_warm_start(Path(resolve_model("tiny-qwen2")), task, WARM_CACHE_STEPS)
    base = toy_overrides(task, url, work, **{"model.policy": str(start), "algorithm.micro_batch_size": 16})
    return [o for o in base if not o.startswith("run.output_dir=")]


class Runner:
    """Trains one run per (task, arm, seed) with the production trainer, kept in ``work`` for resumption."""

    def __init__(self, work: Path, *, steps: int, prompts: int, samples: int, probe: int, train_missing: bool = True) -> None:
        self.work, self.steps, self.prompts, self.samples, self.probe = work, steps, prompts, samples, probe
        self.train_missing = train_missing  # False (--report-only): a run not finished in work is None
        self.missing: list[str] = []

    def run(self, name: str, config: Path, base: list[str], arm: str, seed: int, lr: float, beta: float, *,
            guard: bool = False, keep_checkpoints: bool = False) -> dict[str, Any] | None:
        """One run of ``arm`` (its run folder ``<work>/<name>/run``); ``guard`` (always for :data:`GUARDED`): the
        guard on, every detector's action ``rollback``, a checkpoint every step; ``keep_checkpoints``: a checkpoint
        every step, all kept (else one at the end)."""
        from emapg.config import load_config
        from trainer.config import TrainConfig
        from trainer.errors import TrainingError
        from trainer.loop import train

        out = self.work / name
        done = out / "history.json"
        if (finished := harness.finished(done)) is not None:
            return finished
        if not self.train_missing:
            self.missing.append(name)
            return None
        guard = guard or arm == GUARDED
        extra = list(ARMS["emapg" if arm == GUARDED else arm])
        if guard:
            from trainer.guard import DETECTORS

            extra += ["guard.enabled=true", "guard.nonfinite.action=rollback", *(f"guard.{d}.action=rollback" for d in DETECTORS)]
        extra += ["run.save_every=1", "run.keep_last=0"] if guard or keep_checkpoints else ["run.save_every=0"]
        overrides = [*base, f"run.output_dir={out / 'run'}", f"run.seed={seed}", f"run.total_steps={self.steps}",
                     f"optim.lr={lr}", f"algorithm.kl.coef={beta}", "logging.progress=false", "logging.tensorboard=false",
                     "logging.kl_to_start=true", f"logging.probe_size={self.probe}", "logging.probe_every=2",
                     f"data.prompts_per_step={self.prompts}", f"rollout.n_samples={self.samples}",
                     f"algorithm.mini_batch_size={self.prompts * self.samples}", *extra]
        try:
            history = train(load_config(TrainConfig, config, overrides))
            stopped = None
        except TrainingError as e:  # the guard's stop (guard.max_recoveries spent): the run ends there, it is a result
            if not guard or "stability guard stopped" not in str(e):
                raise
            history, stopped = read_metrics(out / "run" / "metrics.jsonl"), str(e)
        record = {**run_record(history), "stopped_by_guard": stopped}
        harness.record(done, record)
        print(f"{name}: reward {record['reward'][0]:.3f} -> {record['reward'][-1]:.3f}, collapse step {record['collapse_step']}",
              flush=True)
        return record


def import_runs(earlier: dict[str, Any], work: Path, *, lr: float, beta: float, steps: int) -> list[str]:
    """``--resume-from``: write an earlier report's finished toy run records into ``work`` as finished runs (where
    ``work`` has none), after checking that it ran the same stress setting. Returns the run names taken."""
    stress = earlier.get("stress", {})
    if (stress.get("lr"), stress.get("beta"), earlier.get("steps")) != (lr, beta, steps):
        raise SystemExit(f"--resume-from: the earlier report ran lr {stress.get('lr')}, beta {stress.get('beta')}, "
                         f"{earlier.get('steps')} steps, not lr {lr}, beta {beta}, {steps} steps")
    records = {work / f"toy/{arm}_seed{seed}" / "history.json": record
               for arm, seeds in earlier.get("toy", {}).get("runs", {}).items() for seed, record in seeds.items()}
    return [str(path.parent.relative_to(work)) for path in harness.take_finished(records)]


def sweep_name(lr: float, beta: float, seed: int) -> str:
    return f"sweep/lr{lr:g}_beta{beta:g}_seed{seed}"


def parse_sweep_runs(text: str, grid: str = "protocol") -> list[tuple[float, float, int]]:
    """``LR:BETA:SEED,...`` -> the sweep runs (each must be a point of the pre-registered ``grid`` and a sweep seed)."""
    lrs, betas = GRIDS[grid]
    runs = []
    for item in filter(None, text.split(",")):
        lr, beta, seed = item.split(":")
        run = (float(lr), float(beta), int(seed))
        if run[0] not in lrs or run[1] not in betas or run[2] not in SWEEP_SEEDS:
            raise ValueError(f"{item} is not a run of the sweep grid {lrs} x {betas} x seeds {SWEEP_SEEDS}")
        runs.append(run)
    return runs


def choose_stress(runner: Runner, config: Path, base: list[str], grid: str = "protocol") -> tuple[float | None, float | None, list[dict[str, Any]]]:
    """The pre-registered sweep: GRPO over the ``grid``'s lrs x betas (lr ascending, beta descending), the first point
    where a sweep seed collapses (at step >= ``MIN_COLLAPSE_STEP[grid]`` where the grid sets one; else the last).
    (None, None, ...) when a run it needs is not finished (``--report-only``)."""
    sweep = []
    lrs, betas = GRIDS[grid]
    min_step = MIN_COLLAPSE_STEP.get(grid, 1)
    points = [(lr, beta) for lr in lrs for beta in betas]
    for lr, beta in points:
        records = [runner.run(sweep_name(lr, beta, seed), config, base, "grpo", seed, lr, beta) for seed in SWEEP_SEEDS]
        if any(r is None for r in records):
            sweep.append({"lr": lr, "beta": beta, "unfinished": True})
            return None, None, sweep
        collapsed = sum(r["collapse_step"] is not None and r["collapse_step"] >= min_step for r in records)
        sweep.append({"lr": lr, "beta": beta, "grpo_collapsed": collapsed, "seeds": list(SWEEP_SEEDS),
                      "collapse_steps": [r["collapse_step"] for r in records], "rewards": [r["reward"] for r in records]})
        if collapsed:
            return lr, beta, sweep
    return points[-1][0], points[-1][1], sweep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2 seeds x 3 steps on tiny-qwen2, no sweep, no SmolLM2 (a smoke run)")
    p.add_argument("--seeds", type=int, default=5, help="toy-task seeds per arm")
    p.add_argument("--smollm2-seeds", type=int, default=2, help="SmolLM2 seeds per arm (0: none; --quick: 1, on tiny-qwen2)")
    p.add_argument("--smollm2-only", action="store_true",
                   help="only the SmolLM2 arms (amendment 7), no toy task: --out default benchmarks/results/stability_smollm2.json")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--lr", type=float, default=None, help="skip the sweep: this lr (with --beta)")
    p.add_argument("--beta", type=float, default=None, help="skip the sweep: this KL coefficient (with --lr)")
    p.add_argument("--work", type=Path, default=None, help="run folders (kept; finished runs are reused)")
    p.add_argument("--out", type=Path, default=None, help="the JSON (default benchmarks/results/stability.json; --quick: in --work)")
    p.add_argument("--false-trips-from", type=Path, default=None,
                   help="replay every guard detector over the runs of this folder (<arm>-seed<N>/metrics.jsonl, e.g. "
                        "runs/learning_search; read only) and report each one's false-trip rate on the runs that did not collapse")
    p.add_argument("--replay-only", action="store_true",
                   help="with --false-trips-from: only the replay, no training (--out default "
                        "benchmarks/results/stability_false_trips.json)")
    p.add_argument("--arms", type=lambda x: x.split(","), default=[*ARMS, GUARDED],
                   help="comma-separated toy arms to run (default all; several processes can share one --work, each "
                        "running some arms, and a last run over all of them reuses every finished run)")
    p.add_argument("--retriever-url", default=None,
                   help="a running `emapg serve` of the toy index (topk 1) to use instead of starting one (processes "
                        "sharing --work can share one server: less memory)")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: the report from the runs already finished in --work (the others listed as not_run)")
    p.add_argument("--resume-from", type=Path, default=None,
                   help="an earlier report of this benchmark (e.g. the committed stability.json) at the same stress setting: its "
                        "finished toy runs (records) go into --work as finished, its sweep and false-trip replay are kept "
                        "(a lost work folder need not cost the runs again)")
    p.add_argument("--grid", choices=sorted(GRIDS), default="protocol",
                   help="the sweep grid: protocol (lr 1e-3, 3e-3, 1e-2 x beta 0.1, 0.001), slow (amendment 4: lr 1e-4, "
                        "2e-4, 4e-4 x beta 0.001), mid (amendment 5: lr 6e-4, 8e-4 x beta 0.001) or late (amendment 6: lr 4e-4, "
                        "6e-4 x beta 0.001, only a collapse at step >= 12 counts)")
    p.add_argument("--sweep-runs", default=None,
                   help="LR:BETA:SEED,...: only run these runs of the sweep grid into --work and exit (several processes "
                        "can split the grid; a later run without it applies the sweep's rule to the finished runs)")
    harness.add_arguments(p)
    args = p.parse_args(argv)
    if unknown := set(args.arms) - {*ARMS, GUARDED}:
        p.error(f"unknown arms {sorted(unknown)}")
    if args.sweep_runs is not None:
        try:
            args.sweep_runs = parse_sweep_runs(args.sweep_runs, args.grid)
        except ValueError as e:
            p.error(f"--sweep-runs: {e}")
    if args.replay_only:
        if args.false_trips_from is None:
            p.error("--replay-only needs --false-trips-from")
        replay = replay_false_trips(args.false_trips_from)
        print_false_trips(replay)
        out = args.out or RESULTS / "stability_false_trips.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(replay, indent=2))
        print(f"wrote {out}")
        return 0
    if (args.lr is None) != (args.beta is None):
        p.error("--lr and --beta go together")
    if args.quick:
        args.seeds, args.smollm2_seeds, args.steps = 2, min(args.smollm2_seeds, 1), 3
        args.lr, args.beta = args.lr or 1e-3, args.beta or 0.001
    work = args.work or Path(tempfile.mkdtemp(prefix="stability-"))
    default_out = "stability_smollm2.json" if args.smollm2_only else "stability.json"
    out = args.out or (work / default_out if args.quick else RESULTS / default_out)
    # the toy arms run several processes side by side on one thread each; the SmolLM2 arms one at a time
    harness.environment(OMP_NUM_THREADS=str(os.cpu_count() or 1) if args.smollm2_only else "1")
    provenance = (harness.provenance(__file__, also=ALSO) if args.report_only else
                  harness.start(__file__, quick=args.quick, allow_dirty=args.allow_dirty, also=ALSO))
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if args.smollm2_only:
        if not args.smollm2_seeds:
            p.error("--smollm2-only needs --smollm2-seeds > 0")
        work.mkdir(parents=True, exist_ok=True)
        report = {"date": harness.now(), "protocol": "studies/stability.py docstring, amendment 7", "quick": args.quick,
                  "machine": harness.machine(), "provenance": provenance,
                  "smollm2": smollm2(args, work)}
        write_smollm2(report, out)
        return 0
    from emapg.paths import CONFIG_DIR
    from retriever.launch import RetrieverServer
    from tests.fixtures.trainer import build_toy_task

    earlier = json.loads(args.resume_from.read_text()) if args.resume_from else None
    if earlier is not None:
        if args.lr is None:  # the earlier report's stress setting (its sweep was run then)
            args.lr, args.beta = earlier["stress"]["lr"], earlier["stress"]["beta"]
        taken = import_runs(earlier, work, lr=args.lr, beta=args.beta, steps=args.steps)
        print(f"taken from {args.resume_from}: {len(taken)} finished runs", flush=True)
    task = build_toy_task(work / "task")
    report: dict[str, Any] = {"date": harness.now(), "protocol": "studies/stability.py docstring", "quick": args.quick, "steps": args.steps,
                              "machine": harness.machine(), "provenance": provenance}
    runner = Runner(work, steps=args.steps, prompts=4 if args.quick else 8, samples=4, probe=4 if args.quick else 8,
                    train_missing=not args.report_only)
    toy_config = CONFIG_DIR / "search_tiny_cpu.yaml"
    toy_runs: dict[str, dict[int, dict[str, Any]]] = {arm: {} for arm in [*ARMS, GUARDED] if arm in args.arms}
    # a long health wait: on a shared CPU several benchmark processes starting at once starve the servers' first answer
    serving = (contextlib.nullcontext() if args.report_only or args.retriever_url else
               RetrieverServer(task.index_dir, omp_num_threads=1, device="cpu", topk=1, startup_timeout=900))
    with serving as server:
        base: list[str] = []
        if not args.report_only:
            base = toy_base(task, args.retriever_url or server.url, work)
        if args.sweep_runs:  # only these sweep runs (processes sharing --work split the grid; the rule is applied later)
            for lr, beta, seed in args.sweep_runs:
                runner.run(sweep_name(lr, beta, seed), toy_config, base, "grpo", seed, lr, beta)
            return 0
        if args.lr is None:
            args.lr, args.beta, report["sweep"] = choose_stress(runner, toy_config, base, args.grid)
            if args.lr is None:
                print(f"the sweep is not finished in {work}: {runner.missing}")
                return 1
        if earlier is not None and "sweep" in earlier and "sweep" not in report:
            report["sweep"] = earlier["sweep"]
        report["stress"] = {"lr": args.lr, "beta": args.beta, "steps": args.steps,
                            "chosen_by": "argument" if "sweep" not in report else f"sweep ({args.grid} grid)"}
        for seed in range(args.seeds):
            for arm in toy_runs:
                record = runner.run(f"toy/{arm}_seed{seed}", toy_config, base, arm, seed, args.lr, args.beta)
                if record is not None:
                    toy_runs[arm][seed] = record
    # complete: every toy run and the SmolLM2 arms (the protocol's second task) finished
    report["complete"] = not runner.missing and args.smollm2_seeds > 0
    if runner.missing:
        report["not_run"] = runner.missing
    report["toy"] = {"runs": toy_runs, **summarise(toy_runs)}
    if args.smollm2_seeds:
        report["smollm2"] = smollm2(args, work)
        report["complete"] = report["complete"] and report["smollm2"].get("complete", False)
    else:
        report["smollm2"] = "not run (--smollm2-seeds 0)"
    # the contract: the toy task's estimates at the top level (SmolLM2's beside them under "smollm2")
    report.update({k: v for k, v in report["toy"].items() if k != "runs"})
    replay = None
    if args.false_trips_from is not None:  # the healthy runs of another benchmark (the false-trip target)
        replay = replay_false_trips(args.false_trips_from)
    elif earlier is not None and "false_trips_replay" in earlier:  # the earlier report's replay (its folder may be gone)
        replay = earlier["false_trips_replay"]
    if replay is not None:
        report["false_trips_replay"] = replay
        by_name = {s["name"]: s for s in replay["training_arms"]["signals"]}
        for s in report["signals"]:
            s["false_trip_rate_replayed"] = by_name[s["name"]]["false_trip_rate"]
    out.parent.mkdir(parents=True, exist_ok=True)
    png = plot(toy_runs, out.with_suffix(".png"), f"toy search task, lr {args.lr:g}, beta {args.beta:g}, {args.steps} steps")
    out.write_text(json.dumps(report, indent=2))
    for arm in toy_runs:
        a = report[arm]
        if not a["seeds"]:
            continue
        print(f"{arm:12s} collapsed {a['collapsed']}/{len(a['seeds'])} = {a['collapse_rate']:.2f} "
              f"[{a['collapse_rate_ci'][0]:.2f}, {a['collapse_rate_ci'][1]:.2f}]")
    for s in report["signals"]:
        print(f"  {s['name']:18s} median lead {s['median_lead_steps']}, false trips {s['false_trip_rate']}")
    if isinstance(report["smollm2"], dict):
        print_smollm2(report["smollm2"])
    print(f"wrote {out} and {png}")
    return 0


def smollm2_settings(quick: bool) -> dict[str, Any]:
    """The SmolLM2 arms' setting (amendment 7); ``quick``: the same code path on tiny-qwen2 (a smoke run)."""
    from emapg.models import STARTER
    from emapg.paths import CONFIG_DIR

    if quick:
        return {"policy": "tiny-qwen2", "config": CONFIG_DIR / "search_tiny_cpu.yaml", "index_limit": 2000, "engine": "hf",
                "protocol": {"max_tokens": 24, "max_turns": 2}, "reader_limit": 1, "samples": SMOLLM2_SAMPLES,
                "lr": 1e-3, "beta": SMOLLM2_BETA, "steps": 2, "probe": 2, "arms": ("grpo", "emapg"),
                "extra": ["logging.tensorboard=false", "run.precision=bf16"]}
    return {"policy": STARTER, "config": CONFIG_DIR / "demo_search_smollm2.yaml", "index_limit": None, "engine": "vllm",
            "protocol": {}, "reader_limit": None, "samples": SMOLLM2_SAMPLES, "lr": SMOLLM2_LR, "beta": SMOLLM2_BETA,
            "steps": SMOLLM2_STEPS, "probe": 8, "arms": SMOLLM2_ARMS, "extra": []}


def smollm2(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The SmolLM2 arms (amendment 7): the shipped starter on the answerable training pool through the bundled index,
    one shared engine server for training and scoring; each run's end checkpoint scored on the reader slice (greedy
    and sampled mean@2 EM) against the starter's scoring of the same questions. ``--report-only``: the finished runs
    in ``work`` only."""
    from studies.distill import evaluate

    s = smollm2_settings(args.quick)
    folder = work / "smollm2"
    smol = Runner(work, steps=s["steps"], prompts=4, samples=4, probe=s["probe"], train_missing=not args.report_only)
    runs: dict[str, dict[int, dict[str, Any]]] = {arm: {} for arm in s["arms"]}
    starter_file = folder / "starter.json"
    missing: list[str] = []

    def scored(model: str, out: Path) -> dict[str, dict[str, float]]:
        greedy = evaluate(model, out / "greedy", url, engine_url, s, sampled=False, temperature=1.0)
        sampled = evaluate(model, out / "sampled", url, engine_url, s, sampled=True, temperature=1.0)
        return {"greedy_em": per_question([greedy]), "sampled_em": per_question([sampled])}

    with contextlib.ExitStack() as stack:
        url = engine_url = ""
        base: list[str] = []
        if not args.report_only:
            from emapg.config import load_config
            from trainer.config import TrainConfig

            r = load_config(TrainConfig, s["config"], []).rollout
            served = stack.enter_context(harness.servers(
                s["policy"], engine=s["engine"], index_limit=s["index_limit"],
                max_model_len=r.max_prompt_tokens + r.max_response_tokens, folder=folder))
            url, engine_url = served.retriever_url, served.engine_url
            # groups of equal rewards are trained (topup), not dropped: every signal and the reward are over all
            # sampled trajectories
            base = [f"model.policy={s['policy']}", "data.train=qa_pool", "data.split=train", f"retriever.urls=[{url}]",
                    "retriever.index_dir=null", "rollout.engine=remote", f"rollout.engine_urls=[{engine_url}]",
                    "rollout.uniform_groups=topup", *s["extra"]]
            if not starter_file.is_file():
                starter_file.write_text(json.dumps(scored(s["policy"], folder / "starter")))
                print(f"smollm2 starter: {summary_line(json.loads(starter_file.read_text()))}", flush=True)
        if not starter_file.is_file():
            return {"not_run": "the starter was not scored in this work folder"}
        starter = json.loads(starter_file.read_text())
        for arm, seed in harness.seeds_first(s["arms"], range(args.smollm2_seeds)):  # interrupted: every arm at the same seeds
            name = f"smollm2/{arm}_seed{seed}"
            record = smol.run(name, s["config"], base, arm, seed, s["lr"], s["beta"])
            if record is not None and "heldout" not in record:
                if args.report_only:
                    record = None
                else:  # scored, then the checkpoint goes (a crash in between scores it again)
                    from trainer.checkpoint import step_dir_name

                    ckpt = work / name / "run" / step_dir_name(s["steps"])
                    record["heldout"] = scored(str(ckpt / "policy"), work / name / "end")
                    harness.record(work / name / "history.json", record)
                    shutil.rmtree(ckpt, ignore_errors=True)
                    print(f"{name}: {summary_line(record['heldout'])}", flush=True)
            if record is None:
                missing.append(name)
            else:
                runs[arm][seed] = record
    out = {"stress": {"lr": s["lr"], "beta": s["beta"], "steps": s["steps"], "chosen_by": "amendment 7 (the issue's one-seed lead)"},
           "policy": s["policy"], "heldout_set": "reader slice (data/qa/reader_slice.json)",
           "scoring": f"greedy EM and sampled mean@{s['samples']} EM at T = 1.0, top_p 1.0, sampling seed 1",
           "complete": not missing, "runs": runs, **summarise(runs), "heldout": heldout_change(starter, runs)}
    if missing:
        out["not_run"] = missing
    return out


def write_smollm2(report: dict[str, Any], out: Path) -> None:
    """``--smollm2-only``: the report, its plot (reward and signals per arm and seed) and a printed summary."""
    s = report["smollm2"]
    out.parent.mkdir(parents=True, exist_ok=True)
    if "runs" in s and any(s["runs"].values()):
        st = s["stress"]
        report["plot"] = str(plot(s["runs"], out.with_suffix(".png"),
                                  f"SmolLM2 search task, lr {st['lr']:g}, beta {st['beta']:g}, {st['steps']} steps").name)
    out.write_text(json.dumps(report, indent=2))
    print_smollm2(s)
    print(f"wrote {out}")


def print_smollm2(s: dict[str, Any]) -> None:
    if "heldout" not in s:
        print(f"SmolLM2 arms: {s.get('not_run', 'not run')}")
        return
    h = s["heldout"]
    print(f"SmolLM2 arms ({h['questions']} held-out questions; starter greedy {h['start']['greedy_em']:.1f}, "
          f"sampled {h['start']['sampled_em']:.1f}):")
    for arm in s["runs"]:
        if arm not in h:
            continue
        a, c = h[arm], s[arm]
        parts = [f"{kind} {a[kind + '_end']:.1f} ({a[kind + '_end_minus_start']['mean']:+.1f} "
                 f"[{a[kind + '_end_minus_start']['low']:+.1f}, {a[kind + '_end_minus_start']['high']:+.1f}])"
                 for kind in ("greedy_em", "sampled_em")]
        print(f"  {arm:12s} collapsed {c['collapsed']}/{len(c['seeds'])}; " + "; ".join(parts))


def summary_line(scores: dict[str, dict[str, float]]) -> str:
    return ", ".join(f"{k} {100 * sum(v.values()) / len(v):.1f}" for k, v in scores.items())


def heldout_change(starter: dict[str, dict[str, float]], runs: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Per arm and scoring (``greedy_em``, ``sampled_em``): the end score (per question averaged over seeds), end -
    start with a paired bootstrap interval over questions (pooled and per seed), and arm - GRPO at the end on the
    seeds both finished."""
    out: dict[str, Any] = {"questions": len(starter["greedy_em"]), "start": {k: pct(v) for k, v in starter.items()}}
    for arm, by_seed in runs.items():
        if not by_seed:
            continue
        a: dict[str, Any] = {"seeds": sorted(by_seed)}
        for kind in starter:
            end = seed_mean([r["heldout"][kind] for r in by_seed.values()])
            a[f"{kind}_end"] = pct(end)
            a[f"{kind}_end_minus_start"] = difference(starter[kind], end)
            seed_level = seed_difference([starter[kind]], [r["heldout"][kind] for r in by_seed.values()])
            a[f"{kind}_end_minus_start_seed_ci"] = [seed_level["low"], seed_level["high"]]
            a[f"{kind}_end_minus_start_per_seed"] = {seed: difference(starter[kind], r["heldout"][kind])
                                                     for seed, r in sorted(by_seed.items())}
            common = sorted(set(by_seed) & set(runs.get("grpo", {})))
            if arm != "grpo" and common:
                a[f"{kind}_minus_grpo"] = difference(seed_mean([runs["grpo"][x]["heldout"][kind] for x in common]),
                                                     seed_mean([by_seed[x]["heldout"][kind] for x in common]))
                a[f"{kind}_minus_grpo"]["seeds"] = common
        out[arm] = a
    return out

if __name__ == "__main__":
    sys.exit(main())
