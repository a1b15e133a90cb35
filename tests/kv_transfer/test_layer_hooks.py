"""A connector that asks for per-layer hooks gets wait_for_layer_load before, and
save_kv_layer after, every layer's attention of every step (the forward then runs
eagerly), with the layer's own cache tensor."""

from __future__ import annotations

from engine import LLM, SamplingParams
from engine.kv_transfer import factory
from engine.kv_transfer.shared_storage import SharedStorageConnector


class LayerwiseConnector(SharedStorageConnector):
    name = "LayerwiseTest"
    uses_layer_hooks = True
    calls: list[tuple[str, int]] = []

    def register_kv_caches(self, kv_caches, layout):
        super().register_kv_caches(kv_caches, layout)
        type(self).caches = list(kv_caches)

    def wait_for_layer_load(self, layer_index):
        self.calls.append(("load", layer_index))

    def save_kv_layer(self, layer_index, kv_cache, attn_metadata):
        assert kv_cache is type(self).caches[layer_index]
        self.calls.append(("save", layer_index))


def test_layer_hooks_run_around_every_attention(model_dir_factory, tmp_path, monkeypatch):
    known = factory.connector_classes()
    monkeypatch.setattr(factory, "connector_classes",
                        lambda: {**known, LayerwiseConnector.name: LayerwiseConnector})
    path = model_dir_factory("llama-gqa")  # 2 layers
    config = {"kv_connector": "LayerwiseTest", "kv_role": "kv_both",
              "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")}}
    LayerwiseConnector.calls = []
    with LLM(str(path), dtype="float32", max_model_len=128, kv_transfer_config=config) as llm:
        llm.generate({"prompt_token_ids": [5, 6, 7, 8]},
                     SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert llm.llm_engine.client.core.executor.runner.decode_graphs is None
    steps = 3  # the prompt, then two decode steps (the last token is never forwarded)
    assert LayerwiseConnector.calls == [("load", 0), ("save", 0), ("load", 1), ("save", 1)] * steps
