"""Tiny Hugging Face ``transformers`` models with random weights, for tests and examples.

``build_hf_model(name)`` makes GPT-2 (``GPT2LMHeadModel``), BERT (``BertForMaskedLM``) or Llama
(``LlamaForCausalLM``) from a small config: hidden 64, 4 heads, vocab 128, dropout 0 (so a
microbatched step computes what one full-batch step does), no key/value cache. ``hf_batch(name)``
is a keyword batch (``input_ids``, ``attention_mask``, ``labels``) whose labels ignore some
positions (``-100``), so microbatches hold different numbers of labelled tokens and the loss must
be put back together weighted by them.

``OTHER_HF_MODELS`` are architectures unlike those three, built the same way: Qwen2 (grouped-query
attention, 4 query heads over 2 key/value heads), GPT-NeoX (parallel residual, partial rotary),
T5 (``T5ForConditionalGeneration``: encoder-decoder, relative position bias; its batch has
``labels`` half as long as ``input_ids``, the decoder's inputs made from them) and ViT
(``ViTForImageClassification``: ``pixel_values`` of 48x48 images in 4x4 patches, one class label
per image, the first few ignored), Mixtral (a mixture of experts: 4 experts, each token routed to
the top 2 of them, so which weights a token meets depends on its values) and Gemma 2 (attention
over a sliding window on every other layer, soft-capped logits, a norm after each sublayer too).

``transformers`` is imported when a model is built: it is a test extra, not a dependency.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["HF_MODELS", "NUM_LAYERS", "OTHER_HF_MODELS", "build_hf_model", "hf_batch", "padded_batches"]

HF_MODELS = ("gpt2", "bert", "llama")
OTHER_HF_MODELS = ("qwen2", "gpt_neox", "t5", "vit", "mixtral", "gemma2")
# 2 blocks over 64 positions: activations, not weights, dominate eager's peak, so a quarter of it
# fits (with 4 microbatches) although one block holds ~40% of the weights.
NUM_LAYERS = 2
VOCAB, HIDDEN, HEADS, POSITIONS = 128, 64, 4, 64
BATCH, SEQ = 8, 64
IGNORE_INDEX = -100
IMAGE, PATCH, CLASSES = 48, 4, 3


def build_hf_model(name: str, seed: int = 0, num_layers: int = NUM_LAYERS) -> nn.Module:
    """A fresh, seeded model in training mode."""
    import transformers

    torch.manual_seed(seed)
    if name == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=POSITIONS, n_embd=HIDDEN, n_layer=num_layers, n_head=HEADS,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    elif name == "bert":
        config = transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=num_layers, num_attention_heads=HEADS,
            intermediate_size=2 * HIDDEN, max_position_embeddings=POSITIONS, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)
        model = transformers.BertForMaskedLM(config)
    elif name == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=num_layers,
            num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=POSITIONS,
            attention_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=None)
        model = transformers.LlamaForCausalLM(config)
    elif name == "qwen2":
        config = transformers.Qwen2Config(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=num_layers,
            num_attention_heads=HEADS, num_key_value_heads=HEADS // 2, max_position_embeddings=POSITIONS,
            attention_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=None)
        model = transformers.Qwen2ForCausalLM(config)
    elif name == "gpt_neox":
        config = transformers.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=num_layers,
            num_attention_heads=HEADS, max_position_embeddings=POSITIONS, hidden_dropout=0.0, attention_dropout=0.0,
            use_parallel_residual=True, use_cache=False, bos_token_id=0, eos_token_id=0)
        model = transformers.GPTNeoXForCausalLM(config)
    elif name == "t5":
        config = transformers.T5Config(
            vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=2 * HIDDEN, num_layers=num_layers,
            num_heads=HEADS, dropout_rate=0.0, use_cache=False, decoder_start_token_id=0, pad_token_id=0,
            eos_token_id=1)
        model = transformers.T5ForConditionalGeneration(config)
    elif name == "mixtral":
        config = transformers.MixtralConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=HIDDEN // 2, num_hidden_layers=num_layers,
            num_attention_heads=HEADS, num_key_value_heads=HEADS // 2, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=POSITIONS, attention_dropout=0.0, use_cache=False, bos_token_id=0,
            eos_token_id=0, pad_token_id=None)
        model = transformers.MixtralForCausalLM(config)
    elif name == "gemma2":
        config = transformers.Gemma2Config(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=num_layers,
            num_attention_heads=HEADS, num_key_value_heads=HEADS // 2, head_dim=HIDDEN // HEADS,
            max_position_embeddings=POSITIONS, sliding_window=16, attention_dropout=0.0, use_cache=False,
            bos_token_id=0, eos_token_id=0, pad_token_id=None)
        model = transformers.Gemma2ForCausalLM(config)
    elif name == "vit":
        config = transformers.ViTConfig(
            image_size=IMAGE, patch_size=PATCH, hidden_size=HIDDEN, num_hidden_layers=num_layers,
            num_attention_heads=HEADS, intermediate_size=2 * HIDDEN, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, num_labels=CLASSES)
        model = transformers.ViTForImageClassification(config)
    else:
        raise ValueError(f"unknown Hugging Face test model {name!r}; choose one of {HF_MODELS + OTHER_HF_MODELS}")
    return model.train()


def hf_batch(name: str, seed: int = 1, batch: int = BATCH, seq: int = SEQ) -> dict[str, torch.Tensor]:
    """Keyword inputs with labels; ``name`` picks the labelling (masked LM, causal LM, a target
    sequence for T5, a class per image for ViT)."""
    generator = torch.Generator().manual_seed(seed)
    if name == "vit":
        labels = torch.randint(0, CLASSES, (batch,), generator=generator)
        labels[:batch // 4 + 1] = IGNORE_INDEX  # the first microbatches hold fewer labelled images
        return {"pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=generator), "labels": labels}
    input_ids = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    if name == "t5":
        # the target half as long as the source, its tail ignored by a different amount per sample
        labels = torch.randint(0, VOCAB, (batch, seq // 2), generator=generator)
        for row in range(batch):
            labels[row, seq // 2 - 2 * row:] = IGNORE_INDEX
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    if name == "bert":
        # masked LM: about a quarter of the positions carry a label, the rest are ignored
        labelled = torch.rand(batch, seq, generator=generator) < 0.25
        labels = torch.where(labelled, input_ids, IGNORE_INDEX)
    else:
        # causal LM: the tail of each sequence is ignored, as padding would be, by a different amount per sample
        labels = input_ids.clone()
        for row in range(batch):
            labels[row, seq - 3 * row:] = IGNORE_INDEX
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def padded_batches(lengths: list[list[int]], seed: int = 2, pad_to_multiple_of: int | None = None):
    """Batches as a DataLoader with ``transformers.DataCollatorWithPadding`` makes them: each padded
    to its longest sequence (so each batch has another length), ``labels`` the input ids with the
    padding ignored. ``lengths``: each batch's sequence lengths. The tokenizer is built in memory
    (a word-level vocabulary of ``VOCAB`` ids, ``[PAD]`` = 0): nothing is downloaded."""
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")), pad_token="[PAD]", unk_token="[UNK]")
    collate = transformers.DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of)
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for batch_lengths in lengths:
        features = [{"input_ids": torch.randint(2, VOCAB, (n,), generator=generator).tolist()} for n in batch_lengths]
        batch = dict(collate(features))
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        batches.append(batch)
    return batches
