"""Model directories shipped inside the package: the demo model, its draft twin and its
EAGLE-1 draft head."""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
DEMO_MODEL_NAME = "engine-demo"
DEMO_MODEL_DIR = ASSETS_DIR / "demo"
DEMO_DRAFT_MODEL_DIR = ASSETS_DIR / "demo-draft"
DEMO_EAGLE_MODEL_DIR = ASSETS_DIR / "demo-eagle"


def demo_model_path() -> str:
    """Path of the embedded demo model; a clear error if this install lacks it."""
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the embedded demo model is missing from {DEMO_MODEL_DIR}; "
            "pass a model directory explicitly (--model DIR)"
        )
    return str(DEMO_MODEL_DIR)
