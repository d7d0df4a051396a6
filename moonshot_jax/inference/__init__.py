"""Inference: prefill / decode over KDA-state + MLA-latent caches, sampling, generation, imports.

  engine.prefill / engine.decode_step   cached forward passes (engine.py)
  generate.generate                     batched sampling loop with streaming (generate.py)
  cache.DecodeCache / init_cache        the per-layer cache pytree (cache.py)
  sampling.SamplingParams / sample      greedy, temperature, top-k, top-p, stop tokens (sampling.py)
  plan_cache                            cache bytes per token / sequence, hybrid vs all-MLA / all-KDA
  load.load_latest                      newest training checkpoint + tokenizer of a workdir
  hf_import.load_hf_checkpoint          Kimi-Linear-style Hugging Face checkpoints (safetensors)
"""
from moonshot_jax.inference.cache import DecodeCache, init_cache
from moonshot_jax.inference.engine import decode_step, prefill
from moonshot_jax.inference.generate import Generation, generate
from moonshot_jax.inference.sampling import SamplingParams, sample

__all__ = ["DecodeCache", "Generation", "SamplingParams", "decode_step", "generate", "init_cache", "prefill",
           "sample"]
