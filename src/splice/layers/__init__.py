"""splice's layers: the generic fused block, static KV cache, norms, rotary, packed linears, the native causal LM."""
