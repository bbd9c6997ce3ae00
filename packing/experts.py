"""MoE expert repacking (``--repack-experts aiter-a4w4``): MXFP4 experts in the bytes aiter's gfx950 a4w4
fused MoE reads, stored per expert under the source tensor names. Pure, torch only, no I/O.

Source (Quark "mxfp4-quark" export), per expert ``e`` of a layer:
``mlp.experts.e.{gate_proj,up_proj}.weight`` U8 ``[I, H/2]`` + ``.weight_scale`` U8 E8M0 ``[I, H/32]``;
``mlp.experts.e.down_proj.weight`` U8 ``[H, I/2]`` + ``.weight_scale`` ``[H, I/32]`` (I = moe intermediate,
H = hidden; low nibble = even element; one scale byte per 32 elements along the input axis).

What the engines do at load time on gfx950 (checked in the sources below):

1. Stack per layer: ``w13 [E, 2I, H/2]`` = per expert ``[gate_proj rows | up_proj rows]`` (gate first,
   not interleaved: vLLM/SGLang ``FusedMoE._load_w13`` puts shard ``w1`` = gate_proj in rows ``[0, I)`` and
   ``w3`` = up_proj in ``[I, 2I)``; aiter's reference ``torch_moe_stage1`` splits ``gate, up = out.split``
   and computes ``act(gate) * up``); ``w2 [E, H, I/2]`` = down_proj. Scales stack the same way:
   ``w13_weight_scale [E, 2I, H/32]``, ``w2_weight_scale [E, H, I/32]``.
2. Weights: ``aiter.ops.shuffle.shuffle_weight(w, layout=(16, 16))`` on the whole 3-D tensor. It views
   ``(-1, N/16, 16, Kb/32, 2, 16)`` and permutes ``(0, 1, 3, 4, 2, 5)``, so every expert and every 16-row
   tile is independent: byte (n, kb) of a matrix goes to ``(n//16)*16*Kb + (kb//16)*256 + (n%16)*16 + kb%16``
   (``layouts.shuffle_weight``). Tensors are then flagged ``is_shuffled = True``: a Python attribute that
   ``fused_moe`` reads to pick kernels/configs and safetensors does not keep, so a loader of this overlay
   must set it on the stacked ``w13`` / ``w2`` itself.
3. Scales: ``aiter.utility.fp4_utils.e8m0_shuffle(s.view(E*N, K/32))`` (= ``shuffle_scale`` without
   ``is_guinterleave``) on the 2-D stack of all experts, viewed back to ``[E, N, K/32]``. It works in
   independent 32-row groups (``layouts.shuffle_scale``), padding rows to 256 and columns to 8 at the end.
4. Kernel: ``aiter.fused_moe.fused_moe(..., quant_type=per_1x32)`` with fp4x2 weights, SiLU and the
   default ``gate_mode=SEPARATED`` picks fp4x2 activations on gfx950 (a4w4: CK 2-stage / ASM 1-stage).

This is the variant produced here ("separated", a.k.a. GGUU). Not produced: the a16w4 / a8w4 / gfx1250
variants (``is_guinterleave=True`` lane shuffles, GUGU gate/up interleave, ``shuffle_scale_a16w4``,
``shuffle_scale_n32k4``), used by SGLang only under ``SGLANG_USE_AITER_MOE_GU_ITLV`` and by aiter for
Swiglu / ``GateMode.INTERLEAVE`` / fp8 activations.

Why per expert under the source names works: both shuffles act on independent row blocks (16 rows for
weights, 32-row groups for scales) of each matrix, so with ``I`` and ``H`` multiples of 256 and K/32 a
multiple of 8 (no padding anywhere) the engine's ordinary stacking of the pre-shuffled per-expert tensors
yields byte for byte ``shuffle_weight(w13)`` and ``e8m0_shuffle(w13_scale.view(E*2I, -1))``; each tensor
keeps its source shape, so a loader that only skips its own shuffle reads it unchanged. We refuse shapes
that would need padding (padding would change the tensor's shape and break that equivalence); GLM-5
(I = 2048, H = 6144) and DeepSeek-V3 (2048, 7168) qualify. Row slices at multiples of 32 commute with
both shuffles (TP slicing of gate/up rows is safe), but slicing down_proj along its input axis (MoE
tensor parallelism) does not: a pre-shuffled overlay is for EP / unsliced experts, or must be unpacked
first. Engines pad ``I`` per rank to their own multiples (SGLang: ``I/2`` to 128 bytes); not baked here.

Sources: ROCm/aiter e4048607a535ace3a2b51ded31b1c8c2d45c0879 (``aiter/ops/shuffle.py`` shuffle_weight,
shuffle_scale, moe_shuffle_weight; ``aiter/utility/fp4_utils.py`` e8m0_shuffle; ``aiter/fused_moe.py``
fused_moe, torch_moe_stage1; ``op_tests/test_moe_2stage.py`` a4w4 preshuffle branch);
vllm-project/vllm 004b19defc58361d79cd250292c50706a3d84b27
(``vllm/model_executor/layers/quantization/quark/quark_moe.py`` QuarkOCP_MX_MoEMethod
.process_weights_after_loading; ``vllm/_aiter_ops.py`` rocm_aiter_ops.shuffle_weights);
sgl-project/sglang 0007e6547ecaa847f407b147fdf2aa6ebe368115
(``python/sglang/srt/layers/quantization/quark/schemes/quark_w4a4_mxfp4_moe.py`` QuarkW4A4MXFp4MoE).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .errors import FormatError
from .layouts import (
    shuffle_scale,
    shuffle_scale_params,
    shuffle_weight,
    shuffle_weight_params,
    unshuffle_scale,
    unshuffle_weight,
)
from .mxfp4 import BLOCK

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_ROW_MULTIPLE = 256  # rows of every matrix: no e8m0_shuffle row padding (and whole 16-row weight tiles)
_K_MULTIPLE = 256  # input axis in elements: K/32 % 8 == 0 (no scale column padding), K/2 % 32 == 0

# One projection of all experts of a layer: (codes per expert, scales per expert), index = expert id.
Projection = tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]


def moe_layout_description() -> dict:
    """JSON-able description of the layout for the manifest (layer level)."""
    return {
        "layout": "aiter_moe_a4w4",
        "variant": "separated (GGUU): no is_guinterleave, no gate/up interleave; gfx950 (not gfx1250)",
        "weight_shuffle": "aiter.ops.shuffle.shuffle_weight(w, layout=(16, 16))",
        "scale_shuffle": "aiter.utility.fp4_utils.e8m0_shuffle(s.view(E*N, K/32)), no padding",
        "stacking": "w13[e] = [gate_proj rows | up_proj rows] (gate first); w2[e] = down_proj",
        "storage": "per expert, under the source tensor names, source shapes; each tensor shuffled",
        "per_tensor_layouts": {"weight": "aiter_shuffle_16x16", "weight_scale": "aiter_e8m0_shuffle"},
        "is_shuffled": True,
        "kernel": "aiter.fused_moe.fused_moe, QuantType.per_1x32, fp4x2 weights, gate_mode separated",
        "valid_for": "experts not sliced along down_proj's input axis (EP or MoE-TP 1); gate/up row slices "
        "at multiples of 32 rows are fine",
        "source": "ROCm/aiter@e4048607a535ace3a2b51ded31b1c8c2d45c0879 aiter/ops/shuffle.py; "
        "vllm@004b19defc58361d79cd250292c50706a3d84b27 quark_moe.py QuarkOCP_MX_MoEMethod; "
        "sglang@0007e6547ecaa847f407b147fdf2aa6ebe368115 quark_w4a4_mxfp4_moe.py QuarkW4A4MXFp4MoE",
    }


def tensor_layout(kind: str, shape) -> dict:
    """Per-tensor layout params (:mod:`layouts` registry) of a repacked ``weight`` or ``weight_scale``."""
    if kind == "weight":
        return shuffle_weight_params()
    if kind == "weight_scale":
        return shuffle_scale_params(shape)
    raise FormatError(f"tensor kind must be 'weight' or 'weight_scale', got {kind!r}")


def _check_pair(codes, scales, name: str | None, expect: tuple[int, int] | None = None) -> tuple[int, int]:
    """Validate one expert projection (``name`` = its weight tensor's name); return (rows, K in elements)."""
    for t, what in ((codes, "codes"), (scales, "scales")):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 2:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise FormatError(f"MXFP4 expert {what} must be a 2-D uint8 tensor, got {got}", tensor=name)
    r, kb = codes.shape
    if tuple(scales.shape) != (r, kb * 2 // BLOCK) or kb % (BLOCK // 2):
        raise FormatError(
            f"codes {tuple(codes.shape)} and scales {tuple(scales.shape)} disagree: "
            "need [R, K/2] and [R, K/32]",
            tensor=name,
        )
    if expect is not None and (r, kb * 2) != expect:
        raise FormatError(
            f"codes {tuple(codes.shape)} do not match the layer: expected [{expect[0]}, {expect[1] // 2}]",
            tensor=name,
        )
    if r % _ROW_MULTIPLE or (kb * 2) % _K_MULTIPLE:
        raise FormatError(
            f"aiter-a4w4 repacking needs rows % 256 == 0 and K % 256 == 0 (no shuffle padding, so the "
            f"tensor keeps its shape), got rows {r}, K {kb * 2}",
            tensor=name,
        )
    return r, kb * 2


def _check_layer(layer: Mapping[str, Projection], prefix: str | None) -> tuple[int, int, int]:
    """Validate a layer's gate/up/down experts; return (E, I, H)."""
    if not isinstance(layer, Mapping) or set(layer) != set(PROJECTIONS):
        got = sorted(layer) if isinstance(layer, Mapping) else type(layer).__name__
        raise FormatError(f"expert layer needs exactly {', '.join(PROJECTIONS)}, got {got}", tensor=prefix)
    counts = {p: tuple(len(side) for side in layer[p]) for p in PROJECTIONS}
    n = counts["gate_proj"][0]
    if n == 0 or any(c != (n, n) for c in counts.values()):
        raise FormatError(
            f"every projection needs (codes, scales) for the same positive number of experts, got {counts}",
            tensor=prefix,
        )

    def name(e: int, proj: str) -> str:
        return f"{prefix + '.' if prefix else ''}{e}.{proj}.weight"

    inter, hidden = _check_pair(layer["gate_proj"][0][0], layer["gate_proj"][1][0], name(0, "gate_proj"))
    expect = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    for e in range(n):
        for proj in PROJECTIONS:
            _check_pair(layer[proj][0][e], layer[proj][1][e], name(e, proj), expect[proj])
    return n, inter, hidden


def repack_expert(
    codes: torch.Tensor, scales: torch.Tensor, *, name: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert projection, source ``[R, K/2]`` / ``[R, K/32]`` -> shuffled tensors of the same shapes.

    ``name`` (the weight tensor's) only labels errors.
    """
    _check_pair(codes, scales, name)
    return shuffle_weight(codes), shuffle_scale(scales)


def unpack_expert(
    codes: torch.Tensor, scales: torch.Tensor, *, name: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact inverse of :func:`repack_expert`: the source bytes back."""
    _check_pair(codes, scales, name)
    return unshuffle_weight(codes), unshuffle_scale(scales, scales.shape)


def _map_layer(layer: Mapping[str, Projection], fn, prefix: str | None) -> dict[str, tuple[list, list]]:
    _check_layer(layer, prefix)
    out = {}
    for proj in PROJECTIONS:
        pairs = [fn(c, s) for c, s in zip(*layer[proj], strict=True)]
        out[proj] = ([c for c, _ in pairs], [s for _, s in pairs])
    return out


def repack_experts(
    layer: Mapping[str, Projection], *, prefix: str | None = None
) -> dict[str, tuple[list, list]]:
    """A layer's experts ``{proj: (codes per expert, scales per expert)}`` -> the overlay tensors, same keys.

    Every output keeps its source shape and goes under its source name. ``prefix`` (e.g.
    ``model.layers.5.mlp.experts``) only names tensors in errors. :class:`FormatError` for bad shapes.
    """
    return _map_layer(layer, repack_expert, prefix)


def unpack_experts(
    layer: Mapping[str, Projection], *, prefix: str | None = None
) -> dict[str, tuple[list, list]]:
    """Exact inverse of :func:`repack_experts`: the source bytes back."""
    return _map_layer(layer, unpack_expert, prefix)


def stack_for_kernel(
    layer: Mapping[str, Projection], *, prefix: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Repacked per-expert tensors -> what aiter's ``fused_moe`` takes, stacked as the engines stack them.

    Returns ``w13 [E, 2I, H/2]``, ``w13_scale [E, 2I, H/32]``, ``w2 [E, H, I/2]``, ``w2_scale [E, H, I/32]``
    (uint8; scales hold ``e8m0_shuffle`` bytes of the ``[E*N, K/32]`` stack, viewed 3-D as engines keep them).
    """
    _check_layer(layer, prefix)
    gate, up, down = (layer[p] for p in PROJECTIONS)
    w13 = torch.stack([torch.cat([g, u]) for g, u in zip(gate[0], up[0], strict=True)])
    w13_scale = torch.stack([torch.cat([g, u]) for g, u in zip(gate[1], up[1], strict=True)])
    return w13, w13_scale, torch.stack(list(down[0])), torch.stack(list(down[1]))
