"""More Hugging Face architectures, tiny and with random weights: the breadth check of models
nobody here wrote (``tests/test_hf_architectures.py``), beside ``hf_models``' deeper tests.

``ARCHITECTURES`` maps a name to (config class, model class, config arguments, kind of batch):
causal LMs (Mistral, Gemma, Gemma 2, Phi, Phi-3, BLOOM's ALiBi, OPT, GPT-Neo's local attention,
GPT-J, Falcon, Mixtral's experts, Qwen3, GPT-BigCode's one key-value head, Cohere, Qwen2-MoE's
shared experts, DeepSeek-V3's latent attention and grouped routing, Mamba's selective scan,
XLNet's relative attention, PhiMoE's sparse mixer (an autograd Function with its own backward,
drawing random numbers), Gemma 3, Jamba's attention and Mamba layers, Mamba-2, OLMo 2, GPT-OSS's
experts with biases and attention sinks, Llama 4's chunked attention and experts run on every
token), masked LMs (ModernBERT's alternating local attention,
DistilBERT, RoBERTa, ALBERT's one shared layer, ELECTRA, DeBERTa-v2's relative attention, Funnel's
pooling, BigBird and FNet's Fourier mixing, both with a pooler the loss does not use),
encoder-decoders (BART, UMT5, Whisper on log-mel features), image classifiers (ResNet with
BatchNorm, ConvNeXt, Swin's shifted windows, BEiT's relative position bias, MobileViT's convolutions
with BatchNorm, DINOv2), Wav2Vec2 on raw audio (weight-normed convolutions) and CLIP's vision tower. Dropout is 0
everywhere, so a step computes what eager's does (``build_architecture(defaults=True)``: transformers'
own dropout, as users build them). ``transformers`` is imported when a model is built: it is a test
extra.
"""
from __future__ import annotations

import re

import torch
from torch import nn

__all__ = ["ARCHITECTURES", "build_architecture", "architecture_batch", "architecture_loss"]

_V, _H, _L, _NH, _I, _P = 96, 32, 3, 4, 64, 64
_NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
_DECODER = dict(vocab_size=_V, hidden_size=_H, intermediate_size=_I, num_hidden_layers=_L, num_attention_heads=_NH,
                max_position_embeddings=_P, use_cache=False)

