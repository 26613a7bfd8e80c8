"""Real models, CI-sized: HF transformers from tiny configs and torchvision, random weights.

GPT-2, BERT, Llama, T5, BART (one embedding tied three ways), Mixtral (mixture of
experts), ALBERT (one layer's weights used by every layer), Whisper (convolutions
over audio features, then an encoder-decoder), CLIP (a text and an image tower
and a contrastive loss); resnet18, ViT, ConvNeXt and Swin.

Shared by tests/test_native_real_models.py, tests/test_ddp_real_models.py and
bench/backward_memory.py. Everything is built offline from a config (no hub
download: ``HF_HUB_OFFLINE=1``), with dropout off so that eager and compiled
runs draw no random numbers and can be compared value for value.

``MODELS`` maps a name to a ``RealModel``: ``build()`` returns a model in
training mode, ``batch(seed)`` the inputs of one step, ``loss(model, batch)``
the scalar to differentiate.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Callable, Dict, Optional

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

VOCAB = 96
SEQ = 16
BATCH = 2
WIDTH = 32  # the HF models' hidden size (their feed-forward is twice as wide); ViT's too
MEL_BINS, AUDIO_FRAMES = 16, 64  # Whisper's input features (its encoder halves the frames)


@contextlib.contextmanager
def sized(width: int, vocab: int, seq: int, batch: int):
    """Build and batch the models at another size inside the block (the memory
    benchmarks measure them at sizes whose buffers RSS can see)."""
    global WIDTH, VOCAB, SEQ, BATCH
    saved = WIDTH, VOCAB, SEQ, BATCH
    WIDTH, VOCAB, SEQ, BATCH = width, vocab, seq, batch
    try:
        yield
    finally:
        WIDTH, VOCAB, SEQ, BATCH = saved


def _tokens(seed: int, batch: Optional[int] = None, seq: Optional[int] = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch or BATCH, seq or SEQ), generator=gen)


def _images(seed: int, batch: int = 4) -> dict:
    # 64 x 64 and 4 images: resnet18's last BatchNorm still sees 16 values per
    # channel (at 32 x 32 and 2 images it sees 2, and any two compilers differ
    # by 1e-2 in the loss).
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(batch, 3, 64, 64, generator=gen),
        "y": torch.randint(0, 10, (batch,), generator=gen),
    }


def _lm_batch(seed: int) -> dict:
    ids = _tokens(seed)
    return {"input_ids": ids, "labels": ids}


def _hf_loss(model, batch) -> torch.Tensor:
    return model(**batch).loss


def _image_loss(model, batch) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])


def gpt2():
    import transformers

    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def bert():
    import transformers

    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=2 * WIDTH, max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(config)


def llama():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        attention_dropout=0.0,
    )
    return transformers.LlamaForCausalLM(config)


def mixtral():
    # A mixture of experts: each token is routed to its top 2 of 4 experts, so which
    # rows each expert's matmuls see depends on the data (dynamo breaks the graph there).
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=SEQ, attention_dropout=0.0, router_jitter_noise=0.0,
    )
    return transformers.MixtralForCausalLM(config)


def t5():
    import transformers

    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=WIDTH, d_kv=WIDTH // 4, d_ff=2 * WIDTH, num_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config)


def bart():
    # Encoder-decoder whose encoder and decoder embeddings and LM head are one tensor
    # (``model.shared``), with learned positions and a final-logits bias buffer.
    import transformers

    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=WIDTH, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH,
        max_position_embeddings=SEQ, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
    )
    return transformers.BartForConditionalGeneration(config)


def albert():
    # One set of layer weights used by all three layers: each weight's gradient sums three uses.
    import transformers

    config = transformers.AlbertConfig(
        vocab_size=VOCAB, embedding_size=WIDTH // 2, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
        num_hidden_layers=3, num_attention_heads=2, max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
    )
    return transformers.AlbertForMaskedLM(config)


def whisper():
    # Two 1-d convolutions over the audio features feed the encoder; the decoder's
    # labels are shorter than the audio.
    import transformers

    config = transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=MEL_BINS, d_model=WIDTH, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH,
        max_source_positions=AUDIO_FRAMES // 2, max_target_positions=SEQ,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    )
    return transformers.WhisperForConditionalGeneration(config)


def _audio_batch(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "input_features": torch.randn(BATCH, MEL_BINS, AUDIO_FRAMES, generator=generator),
        "labels": torch.randint(3, VOCAB, (BATCH, SEQ // 2), generator=generator),
    }


def clip():
    # Two towers whose pooled outputs meet in a contrastive loss scaled by a learned
    # temperature (``logit_scale.exp()``).
    import transformers

    config = transformers.CLIPConfig(
        text_config=dict(
            vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=1,
            num_attention_heads=2, max_position_embeddings=SEQ,
        ),
        vision_config=dict(
            hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=1, num_attention_heads=2,
            image_size=32, patch_size=8,
        ),
        projection_dim=WIDTH // 2,
    )
    return transformers.CLIPModel(config)


def _text_image_batch(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
        "pixel_values": torch.randn(BATCH, 3, 32, 32, generator=generator),
    }


def _contrastive_loss(model, batch) -> torch.Tensor:
    return model(**batch, return_loss=True).loss


def resnet18():
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


def vit():
    import torchvision

    return torchvision.models.VisionTransformer(
        image_size=64, patch_size=16, num_layers=2, num_heads=2, hidden_dim=WIDTH,
        mlp_dim=2 * WIDTH, num_classes=10,
    )


def convnext():
    # Its blocks permute to channels-last and back, so the global pool gets a
    # channels-last-strided input (xla/rewrite.py).
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return ConvNeXt(
        [CNBlockConfig(WIDTH // 2, WIDTH, 1), CNBlockConfig(WIDTH, None, 1)],
        stochastic_depth_prob=0.0, num_classes=10,
    )


def swin():
    from torchvision.models.swin_transformer import SwinTransformer

    return SwinTransformer(
        patch_size=[4, 4], embed_dim=WIDTH // 2, depths=[1, 1], num_heads=[1, 2], window_size=[4, 4],
        stochastic_depth_prob=0.0, num_classes=10,
    )


@dataclasses.dataclass(frozen=True)
class RealModel:
    name: str
    make: Callable[[], torch.nn.Module]
    batch: Callable[[int], dict]
    loss: Callable[[torch.nn.Module, dict], torch.Tensor]
    package: str  # the package it needs

    def build(self, seed: int = 0) -> torch.nn.Module:
        torch.manual_seed(seed)
        return self.make().train()

    def build_on(self, device, seed: int = 0) -> torch.nn.Module:
        """``build(seed)`` moved to ``device`` with its tied weights tied again. Moving a
        module to an XLA device gives each parameter a new tensor, which unties an HF
        model's input and output embeddings (and BART's three uses of one); HF's Trainer
        calls ``tie_weights()`` after the move for that reason, and so does this."""
        model = self.build(seed).to(device)
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        return model


MODELS: Dict[str, RealModel] = {
    "gpt2": RealModel("gpt2", gpt2, _lm_batch, _hf_loss, "transformers"),
    "bert": RealModel("bert", bert, _lm_batch, _hf_loss, "transformers"),
    "llama": RealModel("llama", llama, _lm_batch, _hf_loss, "transformers"),
    "t5": RealModel("t5", t5, _lm_batch, _hf_loss, "transformers"),
    "mixtral": RealModel("mixtral", mixtral, _lm_batch, _hf_loss, "transformers"),
    "bart": RealModel("bart", bart, _lm_batch, _hf_loss, "transformers"),
    "albert": RealModel("albert", albert, _lm_batch, _hf_loss, "transformers"),
    "whisper": RealModel("whisper", whisper, _audio_batch, _hf_loss, "transformers"),
    "clip": RealModel("clip", clip, _text_image_batch, _contrastive_loss, "transformers"),
    "resnet18": RealModel("resnet18", resnet18, _images, _image_loss, "torchvision"),
    "vit": RealModel("vit", vit, _images, _image_loss, "torchvision"),
    "convnext": RealModel("convnext", convnext, _images, _image_loss, "torchvision"),
    "swin": RealModel("swin", swin, _images, _image_loss, "torchvision"),
}


def available(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(MODELS[name].package) is not None
