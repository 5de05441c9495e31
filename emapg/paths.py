"""Where things live: the repository's bundled data and the user cache."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "data"
CONFIG_DIR = REPO_ROOT / "configs"
#: The bundled passage corpus (Search-R1 format: ``{"id", "contents": '"Title"\\ntext', "source"}``).
BUNDLED_CORPUS = DATA_DIR / "corpus" / "wiki_mini.jsonl.gz"
#: The bundled corpus's MiniLM passage vectors, 8-bit (retriever.vector_file; scripts/build_bundled_vectors.py).
BUNDLED_VECTORS = DATA_DIR / "corpus" / "wiki_mini.minilm-uint8.npz"


def cache_dir() -> Path:
    """Cache for converted models and built indexes: ``$EMAPG_CACHE`` or ``~/.cache/emapg``."""
    path = Path(os.environ.get("EMAPG_CACHE", Path.home() / ".cache" / "emapg"))
    path.mkdir(parents=True, exist_ok=True)
    return path
