"""What the planner reads: the device catalogue (``devices.yaml``) and a model's architecture (its ``config.json``).

Nothing here loads weights or imports torch: a model's shape comes from its folder's ``config.json`` (an alias is
resolved to its folder first), or, for the hub models the shipped presets name, from ``architectures.yaml``
(copied from their config.json, with the source), so the planner answers offline for a 3B preset in well under
a second once the config is loaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from emapg.errors import ConfigError, UserError

HERE = Path(__file__).resolve().parent
DEVICES_FILE = HERE / "devices.yaml"
ARCHITECTURES_FILE = HERE / "architectures.yaml"

#: ``model.lora.target_modules`` names -> (input features, output features) as functions of the shape.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Device:
    """One accelerator (or this CPU) as the planner sees it: capacities and the assumed achievable fractions."""

    key: str
    name: str
    memory_bytes: int
    bf16_flops: float  # peak of the compute dtype the trainer uses there (fp32 on a CPU)
    memory_bandwidth: float
    interconnect_bandwidth: float
    internode_bandwidth: float
    sync_bandwidth: float
    update_fraction: float
    prefill_fraction: float
    decode_fraction: float
    decode_step_latency: float
    fragmentation: float
    usable_fraction: float
    price_per_hour: float
    is_cpu: bool = False
    sources: list[str] = field(default_factory=list)
    #: seconds per decoder layer per decode step beyond its arithmetic and weight reads (an eager forward's per-op
    #: dispatch: ~50 ops a layer); 0 where the catalogue does not state it
    decode_layer_latency: float = 0.0
    #: share of peak FLOP/s the decode step's arithmetic reaches (2·N per concurrent sequence: skinny matmuls);
    #: None: prefill_fraction
    decode_flops_fraction: float | None = None

    @property
    def usable_bytes(self) -> int:
        return int(self.memory_bytes * self.usable_fraction)

    @property
    def compute_bytes(self) -> int:
        """Bytes per activation element: fp32 on a CPU, bf16 autocast on a GPU."""
        return 4 if self.is_cpu else 2


def _catalogue() -> dict[str, dict[str, Any]]:
    return yaml.safe_load(DEVICES_FILE.read_text())["devices"]


def device_names() -> list[str]:
    return list(_catalogue())


def _cpu_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """The ``cpu`` entry's machine-dependent numbers, read from this machine."""
    threads = int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count() or 1
    ghz, per_cycle = entry["cpu_ghz"], entry["flops_per_cycle"]
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        mhz = [float(line.split(":")[1]) for line in lines if line.startswith("cpu MHz")]
        ghz = max(mhz) / 1000 if mhz else ghz
        if any(line.startswith("flags") and " avx512f" in line for line in lines):
            per_cycle = entry["flops_per_cycle_avx512"]
    except OSError:
        pass
    memory = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                memory = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {**entry, "memory_bytes": memory or 8 * 2**30, "bf16_flops": threads * ghz * 1e9 * per_cycle}


def get_device(name: str) -> Device:
    """The catalogue entry ``name`` (a key of ``devices.yaml``); a readable error naming the choices."""
    cat = _catalogue()
    key = name.lower()
    if key not in cat:
        raise UserError(f"--device: unknown device {name!r}; choose from {', '.join(cat)} (trainer/plan/devices.yaml)")
    entry = _cpu_entry(cat[key]) if key == "cpu" else cat[key]
    fields = {f: entry[f] for f in ("name", "memory_bytes", "bf16_flops", "memory_bandwidth", "interconnect_bandwidth",
                                    "internode_bandwidth", "sync_bandwidth", "update_fraction", "prefill_fraction",
                                    "decode_fraction", "decode_step_latency", "fragmentation", "usable_fraction", "price_per_hour")}
    optional = {k: float(entry[k]) for k in ("decode_layer_latency", "decode_flops_fraction") if entry.get(k) is not None}
    return Device(key=key, is_cpu=key == "cpu", sources=list(entry.get("sources", [])), **optional,
                  **{k: (int(v) if k == "memory_bytes" else float(v) if k != "name" else v) for k, v in fields.items()})


