"""Deterministic "scripted" policies: real tiny Qwen2 models whose weights encode a behaviour.

The tiny random Qwen2 emits noise, which never exercises the search loop. A scripted
model is the same architecture with an untied ``lm_head``, its attention and MLP outputs
zeroed (so the final hidden state depends only on the current token) and an ``lm_head``
built so that decoding follows a bigram chain, e.g. ``\n -> < -> search -> > -> capital
-> of -> France -> </ -> search -> >``. Every turn starts after a newline (the chat
template's ``assistant\n``, an observation's ``\n\n``, the corrective message), so a
searcher emits its search on every turn and an answerer answers at once. The scripted
token leads by ~30 nats, so even sampling at T=1 follows the script.

These are real models run by the real engines (vLLM and transformers), used by the tests
(tests/fixtures/agent.py) and by benchmarks/rollout_throughput.py; a forward pass costs
exactly what it costs for any model of the same shape.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

SEARCH_SCRIPT = "<search> capital of France </search>"
ANSWER_SCRIPT = "<answer> Paris </answer>"


def _atomic_save(out: Path, write) -> Path:
    """Write a model folder via a temp folder + rename: never a half-written model in a cache."""
    out = Path(out)
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        write(tmp)
        try:
            os.replace(tmp, out)
        except OSError:  # a concurrent builder won; its folder is identical
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def build_untied_tiny(out: Path, tiny_dir: Path, seed: int = 1, edit_tokenizer: Callable[[Any], None] | None = None) -> Path:
    """The tiny Qwen2 (``tiny_dir``'s exact config) with an untied lm_head, so lm_head can be scripted.

    ``edit_tokenizer(tok)``, when given, changes the tokenizer first (added tokens, a chat template); the
    vocabulary then grows to the tokenizer's size (agent/scripted_tools.py)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, Qwen2ForCausalLM

    def write(tmp: Path) -> None:
        tok = AutoTokenizer.from_pretrained(tiny_dir)
        config = AutoConfig.from_pretrained(tiny_dir)
        if edit_tokenizer is not None:
            edit_tokenizer(tok)
            config.vocab_size = len(tok)
        config.tie_word_embeddings = False
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

    return _atomic_save(out, write)


def scripted_state_dict(model_dir: Path, script: str, gap: float = 30.0, starts: tuple[str, ...] = ("\n",)) -> dict:
    """State dict of ``model_dir``'s model turned into a bigram follower of ``starts[0] + script`` (and of each other
    start + script: what a turn may follow, e.g. a template's generation prompt and its tool-result close)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if model.config.tie_word_embeddings:
        raise ValueError("a scripted model needs an untied lm_head (see build_untied_tiny)")
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    pairs: dict[int, int] = {}
    for start in starts:
        chain = tok(start + script, add_special_tokens=False)["input_ids"]
        for x, y in zip(chain[:-1], chain[1:]):
            if pairs.setdefault(x, y) != y:
                raise ValueError(f"token {x} has two successors in {script!r}: not a bigram chain")
    for name in sd:
        if name.endswith("self_attn.o_proj.weight") or name.endswith("mlp.down_proj.weight"):
            sd[name].zero_()
    emb = sd["model.embed_tokens.weight"]
    eps = model.config.rms_norm_eps
    hidden = emb / emb.pow(2).mean(-1, keepdim=True).add(eps).sqrt() * sd["model.norm.weight"]
    head = torch.zeros_like(sd["lm_head.weight"])
    for x, y in pairs.items():
        head[y] += gap * hidden[x] / hidden[x].pow(2).sum()
    sd["lm_head.weight"] = head
    return sd


def save_scripted(src: Path, out: Path, script: str, starts: tuple[str, ...] = ("\n",)) -> Path:
    """Save ``src`` with weights scripted to emit ``script`` after every newline (or each of ``starts``), as an HF folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def write(tmp: Path) -> None:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        model.load_state_dict(scripted_state_dict(src, script, starts=starts))
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(src).save_pretrained(tmp)

    return _atomic_save(out, write)
