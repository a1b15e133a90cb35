"""Images and videos in: the front end's media loading and per-model processing, the
features that travel to the engine core, and the scheduler's encoder cache accounting.

Device-neutral and torch-free at import (the scheduler imports the cache accounting);
tensors are packed as raw bytes (:class:`~engine.multimodal.inputs.PackedTensor`), never
pickled.
"""

from engine.multimodal.inputs import MultiModalFeature, PackedTensor

__all__ = ["MultiModalFeature", "PackedTensor"]