def local_device() -> Device:
    """The device ``emapg train`` will run on: this CPU, or the CUDA GPU with its real total memory (a catalogue
    entry matched by name, else the nearest by memory)."""
    import torch

    if not torch.cuda.is_available():
        return get_device("cpu")
    props = torch.cuda.get_device_properties(0)
    names = device_names()
    key = next((k for k in names if k != "cpu" and k.split("-")[0] in props.name.lower().replace(" ", "")), None)
    gpus = [get_device(k) for k in names if k != "cpu"]
    base = get_device(key) if key else min(gpus, key=lambda g: abs(g.memory_bytes - props.total_memory))
    return replace(base, memory_bytes=int(props.total_memory), name=props.name)


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape (Qwen2/Llama family), from its ``config.json``."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections have biases (Qwen2: yes; Llama: no)
    max_position_embeddings: int | None = None
    source: str = ""
    explicit_head_dim: int | None = None  # config.json's head_dim, where it says

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection: kv heads x head dim."""
        return self.num_key_value_heads * self.head_dim

    @property
    def q_size(self) -> int:
        """Width of the query projection (and the input of o_proj): heads x head dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h, kv, i, q = self.hidden_size, self.kv_size, self.intermediate_size, self.q_size
        attention = 2 * h * q + 2 * h * kv + ((q + 2 * kv) if self.attention_bias else 0)
        return attention + 3 * h * i + 2 * h  # + the two RMSNorm weights

    @property
    def float_buffers(self) -> int:
        """Floating-point buffer values (the rotary embedding's ``inv_freq`` and ``original_inv_freq``, head_dim / 2
        each), which the EMA anchor blends with the parameters."""
        return self.head_dim

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def params(self) -> int:
        """Every parameter, a tied lm_head counted once."""
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.embedding_params + head + self.num_hidden_layers * self.layer_params + self.hidden_size

    @property
    def body_matmul_params(self) -> int:
        """Parameters of the decoder layers (what every token of a pass multiplies by; the lm_head is separate)."""
        return self.num_hidden_layers * self.layer_params

    @property
    def recomputed_layer_params(self) -> int:
        """Parameters a checkpointed layer's recompute multiplies by: all but ``down_proj``, whose output saves
        nothing for the backward (torch's non-reentrant checkpoint stops at the last saved tensor, its input)."""
        return self.layer_params - self.intermediate_size * self.hidden_size

    @property
    def matmul_params(self) -> int:
        """Parameters a token multiplies by in a forward (the lm_head, not the embedding lookup): N of 2·N FLOPs."""
        return self.num_hidden_layers * self.layer_params + self.embedding_params

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """Adapter parameters: rank·(in + out) per targeted linear layer (``all-linear``: every one of a block)."""
        h, kv, i, q = self.hidden_size, self.kv_size, self.intermediate_size, self.q_size
        dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        names = LORA_MODULES if "all-linear" in targets else [n for n in LORA_MODULES if any(n.endswith(t) for t in targets)]
        return self.num_hidden_layers * sum(rank * sum(dims[n]) for n in names)


def _shape_from(config: dict[str, Any], source: str) -> ModelShape:
    text = config.get("text_config") or config
    try:
        return ModelShape(
            hidden_size=int(text["hidden_size"]), intermediate_size=int(text["intermediate_size"]),
            num_hidden_layers=int(text["num_hidden_layers"]), num_attention_heads=int(text["num_attention_heads"]),
            num_key_value_heads=int(text.get("num_key_value_heads") or text["num_attention_heads"]),
            vocab_size=int(text["vocab_size"]), tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            attention_bias=bool(text.get("attention_bias", text.get("model_type", config.get("model_type")) == "qwen2")),
            max_position_embeddings=text.get("max_position_embeddings"), source=source,
            explicit_head_dim=text.get("head_dim"),
        )
    except KeyError as e:
        raise ConfigError(f"model.policy: {source} has no {e.args[0]} (the planner reads decoder-only transformer configs)") from None


def model_shape(name: str, *, option: str = "model.policy") -> ModelShape:
    """The shape of ``name``: a folder's (or an alias's) ``config.json``, else a shipped preset's hub model from
    ``architectures.yaml``; never the weights."""
    known = yaml.safe_load(ARCHITECTURES_FILE.read_text())["architectures"]
    for key, entry in known.items():
        if key.lower() == name.lower():
            return _shape_from(entry, entry["source"])
    from emapg.models import resolve_model

    folder = Path(resolve_model(name, option=option))
    config = folder / "config.json"
    if not config.is_file():  # a LoRA checkpoint's adapter folder names its base
        adapter = folder / "adapter_config.json"
        if adapter.is_file():
            return model_shape(json.loads(adapter.read_text())["base_model_name_or_path"], option=option)
        raise ConfigError(f"{option}: {folder} has no config.json")
    return _shape_from(json.loads(config.read_text()), str(config))