ARCHITECTURES: dict[str, tuple[str, str, dict, str]] = {
    "bart": ("BartConfig", "BartForConditionalGeneration", dict(
        vocab_size=_V, d_model=_H, encoder_layers=2, decoder_layers=2, encoder_attention_heads=_NH,
        decoder_attention_heads=_NH, encoder_ffn_dim=_I, decoder_ffn_dim=_I, max_position_embeddings=_P, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
        use_cache=False), "seq2seq"),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_DECODER, num_key_value_heads=2, sliding_window=8), "lm"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_DECODER, num_key_value_heads=2, head_dim=8), "lm"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_DECODER, num_key_value_heads=2, head_dim=8,
                                                         sliding_window=8), "lm"),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(_DECODER, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
            "lm"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_DECODER, pad_token_id=0, bos_token_id=1, eos_token_id=2), "lm"),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=_V, hidden_size=_H, n_layer=_L, n_head=_NH,
                                                       use_cache=False, hidden_dropout=0.0, attention_dropout=0.0), "lm"),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(
        vocab_size=_V, hidden_size=_H, ffn_dim=_I, num_hidden_layers=_L, num_attention_heads=_NH,
        max_position_embeddings=_P, use_cache=False, dropout=0.0, attention_dropout=0.0, word_embed_proj_dim=_H), "lm"),
    "gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM", dict(
        vocab_size=_V, hidden_size=_H, num_layers=2, num_heads=_NH, attention_types=[[["global", "local"], 1]],
        max_position_embeddings=_P, window_size=8, use_cache=False, resid_dropout=0.0, embed_dropout=0.0,
        attention_dropout=0.0, bos_token_id=0, eos_token_id=0), "lm"),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(
        vocab_size=_V, n_embd=_H, n_layer=_L, n_head=_NH, rotary_dim=4, n_positions=_P, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0), "lm"),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(
        vocab_size=_V, hidden_size=_H, num_hidden_layers=_L, num_attention_heads=_NH, use_cache=False,
        hidden_dropout=0.0, attention_dropout=0.0), "lm"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        _DECODER, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.0), "lm"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_DECODER, num_key_value_heads=2, head_dim=8), "lm"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(_DECODER, num_key_value_heads=2), "lm"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        _DECODER, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=8), "lm"),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        _DECODER, num_key_value_heads=2, head_dim=8, num_local_experts=4, intermediate_size_mlp=64,
        interleave_moe_layer_step=2), "lm"),
    "modernbert": ("ModernBertConfig", "ModernBertForMaskedLM", dict(
        vocab_size=_V, hidden_size=_H, intermediate_size=_I, num_hidden_layers=_L, num_attention_heads=_NH,
        max_position_embeddings=_P, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
        sep_token_id=2), "mlm"),
    "distilbert": ("DistilBertConfig", "DistilBertForMaskedLM", dict(
        vocab_size=_V, dim=_H, n_layers=_L, n_heads=_NH, hidden_dim=_I, max_position_embeddings=_P, dropout=0.0,
        attention_dropout=0.0), "mlm"),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", dict(
        vocab_size=_V, hidden_size=_H, num_hidden_layers=_L, num_attention_heads=_NH, intermediate_size=_I,
        max_position_embeddings=_P + 2, **_NO_DROPOUT), "mlm"),
    "albert": ("AlbertConfig", "AlbertForMaskedLM", dict(
        vocab_size=_V, embedding_size=16, hidden_size=_H, num_hidden_layers=_L, num_attention_heads=_NH,
        intermediate_size=_I, max_position_embeddings=_P, **_NO_DROPOUT), "mlm"),
    "electra": ("ElectraConfig", "ElectraForMaskedLM", dict(
        vocab_size=_V, embedding_size=16, hidden_size=_H, num_hidden_layers=_L, num_attention_heads=_NH,
        intermediate_size=_I, max_position_embeddings=_P, **_NO_DROPOUT), "mlm"),
    "deberta_v2": ("DebertaV2Config", "DebertaV2ForMaskedLM", dict(
        vocab_size=_V, hidden_size=_H, num_hidden_layers=_L, num_attention_heads=_NH, intermediate_size=_I,
        max_position_embeddings=_P, **_NO_DROPOUT), "mlm"),
    "resnet": ("ResNetConfig", "ResNetForImageClassification", dict(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=5), "image"),
    "convnext": ("ConvNextConfig", "ConvNextForImageClassification", dict(
        num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=5, drop_path_rate=0.0), "image"),
    "swin": ("SwinConfig", "SwinForImageClassification", dict(
        image_size=32, patch_size=4, num_channels=3, embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=4,
        num_labels=5, drop_path_rate=0.0, **_NO_DROPOUT), "image"),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(
        vocab_size=_V, n_embd=_H, n_layer=_L, n_head=_NH, n_positions=_P, multi_query=True, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "lm"),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(_DECODER, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                                                         eos_token_id=2), "lm"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        _DECODER, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, router_aux_loss_coef=0.0), "lm"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        _DECODER, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, head_dim=4), "lm"),
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(vocab_size=_V, hidden_size=_H, state_size=4, num_hidden_layers=2,
                                                      use_cache=False, expand=2, conv_kernel=4), "lm"),
    "xlnet": ("XLNetConfig", "XLNetLMHeadModel", dict(vocab_size=_V, d_model=_H, n_layer=_L, n_head=_NH, d_inner=_I,
                                                      dropout=0.0, use_mems_train=False, mem_len=None), "lm"),
    "funnel": ("FunnelConfig", "FunnelForMaskedLM", dict(
        vocab_size=_V, d_model=_H, n_head=_NH, d_head=8, d_inner=_I, block_sizes=[1, 1], hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0), "mlm"),
    "whisper": ("WhisperConfig", "WhisperForConditionalGeneration", dict(
        vocab_size=_V, num_mel_bins=8, d_model=_H, encoder_layers=2, decoder_layers=2, encoder_attention_heads=_NH,
        decoder_attention_heads=_NH, encoder_ffn_dim=_I, decoder_ffn_dim=_I, max_source_positions=16,
        max_target_positions=_P, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, use_cache=False,
        pad_token_id=0, decoder_start_token_id=1, bos_token_id=1, eos_token_id=2), "speech"),
    "beit": ("BeitConfig", "BeitForImageClassification", dict(
        hidden_size=_H, num_hidden_layers=2, num_attention_heads=_NH, intermediate_size=_I, image_size=32, patch_size=8,
        num_labels=5, use_relative_position_bias=True, drop_path_rate=0.0, **_NO_DROPOUT), "image"),
    "mobilevit": ("MobileViTConfig", "MobileViTForImageClassification", dict(
        image_size=32, patch_size=2, hidden_sizes=[16, 16, 16], neck_hidden_sizes=[8, 8, 16, 16, 16, 32, 32],
        num_attention_heads=2, num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0), "image"),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", dict(
        _DECODER, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.0), "lm"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(_DECODER, num_key_value_heads=2, head_dim=8,
                                                             sliding_window=8), "lm"),
    "jamba": ("JambaConfig", "JambaForCausalLM", dict(
        _DECODER, num_hidden_layers=2, num_key_value_heads=2, num_experts=2, num_experts_per_tok=1, attn_layer_period=2,
        attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False, router_aux_loss_coef=0.0), "lm"),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(
        vocab_size=_V, hidden_size=_H, state_size=4, num_hidden_layers=2, use_cache=False, expand=2, conv_kernel=4,
        num_heads=8, head_dim=8, n_groups=1, chunk_size=8), "lm"),
    "big_bird": ("BigBirdConfig", "BigBirdForMaskedLM", dict(
        vocab_size=_V, hidden_size=_H, num_hidden_layers=2, num_attention_heads=_NH, intermediate_size=_I,
        max_position_embeddings=_P, attention_type="original_full", **_NO_DROPOUT), "mlm"),
    "fnet": ("FNetConfig", "FNetForMaskedLM", dict(
        vocab_size=_V, hidden_size=_H, num_hidden_layers=2, intermediate_size=_I, max_position_embeddings=_P,
        hidden_dropout_prob=0.0), "mlm"),
    "umt5": ("UMT5Config", "UMT5ForConditionalGeneration", dict(
        vocab_size=_V, d_model=_H, d_kv=8, d_ff=_I, num_layers=2, num_heads=_NH, dropout_rate=0.0, use_cache=False,
        decoder_start_token_id=0, pad_token_id=0), "seq2seq"),
    "dinov2": ("Dinov2Config", "Dinov2ForImageClassification", dict(
        hidden_size=_H, num_hidden_layers=2, num_attention_heads=_NH, mlp_ratio=2, image_size=32, patch_size=8,
        num_labels=5, drop_path_rate=0.0, **_NO_DROPOUT), "image"),
    "wav2vec2": ("Wav2Vec2Config", "Wav2Vec2ForSequenceClassification", dict(
        hidden_size=_H, num_hidden_layers=2, num_attention_heads=_NH, intermediate_size=_I, conv_dim=(8, 8),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
        num_labels=5, hidden_dropout=0.0, activation_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=0.0,
        layerdrop=0.0, mask_time_prob=0.0, classifier_proj_size=8), "audio"),
    "clip_vision": ("CLIPVisionConfig", "CLIPVisionModelWithProjection", dict(
        hidden_size=_H, intermediate_size=_I, num_hidden_layers=_L, num_attention_heads=_NH, image_size=32,
        patch_size=8, projection_dim=16), "vision"),
}


