"""Tiny random checkpoints in the *official* directory formats of LLaDA-8B-Instruct and Dream-v0-Instruct-7B.

Written independently of dlm_engine's model code: config.json with the official field names (plus the
fields the official files carry that the architecture ignores, and their ``auto_map`` to remote code that
must never be needed), safetensors with the official parameter names and shapes, and a small
``tokenizer.json`` built offline with the ``tokenizers`` library holding the families' special tokens and
chat templates in ``tokenizer_config.json``. Special-token ids are scaled down; their names are the real ones.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

CHARS = [chr(c) for c in range(32, 127)] + ["\n"]

LLADA_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|mdm_mask|>"]
LLADA_CHAT = ("{% set loop_messages = messages %}{% for message in loop_messages %}"
              "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
              "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
              "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

DREAM_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|beginoftext|>", "<|mask|>"]
DREAM_CHAT = ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
              "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
              "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _tokenizer(directory: Path, specials, config: dict) -> dict:
    """A character-level tokenizer.json (specials after the characters) + tokenizer_config.json."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(CHARS)}
    unk = "\x00"
    vocab[unk] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    core.save(str(directory / "tokenizer.json"))
    ids = {t: core.token_to_id(t) for t in specials}
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for t, i in ids.items()}
    (directory / "tokenizer_config.json").write_text(json.dumps(dict(config, added_tokens_decoder=added), indent=1))
    return ids


def _save(directory: Path, cfg: dict, shapes: dict, seed: int, scale: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight") or name.endswith("ln_f.weight") or "_norm." in name:
            tensors[name] = torch.ones(shape)
        else:
            tensors[name] = torch.randn(shape, generator=g) * scale
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))


def build_llada_instruct(directory, d_model=32, n_heads=4, n_layers=2, mlp=64, seed=0) -> dict:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ids = _tokenizer(d, LLADA_SPECIALS, {
        "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "chat_template": LLADA_CHAT, "clean_up_tokenization_spaces": False, "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast"})
    V = len(CHARS) + 1 + len(LLADA_SPECIALS)
    cfg = {
        "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
        "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM",
                     "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"},
        "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": d_model,
        "embedding_dropout": 0.0, "embedding_size": V, "eos_token_id": ids["<|endoftext|>"], "flash_attention": False,
        "include_bias": False, "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "meta",
        "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False, "layer_norm_type": "rms",
        "layer_norm_with_affine": True, "mask_token_id": ids["<|mdm_mask|>"], "max_sequence_length": 256,
        "mlp_hidden_size": mlp, "mlp_ratio": 4, "model_type": "llada", "multi_query_attention": None,
        "n_heads": n_heads, "n_kv_heads": n_heads, "n_layers": n_layers, "pad_token_id": ids["<|endoftext|>"],
        "precision": "amp_bf16", "residual_dropout": 0.0, "rms_norm_eps": 1e-05, "rope": True,
        "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.46.3", "use_cache": False, "vocab_size": V, "weight_tying": False,
    }
    shapes = {"model.transformer.wte.weight": (V, d_model), "model.transformer.ln_f.weight": (d_model,),
              "model.transformer.ff_out.weight": (V, d_model)}
    for i in range(n_layers):
        p = f"model.transformer.blocks.{i}."
        shapes.update({p + "q_proj.weight": (d_model, d_model), p + "k_proj.weight": (d_model, d_model),
                       p + "v_proj.weight": (d_model, d_model), p + "attn_out.weight": (d_model, d_model),
                       p + "ff_proj.weight": (mlp, d_model), p + "up_proj.weight": (mlp, d_model),
                       p + "ff_out.weight": (d_model, mlp), p + "attn_norm.weight": (d_model,),
                       p + "ff_norm.weight": (d_model,)})
    _save(d, cfg, shapes, seed)
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": ids["<|startoftext|>"],
                                                          "eos_token_id": ids["<|endoftext|>"]}))
    return dict(ids, vocab=V)


def build_dream_instruct(directory, hidden=32, heads=4, kv_heads=2, layers=2, inter=64, seed=0) -> dict:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ids = _tokenizer(d, DREAM_SPECIALS, {
        "bos_token": "<|beginoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "mask_token": "<|mask|>", "chat_template": DREAM_CHAT, "clean_up_tokenization_spaces": False,
        "model_max_length": 131072, "errors": "replace", "split_special_tokens": False,
        # the official tokenizer is a remote-code class; it must never be needed
        "tokenizer_class": "DreamTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]}})
    V = len(CHARS) + 1 + len(DREAM_SPECIALS)
    hd = hidden // heads
    cfg = {
        "architectures": ["DreamModel"], "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
        "bos_token_id": ids["<|beginoftext|>"], "eos_token_id": ids["<|endoftext|>"], "hidden_act": "silu",
        "hidden_size": hidden, "initializer_range": 0.02, "intermediate_size": inter,
        "mask_token_id": ids["<|mask|>"], "max_position_embeddings": 256, "max_window_layers": layers,
        "model_type": "Dream", "num_attention_heads": heads, "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads, "pad_token_id": ids["<|endoftext|>"], "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.46.2", "use_cache": False,
        "use_sliding_window": False, "vocab_size": V,
    }
    shapes = {"model.embed_tokens.weight": (V, hidden), "model.norm.weight": (hidden,), "lm_head.weight": (V, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * hd, hidden), p + "self_attn.q_proj.bias": (heads * hd,),
            p + "self_attn.k_proj.weight": (kv_heads * hd, hidden), p + "self_attn.k_proj.bias": (kv_heads * hd,),
            p + "self_attn.v_proj.weight": (kv_heads * hd, hidden), p + "self_attn.v_proj.bias": (kv_heads * hd,),
            p + "self_attn.o_proj.weight": (hidden, heads * hd), p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden), p + "mlp.down_proj.weight": (hidden, inter)})
    _save(d, cfg, shapes, seed)
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": ids["<|beginoftext|>"],
                                                          "eos_token_id": ids["<|endoftext|>"],
                                                          "pad_token_id": ids["<|endoftext|>"]}))
    return dict(ids, vocab=V)
