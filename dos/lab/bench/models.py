"""Model presets (DESIGN.md §8 shapes), fast builders and the two data sources.

Models are `transformers` Llama decoders: random init, untied embeddings, multi-head attention (as
many KV heads as heads), SDPA attention, activation checkpointing. Data is either synthetic tokens
(throughput) or the Python standard library's own source files as bytes (vocabulary 256,
convergence): a real corpus present on every machine.
"""
from __future__ import annotations

import contextlib
import hashlib
import sys
import sysconfig
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import List, Optional

import torch


@dataclass(frozen=True)
class ModelPreset:
    """Shape of one Llama preset (the fields of `LlamaConfig` that matter)."""

    hidden: int
    """Hidden size (d_model)."""
    layers: int
    """Decoder layers."""
    heads: int
    """Attention heads (= KV heads: MHA)."""
    ffn: int
    """MLP intermediate size (SwiGLU: three matrices hidden x ffn)."""
    vocab: int = 32000
    """Vocabulary size; the input embedding and the output head are untied."""

    def n_params(self) -> int:
        """Exact parameter count of `build_model(self)` (norm weights included)."""
        h, f, v = self.hidden, self.ffn, self.vocab
        per_layer = 4 * h * h + 3 * h * f + 2 * h
        return 2 * v * h + self.layers * per_layer + h


PRESETS = {
    # CPU / CI stand-in: vocabulary 256 so the stdlib byte corpus fits it.
    "tiny": ModelPreset(hidden=64, layers=2, heads=4, ffn=176, vocab=256),
    # DESIGN.md §8 (1.35B / 3.37B / 6.74B / 13.0B parameters).
    "1.3B": ModelPreset(hidden=2048, layers=24, heads=16, ffn=5504),
    "3B": ModelPreset(hidden=3072, layers=28, heads=24, ffn=8192),
    # Issue 16's "~5B" (4.60B parameters, head dim 128): the largest Llama-like shape whose DeepSpeed
    # ZeRO-2 offload fits the 1-GPU machine's 125 GiB host with room (20-25 B/param: 86-107 GiB).
    "5B": ModelPreset(hidden=3584, layers=28, heads=28, ffn=9728),
    "7B": ModelPreset(hidden=4096, layers=32, heads=32, ffn=11008),
    "13B": ModelPreset(hidden=5120, layers=40, heads=40, ffn=13824),
    # The paper's larger range; head dim 128 as in the Llama family (20.3B / 30.1B parameters).
    "20B": ModelPreset(hidden=6144, layers=44, heads=48, ffn=16384),
    "30B": ModelPreset(hidden=7168, layers=48, heads=56, ffn=19200),
}


def preset(name: str, overrides: Optional[dict] = None) -> ModelPreset:
    """The preset `name` with `overrides` (field -> value, e.g. {"vocab": 256}) applied."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    p = PRESETS[name]
    if overrides:
        unknown = set(overrides) - set(asdict(p))
        if unknown:
            raise ValueError(f"unknown model override(s) {sorted(unknown)}; fields: {list(asdict(p))}")
        p = replace(p, **overrides)
    return p


def llama_config(p: ModelPreset, seq_len: int):
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=p.vocab, hidden_size=p.hidden, intermediate_size=p.ffn,
                      num_hidden_layers=p.layers, num_attention_heads=p.heads,
                      num_key_value_heads=p.heads, max_position_embeddings=max(seq_len, 2048),
                      tie_word_embeddings=False, use_cache=False)
    cfg._attn_implementation = "sdpa"  # works on transformers 4.4x and 5.x alike
    return cfg


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(p: ModelPreset, device: torch.device, seq_len: int, dtype=torch.bfloat16,
                checkpointing: bool = True):
    """A randomly initialised Llama on `device`, in `dtype`, in train mode.

    Parameters are created directly on the device (no host copy, no fp32 detour), so a 13B model
    starts in seconds on the GPU.
    """
    from transformers import LlamaForCausalLM

    with _default_dtype(dtype), torch.device(device):
        model = LlamaForCausalLM(llama_config(p, seq_len))
    model.config.use_cache = False
    if checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    return model


def model_record(p: ModelPreset) -> dict:
    """The model part of a row's `config` column."""
    return {**asdict(p), "arch": "llama", "tied": False, "kv_heads": p.heads, "attn": "sdpa"}


# ---------------------------------------------------------------- data

def synthetic_batches(n: int, micro_batch: int, seq_len: int, vocab: int, seed: int) -> List[torch.Tensor]:
    """`n` batches of uniform random token ids (CPU tensors, shape micro_batch x seq_len)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (micro_batch, seq_len), generator=g) for _ in range(n)]


def stdlib_corpus(max_bytes: int = 8 << 20) -> bytes:
    """The standard library's `.py` sources (site-packages excluded), sorted by path, concatenated."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        out.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    blob = b"".join(out)[:max_bytes]
    if len(blob) < 1 << 16:
        raise RuntimeError(f"stdlib corpus under {root} is too small ({len(blob)} bytes)")
    return blob


def corpus_record(blob: bytes) -> dict:
    return {"source": "python-stdlib", "python": sys.version.split()[0], "bytes": len(blob),
            "sha1": hashlib.sha1(blob).hexdigest()[:12]}


def corpus_batches(blob: bytes, n: int, micro_batch: int, seq_len: int, seed: int) -> List[torch.Tensor]:
    """`n` batches of random windows of the byte corpus (token id = byte value)."""
    data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        starts = torch.randint(0, data.numel() - seq_len, (micro_batch,), generator=g)
        out.append(torch.stack([data[s: s + seq_len] for s in starts.tolist()]).long())
    return out


def batches(data: str, n: int, micro_batch: int, seq_len: int, vocab: int, seed: int):
    """(batches, data record) for `data` in {"synthetic", "stdlib"}."""
    if data == "synthetic":
        return synthetic_batches(n, micro_batch, seq_len, vocab, seed), {"source": "synthetic"}
    if data == "stdlib":
        if vocab < 256:
            raise ValueError(f"the stdlib byte corpus needs vocab >= 256, got {vocab}")
        blob = stdlib_corpus()
        return corpus_batches(blob, n, micro_batch, seq_len, seed), corpus_record(blob)
    raise ValueError(f"unknown data source {data!r}")
