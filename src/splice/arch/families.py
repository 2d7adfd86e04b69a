"""One record per architecture family. Adding a family = adding a record here + a parity test.

Each record's comment names the DeepSpeed injection container (``deepspeed/module_inject/containers``) the family
corresponds to, where DeepSpeed has one.
"""
from __future__ import annotations

from dataclasses import replace

from .record import ArchRecord

LLAMA = ArchRecord(model_type="llama")  # DS_LLAMAContainer

MISTRAL = ArchRecord(model_type="mistral", sliding_window=True)

QWEN2 = ArchRecord(model_type="qwen2", sliding_window=True)  # q/k/v biases come from the checkpoint

QWEN3 = ArchRecord(model_type="qwen3", sliding_window=True, q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")

# rotary on the first partial_rotary_factor of each head
PHI3 = ArchRecord(model_type="phi3", qkv="self_attn.qkv_proj", gate_up="mlp.gate_up_proj", sliding_window=True,
                 partial_rotary=True)

# Mixtures of experts (no DeepSpeed container; DeepSpeed's AutoTP lists Mixtral and Qwen2-MoE): each family's
# attention fused as its dense relative's, the layer's MLP module (router and experts; Qwen2-MoE's shared expert and
# dense layers) called as it is
MIXTRAL = replace(MISTRAL, model_type="mixtral", moe="mlp")

QWEN2_MOE = replace(QWEN2, model_type="qwen2_moe", moe="mlp")

QWEN3_MOE = replace(QWEN3, model_type="qwen3_moe", moe="mlp")

# use_bidirectional_attention (embedding Gemmas) attends to later tokens, which a causal block with a KV cache cannot
BIDIRECTIONAL = ("use_bidirectional_attention", True)

GEMMA = ArchRecord(model_type="gemma", norm_offset=1.0, embed_scale=True, refuse=(BIDIRECTIONAL,))

# DS_GPTNEOXContainer: per-head [q k v], partial rotary, sequential or parallel residual with two norms
GPT_NEOX = ArchRecord(
    model_type="gpt_neox", layers="gpt_neox.layers", embed="gpt_neox.embed_in", final_norm="gpt_neox.final_layer_norm",
    qkv="attention.query_key_value", qkv_layout="grouped", o="attention.dense", gated=False,
    up="mlp.dense_h_to_4h", down="mlp.dense_4h_to_h", norm="layer", eps_key="layer_norm_eps",
    parallel=("use_parallel_residual",), partial_rotary=True)

# DS_GPT2Container: HF Conv1D linears, learned absolute positions
GPT2 = ArchRecord(
    model_type="gpt2", layers="transformer.h", embed="transformer.wte", position_embed="transformer.wpe",
    final_norm="transformer.ln_f", qkv="attn.c_attn", o="attn.c_proj", gated=False, up="mlp.c_fc",
    down="mlp.c_proj", norm="layer", attn_norm="ln_1", mlp_norm="ln_2", eps_key="layer_norm_epsilon",
    positions="learned", activation_key="activation_function", refuse=(("add_cross_attention", True),),
    hf_args=("cache", "attention_mask", "encoder_hidden_states"))

# DS_OPTContainer: learned positions at offset 2, pre- or post-norm, word_embed_proj_dim projections
OPT = ArchRecord(
    model_type="opt", layers="model.decoder.layers", embed="model.decoder.embed_tokens",
    position_embed="model.decoder.embed_positions", position_offset=2, final_norm="model.decoder.final_layer_norm",
    project_in="model.decoder.project_in", project_out="model.decoder.project_out", o="self_attn.out_proj",
    gated=False, up="fc1", down="fc2", norm="layer", attn_norm="self_attn_layer_norm", mlp_norm="final_layer_norm",
    norm_before="do_layer_norm_before", positions="learned", activation_key="activation_function")

# (no DeepSpeed container; phi-2) parallel attention and MLP from one LayerNorm, partial rotary
PHI = ArchRecord(
    model_type="phi", final_norm="model.final_layernorm", o="self_attn.dense", gated=False, up="mlp.fc1",
    down="mlp.fc2", norm="layer", mlp_norm=None, parallel=True, eps_key="layer_norm_eps",
    partial_rotary=True, refuse=(("qk_layernorm", True),))

# DS_GPTJContainer: parallel residual from one norm, interleaved (every-two) partial rotary
GPTJ = ArchRecord(
    model_type="gptj", layers="transformer.h", embed="transformer.wte", final_norm="transformer.ln_f",
    q="attn.q_proj", k="attn.k_proj", v="attn.v_proj", o="attn.out_proj", gated=False, up="mlp.fc_in",
    down="mlp.fc_out", norm="layer", attn_norm="ln_1", mlp_norm=None, parallel=True, rotary_interleaved=True,
    rotary_dim_key="rotary_dim", eps_key="layer_norm_epsilon", activation_key="activation_function")

# (DeepSpeed injects Falcon through AutoTP only) multi-query, per-head, or grouped (new_decoder_architecture) qkv;
# one or two norms in parallel, or sequential; rotary or ALiBi (its bias rounded to bf16 as Hugging Face builds it)
FALCON = ArchRecord(
    model_type="falcon", layers="transformer.h", embed="transformer.word_embeddings", final_norm="transformer.ln_f",
    qkv="self_attention.query_key_value", qkv_layout="grouped", o="self_attention.dense", gated=False,
    up="mlp.dense_h_to_4h", down="mlp.dense_4h_to_h", norm="layer", attn_norm="ln_attn|input_layernorm",
    mlp_norm="ln_mlp|post_attention_layernorm", parallel=("parallel_attn", "new_decoder_architecture"),
    eps_key="layer_norm_epsilon", activation_key="activation", alibi_key="alibi", alibi_scaled=True,
    alibi_bf16=True, hf_returns_tuple=True, hf_alibi_in_mask=True)

# DS_BloomContainer: per-head [q k v], ALiBi, a LayerNorm on the embeddings
BLOOM = ArchRecord(
    model_type="bloom", layers="transformer.h", embed="transformer.word_embeddings",
    embed_norm="transformer.word_embeddings_layernorm", final_norm="transformer.ln_f",
    qkv="self_attention.query_key_value", qkv_layout="grouped", o="self_attention.dense", gated=False,
    up="mlp.dense_h_to_4h", down="mlp.dense_4h_to_h", norm="layer", eps_key="layer_norm_epsilon", positions="alibi",
    activation="gelu_pytorch_tanh", refuse=(("apply_residual_connection_post_layernorm", True),),
    hf_returns_tuple=True)

# (no DeepSpeed container) sandwich norms, logit soft-capping, sliding / global layers
GEMMA2 = ArchRecord(
    model_type="gemma2", activation_key="hidden_activation", norm_offset=1.0, embed_scale=True, sliding_window=True,
    mlp_norm="pre_feedforward_layernorm", attn_out_norm="post_attention_layernorm",
    mlp_out_norm="post_feedforward_layernorm", refuse=(BIDIRECTIONAL,))

# (no DeepSpeed container) Gemma 2's layout plus qk-norm and a rotary base per layer type; Hugging Face's Gemma 3
# attention never applies attn_logit_softcapping (the final logits do take final_logit_softcapping)
GEMMA3_TEXT = ArchRecord(
    model_type="gemma3_text", activation_key="hidden_activation", norm_offset=1.0, embed_scale=True,
    sliding_window=True, mlp_norm="pre_feedforward_layernorm", attn_out_norm="post_attention_layernorm",
    mlp_out_norm="post_feedforward_layernorm", q_norm="self_attn.q_norm", k_norm="self_attn.k_norm",
    attn_softcap_key=None, refuse=(BIDIRECTIONAL,))

# the language model of Gemma 3's multimodal model (images go through Hugging Face's generate on the fused blocks)
GEMMA3 = replace(GEMMA3_TEXT, model_type="gemma3", layers="model.language_model.layers",
                 embed="model.language_model.embed_tokens", final_norm="model.language_model.norm")

# DS_GPTNEOContainer: learned positions, unscaled scores, global and local (sliding-window) layers
GPT_NEO = ArchRecord(
    model_type="gpt_neo", layers="transformer.h", embed="transformer.wte", position_embed="transformer.wpe",
    final_norm="transformer.ln_f", q="attn.attention.q_proj", k="attn.attention.k_proj", v="attn.attention.v_proj",
    o="attn.attention.out_proj", gated=False, up="mlp.c_fc", down="mlp.c_proj", norm="layer", attn_norm="ln_1",
    mlp_norm="ln_2", eps_key="layer_norm_epsilon", positions="learned", activation_key="activation_function",
    attn_scale=1.0, sliding_window=True, window_key="window_size", layer_types_key="attention_layers",
    window_layer_type="local", hf_returns_tuple=True, hf_window_in_mask=False)

# (no DeepSpeed container; StarCoder) multi-query [q; k; v] or per-head [q k v] (one KV group either way), learned
# positions
GPT_BIGCODE = ArchRecord(
    model_type="gpt_bigcode", layers="transformer.h", embed="transformer.wte", position_embed="transformer.wpe",
    final_norm="transformer.ln_f", qkv="attn.c_attn", qkv_layout="grouped", o="attn.c_proj", gated=False,
    up="mlp.c_fc", down="mlp.c_proj", norm="layer", attn_norm="ln_1", mlp_norm="ln_2", eps_key="layer_norm_epsilon",
    positions="learned", activation_key="activation_function", refuse=(("add_cross_attention", True),),
    hf_args=("encoder_hidden_states",))

# HFBertLayerPolicy: an encoder (bidirectional, post-norm, plain GELU MLP); embeddings (learned positions and token
# types), pooler and heads stay the model's own. A decoder BERT (causal, cross-attention) is refused.
BERT = ArchRecord(
    model_type="bert", encoder=True, layers="encoder.layer", embed="embeddings.word_embeddings", final_norm=None,
    lm_head=None, q="attention.self.query", k="attention.self.key", v="attention.self.value",
    o="attention.output.dense", gated=False, up="intermediate.dense", down="output.dense", norm="layer",
    attn_norm="attention.output.LayerNorm", mlp_norm="output.LayerNorm", eps_key="layer_norm_eps", norm_before=False,
    positions="none", refuse=(("is_decoder", True), ("add_cross_attention", True)),
    hf_args=("attention_mask", "encoder_hidden_states"))

# HFBertLayerPolicy (RoBERTa's layers are BERT's; its embeddings count positions from the padding index)
ROBERTA = replace(BERT, model_type="roberta")

# HFDistilBertLayerPolicy: BERT's layout under other names
DISTILBERT = ArchRecord(
    model_type="distilbert", encoder=True, layers="transformer.layer", embed="embeddings.word_embeddings",
    final_norm=None, lm_head=None, q="attention.q_lin", k="attention.k_lin", v="attention.v_lin",
    o="attention.out_lin", gated=False, up="ffn.lin1", down="ffn.lin2", norm="layer", attn_norm="sa_layer_norm",
    mlp_norm="output_layer_norm", norm_before=False, positions="none", activation_key="activation",
    hf_args=("attention_mask",))

# (no DeepSpeed container) OLMo: norms without weights (the model's own LayerNorm modules), q, k and v clamped,
# rotary computed in float32
OLMO = ArchRecord(model_type="olmo", norm="layer", clip_qkv_key="clip_qkv", rotary_float=True,
                  rotary_tables_float=True)

# (no DeepSpeed container) OLMo 2: no norm before the attention or the MLP, a norm on each branch's output (scaling in
# float32), q and k each normalised over its whole projection, rotary computed in float32
OLMO2 = ArchRecord(model_type="olmo2", attn_norm=None, mlp_norm=None, attn_out_norm="post_attention_layernorm",
                   mlp_out_norm="post_feedforward_layernorm", norm_scale_float=True, q_norm="self_attn.q_norm",
                   k_norm="self_attn.k_norm", qk_norm_width="projection", rotary_float=True,
                   rotary_tables_float=True)

# (no DeepSpeed container) OLMo 3: OLMo 2's layout with sliding-window and full-attention layers
OLMO3 = replace(OLMO2, model_type="olmo3", sliding_window=True)

# (no DeepSpeed container) OLMoE: pre-norm, q and k normalised over their whole projections, q, k and v clamped, a
# mixture of experts
OLMOE = ArchRecord(model_type="olmoe", q_norm="self_attn.q_norm", k_norm="self_attn.k_norm",
                   qk_norm_width="projection", clip_qkv_key="clip_qkv", moe="mlp")

# (no DeepSpeed container) StarCoder 2: LayerNorms, biased projections, a plain MLP (c_fc, c_proj), sliding window
STARCODER2 = ArchRecord(model_type="starcoder2", norm="layer", eps_key="norm_epsilon", gated=False, up="mlp.c_fc",
                        down="mlp.c_proj", sliding_window=True)

# (no DeepSpeed container) StableLM: LayerNorms, partial rotary, a parallel residual from one norm where the config
# says so; its per-head qk LayerNorms (one module a head) are refused
STABLELM = ArchRecord(model_type="stablelm", norm="layer", eps_key="layer_norm_eps", partial_rotary=True,
                      parallel=("use_parallel_residual",), refuse=(("qk_layernorm", True),))

# (no DeepSpeed container) Granite: Llama's layout with multipliers on the embeddings, the scores and the branch
# outputs, and the logits divided; Granite MoE: that with its layer's own mixture of experts
GRANITE = ArchRecord(model_type="granite", embed_multiplier_key="embedding_multiplier",
                     residual_multiplier_key="residual_multiplier", attn_scale_key="attention_multiplier",
                     logits_divisor_key="logits_scaling")
GRANITE_MOE = replace(GRANITE, model_type="granitemoe", moe="block_sparse_moe")

# (no DeepSpeed container) Cohere (Command R): attention and MLP in parallel from one LayerNorm (the model's own, in
# float32, without bias), every-two rotary computed in float32 from tables in the model's dtype, the logits scaled;
# its qk-norm (a weight row a head) is refused
COHERE = ArchRecord(model_type="cohere", norm="layer", eps_key="layer_norm_eps", mlp_norm=None, parallel=True,
                    rotary_interleaved=True, rotary_float=True, logits_multiplier_key="logit_scale",
                    refuse=(("use_qk_norm", True),))

# (no DeepSpeed container) Cohere 2 (Command R7B): Cohere's block, sliding-window layers that rotate and
# full-attention layers without positions
COHERE2 = replace(COHERE, model_type="cohere2", sliding_window=True, rotary_layer_type="sliding_attention", refuse=())

# (no DeepSpeed container) GPT-OSS: attention sinks, q/k/v/o biases, RMSNorms scaling in float32, sliding-window and
# full layers, cos and sin for half of each head from HF, its own mixture of experts (biased experts, gate and up
# interleaved, a clamped gate), which returns its router scores beside its output
GPT_OSS = ArchRecord(model_type="gpt_oss", moe="mlp", sinks="self_attn.sinks", norm_scale_float=True,
                     sliding_window=True, hf_rotary_halves=True)

RECORDS: tuple[ArchRecord, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, PHI3, GEMMA, GPT_NEOX, GPT2, OPT, PHI, GPTJ, FALCON,
                                   BLOOM, GEMMA2, GEMMA3_TEXT, GEMMA3, GPT_NEO, GPT_BIGCODE, BERT, ROBERTA, DISTILBERT,
                                   MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMO, OLMO2, OLMO3, OLMOE, STARCODER2, STABLELM,
                                   GRANITE, GRANITE_MOE, COHERE, COHERE2, GPT_OSS)
