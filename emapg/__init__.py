"""ema-pg: RL for LLM search agents and math reasoners with EMA-PG (arXiv 2602.04417)."""

__version__ = "0.1.0"
