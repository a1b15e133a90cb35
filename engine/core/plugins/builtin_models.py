"""The built-in model architectures, contributed through the same plugin hook a third
party's architectures use (entry point ``models`` of the ``engine.plugins`` group).

Registered as ``"module:Class"`` strings so that resolving one model never imports the
others, and discovering the plugins imports no model code (nor torch: a core process's
OpenMP settings must be in place before torch loads). It lives beside the registry for that
reason: ``engine.model_executor.models`` imports torch.
"""

from __future__ import annotations

from typing import Any

from engine.core.interfaces import PLUGIN_API_VERSION
from engine.core.plugins.hookspecs import hookimpl

BUILTINS = {
    "LlamaForCausalLM": "engine.model_executor.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "engine.model_executor.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "engine.model_executor.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "engine.model_executor.models.qwen3:Qwen3ForCausalLM",
    "MixtralForCausalLM": "engine.model_executor.models.mixtral:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "engine.model_executor.models.mixtral:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "engine.model_executor.models.mixtral:Qwen3MoeForCausalLM",
    "MambaForCausalLM": "engine.model_executor.models.mamba:MambaForCausalLM",
    "JambaForCausalLM": "engine.model_executor.models.jamba:JambaForCausalLM",
    "DeepseekV3ForCausalLM": "engine.model_executor.models.deepseek_v3:DeepseekV3ForCausalLM",
    "Phi3ForCausalLM": "engine.model_executor.models.phi3:Phi3ForCausalLM",
    "Olmo2ForCausalLM": "engine.model_executor.models.olmo2:Olmo2ForCausalLM",
    "GraniteForCausalLM": "engine.model_executor.models.granite:GraniteForCausalLM",
    "SmolLM3ForCausalLM": "engine.model_executor.models.smollm3:SmolLM3ForCausalLM",
    "Glm4ForCausalLM": "engine.model_executor.models.glm4:Glm4ForCausalLM",
    "Ernie4_5ForCausalLM": "engine.model_executor.models.ernie45:Ernie4_5ForCausalLM",
    "GptOssForCausalLM": "engine.model_executor.models.gpt_oss:GptOssForCausalLM",
    "GemmaForCausalLM": "engine.model_executor.models.gemma:GemmaForCausalLM",
    "Gemma2ForCausalLM": "engine.model_executor.models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "engine.model_executor.models.gemma:Gemma3ForCausalLM",
    "Cohere2ForCausalLM": "engine.model_executor.models.cohere2:Cohere2ForCausalLM",
    "Mamba2ForCausalLM": "engine.model_executor.models.mamba2:Mamba2ForCausalLM",
    "BambaForCausalLM": "engine.model_executor.models.bamba:BambaForCausalLM",
    "Qwen3NextForCausalLM": "engine.model_executor.models.qwen3_next:Qwen3NextForCausalLM",
    "FalconH1ForCausalLM": "engine.model_executor.models.falcon_h1:FalconH1ForCausalLM",
    "NemotronHForCausalLM": "engine.model_executor.models.nemotron_h:NemotronHForCausalLM",
    "GraniteMoeHybridForCausalLM":
        "engine.model_executor.models.granitemoehybrid:GraniteMoeHybridForCausalLM",
    "EagleLlamaForCausalLM": "engine.model_executor.models.eagle_llama:EagleLlamaForCausalLM",
    "LlamaForCausalLMEagle": "engine.model_executor.models.eagle_llama:EagleLlamaForCausalLM",
    "EAGLEModel": "engine.model_executor.models.eagle_llama:EagleLlamaForCausalLM",
    # Vision-language models (images / videos in; engine.multimodal processes them).
    "LlavaForConditionalGeneration": "engine.model_executor.models.llava:LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration":
        "engine.model_executor.models.llava:LlavaNextForConditionalGeneration",
    "Qwen2VLForConditionalGeneration":
        "engine.model_executor.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration":
        "engine.model_executor.models.qwen2_vl:Qwen2_5_VLForConditionalGeneration",
    "Gemma3ForConditionalGeneration":
        "engine.model_executor.models.gemma3_mm:Gemma3ForConditionalGeneration",
    # Decoders that only pool (engine.model_executor.models.adapters).
    "LlamaModel": "engine.model_executor.models.adapters:LlamaModel",
    "MistralModel": "engine.model_executor.models.adapters:MistralModel",
    "Qwen2Model": "engine.model_executor.models.adapters:Qwen2Model",
    "Qwen3Model": "engine.model_executor.models.adapters:Qwen3Model",
    "LlamaForSequenceClassification":
        "engine.model_executor.models.adapters:LlamaForSequenceClassification",
    "MistralForSequenceClassification":
        "engine.model_executor.models.adapters:MistralForSequenceClassification",
    "Qwen2ForSequenceClassification":
        "engine.model_executor.models.adapters:Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification":
        "engine.model_executor.models.adapters:Qwen3ForSequenceClassification",
    # Encoders for pooling (engine.model_executor.models.bert / modernbert / nomic_bert).
    "BertModel": "engine.model_executor.models.bert:BertModel",
    "BertForSequenceClassification":
        "engine.model_executor.models.bert:BertForSequenceClassification",
    "RobertaModel": "engine.model_executor.models.bert:RobertaModel",
    "RobertaForSequenceClassification":
        "engine.model_executor.models.bert:RobertaForSequenceClassification",
    "XLMRobertaModel": "engine.model_executor.models.bert:XLMRobertaModel",
    "XLMRobertaForSequenceClassification":
        "engine.model_executor.models.bert:XLMRobertaForSequenceClassification",
    "ModernBertModel": "engine.model_executor.models.modernbert:ModernBertModel",
    "ModernBertForSequenceClassification":
        "engine.model_executor.models.modernbert:ModernBertForSequenceClassification",
    "NomicBertModel": "engine.model_executor.models.nomic_bert:NomicBertModel",
    "NomicBertForSequenceClassification":
        "engine.model_executor.models.nomic_bert:NomicBertForSequenceClassification",
}


@hookimpl
def engine_plugin_api_version() -> int:
    return PLUGIN_API_VERSION  # in-tree: evolves with the engine


@hookimpl
def engine_register_models(registry: Any) -> None:
    for architecture, path in BUILTINS.items():
        registry.register(architecture, path)
