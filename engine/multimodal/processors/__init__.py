"""Per-family multimodal processors (see engine.multimodal.processing)."""
