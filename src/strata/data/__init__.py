"""Files shipped with the package: the default model, the synth tokenizer and the default chat
template."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

DEFAULT_MODEL_NAME = "default-model.gguf"


def default_model_path() -> Path | None:
    """The packaged default model (`tools/train_default_model.py`), or None if this install
    lacks it."""
    ref = resources.files("strata.data").joinpath(DEFAULT_MODEL_NAME)
    return Path(str(ref)) if ref.is_file() else None
