"""The KV cache's storage dtype and FP8 scales, from the artifact's kv section and the engine options.

runtime.kv_cache_dtype (vLLM's names): auto stores K/V in the compute dtype; fp8 / fp8_e4m3 /
fp8_e5m2 store them in one byte with a per-layer scale for K and one for V (K = k_scale * stored; DeepSeek's
latent cache: k_scale alone, runtime/models/mla.py).
The scales come from the artifact (the build's calibration pass, or an imported checkpoint's
kv_cache_scheme); without any, 1.0 (vLLM's default), said once in the log. On a CPU the torch path
reads and writes the same FP8 cache, so CPU tests see what a GPU stores.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from llmc.runtime import artifact as art

logger = logging.getLogger("llmc")


@dataclass(frozen=True)
class KVCacheConfig:
    """dtype: the cache tensors' dtype; k_scales, v_scales: one per decoder layer of the whole model
    (1.0 for a cache that is not FP8)."""

    dtype: torch.dtype
    k_scales: list[float]
    v_scales: list[float]

    @property
    def is_fp8(self) -> bool:
        return self.dtype.itemsize == 1

    def layer_scales(self, layers) -> list[tuple[float, float]]:
        """(k_scale, v_scale) of each of the given global layer indices."""
        return [(self.k_scales[i], self.v_scales[i]) for i in layers]


def kv_cache_config(manifest: art.Manifest, options: art.RuntimeDefaults, compute_dtype: torch.dtype,
                    log: bool = True) -> KVCacheConfig:
    """What the runner allocates: FP8 with the artifact's scales, or the compute dtype (scales 1.0)."""
    num_layers = manifest.model.num_layers
    name = art.KV_CACHE_DTYPES[options.kv_cache_dtype]
    if name is None:
        return KVCacheConfig(compute_dtype, [1.0] * num_layers, [1.0] * num_layers)
    kv = manifest.kv
    if kv.k_scales and kv.v_scales:
        # amax / FP8 max of the format they were made for (the build's; an imported kv_cache_scheme's is
        # e4m3): another format at run time (e5m2 built, e4m3 asked) rescales them, or values clip
        made_for = kv.dtype if kv.scales_source == "calibration" and kv.dtype.startswith("float8") else "float8_e4m3fn"
        factor = torch.finfo(getattr(torch, made_for)).max / torch.finfo(getattr(torch, name)).max
        k_scales, v_scales = [s * factor for s in kv.k_scales], [s * factor for s in kv.v_scales]
        if log:
            logger.info("KV cache: %s with per-layer K/V scales from the %s%s (K %.3g..%.3g, V %.3g..%.3g)", name,
                        kv.scales_source, "" if factor == 1 else f", rescaled from {made_for}'s range",
                        min(k_scales), max(k_scales), min(v_scales), max(v_scales))
    else:
        k_scales, v_scales = [1.0] * num_layers, [1.0] * num_layers
        if log:
            logger.info("KV cache: %s with K/V scales 1.0 (the artifact records none: build it with "
                        "runtime.kv_cache_dtype and quantization.calibration.data to measure them)", name)
    return KVCacheConfig(getattr(torch, name), k_scales, v_scales)


def copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
    """Copy-on-write of KV blocks: block dst gets block src's K and V in every layer, for each
    (src, dst) of `pairs` (caches [num_blocks, block_size, ...]: K and V, or MLA's one latent cache; any device).
    The sources are gathered before any destination is written, so a pair may read a block
    another pair writes."""
    if not pairs:
        return
    device = kv_caches[0][0].device
    src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=device)
    for caches in kv_caches:
        for cache in caches:
            cache = cache.view(torch.uint8) if cache.element_size() == 1 else cache  # FP8: copy the bytes
            cache.index_copy_(0, dst, cache.index_select(0, src))