# the arguments whose transformers default a user gets: dropout, layer drop, stochastic depth,
# SpecAugment's time masks, the key/value cache
_LEFT_TO_DEFAULTS = re.compile(r"dropout|pdrop|layerdrop|drop_path|mask_time_prob|use_cache")


def build_architecture(name: str, seed: int = 0, defaults: bool = False) -> nn.Module:
    """A fresh, seeded model of ``name`` in training mode. ``defaults``: with transformers' own
    dropout, layer drop, stochastic depth, time masking and ``use_cache`` (as a user builds it; only
    the sizes tiny), where the zoo turns each off."""
    import transformers

    config_class, model_class, arguments, _ = ARCHITECTURES[name]
    if defaults:
        arguments = {key: value for key, value in arguments.items() if not _LEFT_TO_DEFAULTS.search(key)}
    torch.manual_seed(seed)
    return getattr(transformers, model_class)(getattr(transformers, config_class)(**arguments)).train()


def architecture_batch(name: str, seed: int = 1, batch: int = 4, seq: int = 16) -> dict[str, torch.Tensor]:
    """Keyword inputs for ``name``'s kind: token ids with labels (the ids again for a language model,
    another sequence for BART), log-mel features with a transcript (Whisper), a waveform with a
    class (Wav2Vec2), or 32x32 images (with a class each for a classifier)."""
    generator = torch.Generator().manual_seed(seed)
    kind = ARCHITECTURES[name][3]
    if kind == "audio":  # 400 samples of raw waveform, and a class each
        return {"input_values": torch.randn(batch, 400, generator=generator),
                "labels": torch.randint(0, 5, (batch,), generator=generator)}
    if kind == "speech":  # log-mel features of 32 frames, and 8 tokens of transcript each
        return {"input_features": torch.randn(batch, 8, 32, generator=generator),
                "labels": torch.randint(3, _V, (batch, 8), generator=generator)}
    if kind in ("image", "vision"):
        images = {"pixel_values": torch.randn(batch, 3, 32, 32, generator=generator)}
        return {**images, "labels": torch.randint(0, 5, (batch,), generator=generator)} if kind == "image" else images
    ids = torch.randint(3, _V, (batch, seq), generator=generator)
    labels = torch.randint(3, _V, (batch, seq), generator=generator) if kind == "seq2seq" else ids.clone()
    return {"input_ids": ids, "labels": labels}


def architecture_loss(name: str, output) -> torch.Tensor:
    """The model's own loss; for CLIP's vision tower (no labels) the square of its image embeddings."""
    return output.image_embeds.square().mean() if ARCHITECTURES[name][3] == "vision" else output.loss
