"""KV connectors (KV cache in from / out to other engine instances or storage) and the
disaggregated prefill/decode proxy."""
