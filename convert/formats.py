"""Source weight formats: detection from dtypes/shapes (+ ``quantization_config``), dequantization to float32
(exact, or the exact value rounded once), and the encoders the synthetic checkpoints use. One module knows each format.

A *module weight* ``<module>.weight`` ``[out, in]`` is stored in one of these formats:

``bf16`` / ``fp16`` / ``fp32``
    ``weight`` BF16 / F16 / F32, no scale. Dequantization is a widening cast (exact).
``fp8-block`` (DeepSeek-V3 / zai-org GLM-5-FP8, ``quant_method: "fp8"``, ``fmt: "e4m3"``)
    ``weight`` F8_E4M3 ``[out, in]`` + ``weight_scale_inv`` F32 ``[ceil(out/bo), ceil(in/bi)]`` with
    ``(bo, bi) = weight_block_size`` (default ``[128, 128]``); value = ``float(w) * scale_inv[i//bo, j//bi]``.
    Edge blocks may be partial. Encoder: per block ``scale_inv = amax / 448`` (1.0 for an all-zero block).
``fp8-channel`` (AMD Quark per-output-channel FP8, ``qscheme: "per_channel"``, ``ch_axis: 0``)
    ``weight`` F8_E4M3 ``[out, in]`` + ``weight_scale`` F32 ``[out]`` (``[out, 1]`` is accepted too), as
    vLLM's Quark W8A8-FP8 scheme declares it (``ChannelQuantScaleParameter`` of ``sum(output sizes)``
    floats); value = ``float(w) * weight_scale[i]``. An ``input_scale`` (static activations only) is not
    part of the weight and is ignored. Encoder: ``weight_scale = amax(row) / 448``.
``mxfp4`` (AMD Quark MXFP4, ``dtype: "fp4"``, ``group_size: 32``, ``scale_format: "e8m0"``)
    ``weight`` U8 ``[out, in/2]`` (two E2M1 codes per byte, low nibble first) + ``weight_scale`` U8
    ``[out, in/32]`` (E8M0), grouped along ``in``. Decoded and encoded by :mod:`glm_pack.packing.mxfp4`
    (encoder: ``quantize(mode="even")``, Quark's ``scale_calculation_mode``).

All float32 results are computed in float32 from the stored bits (never through bf16): exact for the float
formats and MXFP4; an FP8 value times its float32 scale needs up to 28 significant bits, so that product is
rounded once to float32 (relative error at most 2**-24). Quark's
``exclude`` list (exact module names, or ``re:`` regexes applied with ``re.match``) says which modules
stay unquantized; a quantized tensor in an excluded module, or one whose Quark spec names another
format, is a :class:`~glm_pack.packing.errors.FormatError`; so is a quantized weight with both a
``weight_scale_inv`` and a ``weight_scale`` (which one scales it would be a guess).
"""

from __future__ import annotations

import fnmatch
import functools
import json
import math
import re
from dataclasses import dataclass

import torch

from glm_pack.packing import fp8, mxfp4
from glm_pack.packing.errors import FormatError

from .config_values import config_value
from .safetensors_io import DTYPES

FORMATS = ("bf16", "fp16", "fp32", "fp8-block", "fp8-channel", "mxfp4")
FLOAT_FORMATS = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}  # safetensors dtype -> format
FLOAT_DTYPES = {fmt: dtype for dtype, fmt in FLOAT_FORMATS.items()}  # format -> safetensors dtype
FP8_MAX = 448.0
DEFAULT_FP8_BLOCK = (128, 128)
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
_QC = "quantization_config"

_setting = functools.partial(config_value, error=FormatError)


@dataclass(frozen=True)
class StoredTensor:
    """What a detector needs to know about a stored tensor: name, safetensors dtype name, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class WeightFormat:
    """A module weight's detected format and the stored tensors it reads (``scale`` is None for floats)."""

    name: str
    weight: str
    scale: str | None = None
    block: tuple[int, int] | None = None

    @property
    def tensors(self) -> list[str]:
        return [self.weight] + ([self.scale] if self.scale else [])


def module_of(weight_name: str) -> str:
    """``a.b.kv_b_proj.weight`` -> ``a.b.kv_b_proj`` (the name Quark's ``exclude`` refers to)."""
    if not weight_name.endswith(".weight"):
        raise FormatError("a module weight name must end in '.weight'", tensor=weight_name)
    return weight_name[: -len(".weight")]


def _quark_spec_format(spec: dict, where: str) -> str | None:
    """The format a Quark spec (``global_quant_config`` or a ``layer_quant_config`` value) gives weights."""
    weight = _setting(spec.get("weight"), f"{where}.weight", dict, default={})
    dtype = _setting(weight.get("dtype"), f"{where}.weight.dtype", str, default=None)
    qscheme = _setting(weight.get("qscheme"), f"{where}.weight.qscheme", str, default=None)
    if dtype == "fp4":
        return "mxfp4"
    if dtype == "fp8_e4m3":
        return "fp8-channel" if qscheme == "per_channel" else f"fp8-{qscheme}"
    return dtype  # another Quark dtype (e.g. int4): no stored format matches it, so a quantized weight is refused


def _exclude_regex(entry: str) -> re.Pattern:
    try:
        return re.compile(entry[3:])
    except re.error as err:
        raise FormatError(
            f"{_QC}.exclude entry {json.dumps(entry)} is not a valid regex: {err}", file="config.json"
        ) from err


def _fp8_block(qc: dict) -> tuple[int, int]:
    block = _setting(qc.get("weight_block_size"), f"{_QC}.weight_block_size", list, item=int, minimum=1, default=None)
    if block is None:
        return DEFAULT_FP8_BLOCK
    if len(block) != 2:
        raise FormatError(
            f"{_QC}.weight_block_size must be two integers >= 1, got {json.dumps(block)}", file="config.json"
        )
    return block[0], block[1]


def _quark_parts(qc: dict) -> tuple[list[str], dict[str, str | None], str | None]:
    """Quark's ``exclude``, the format of each ``layer_quant_config`` pattern, that of ``global_quant_config``."""
    exclude = _setting(qc.get("exclude"), f"{_QC}.exclude", list, item=str, default=[])
    layers = _setting(qc.get("layer_quant_config"), f"{_QC}.layer_quant_config", dict, item=dict, default={})
    glob = _setting(qc.get("global_quant_config"), f"{_QC}.global_quant_config", dict, default={})
    by_pattern = {
        p: _quark_spec_format(spec, f"{_QC}.layer_quant_config[{json.dumps(p)}]") for p, spec in layers.items()
    }
    return exclude, by_pattern, _quark_spec_format(glob, f"{_QC}.global_quant_config")


class QuantConfig:
    """The parts of config.json's ``quantization_config`` that matter for reading weights, each type-checked
    where read (a bad value is a FormatError naming the key, ``file="config.json"``)."""

    def __init__(self, qc: dict | None):
        qc = _setting(qc, _QC, dict, default={})
        self.method = _setting(qc.get("quant_method"), f"{_QC}.quant_method", str, default=None)
        self.fp8_block = _fp8_block(qc)
        self.exclude, self._layer_formats, self._global_format = (
            _quark_parts(qc) if self.method == "quark" else ([], {}, None)
        )
        self._patterns = [_exclude_regex(e) for e in self.exclude if e.startswith("re:")]
        self._exact = {e for e in self.exclude if not e.startswith("re:")}

    def excluded(self, module: str) -> bool:
        return module in self._exact or any(p.match(module) for p in self._patterns)

    def expected_format(self, module: str) -> str | None:
        """Quark: the format its config assigns to ``module`` (None: not quantized or not Quark)."""
        if self.excluded(module):
            return None
        for pattern, fmt in self._layer_formats.items():
            if fnmatch.fnmatchcase(module, pattern):
                return fmt
        return self._global_format


def detect(weight: StoredTensor, scales: dict[str, StoredTensor], quant: QuantConfig) -> WeightFormat:
    """Format of ``weight`` given its sibling scale tensors (keyed by suffix, e.g. ``"weight_scale_inv"``)."""
    name, shape = weight.name, weight.shape
    if weight.dtype in FLOAT_FORMATS:
        if scales:
            raise FormatError(
                f"{weight.dtype} weight has a scale tensor ({', '.join(sorted(scales))}); unknown format", tensor=name
            )
        return WeightFormat(FLOAT_FORMATS[weight.dtype], name)
    if len(shape) != 2:
        raise FormatError(f"quantized weight must be 2-D [out, in], got shape {shape}", tensor=name)
    if len(scales) > 1:
        raise FormatError(f"weight has {' and '.join(sorted(scales))}; which one scales it is ambiguous", tensor=name)
    out, cols = shape
    if weight.dtype == "F8_E4M3":
        fmt = _detect_fp8(weight, scales, quant)
    elif weight.dtype == "U8":
        scale = scales.get("weight_scale")
        want = (out, cols * 2 // mxfp4.BLOCK)
        if scale is None or scale.dtype != "U8" or scale.shape != want or cols % (mxfp4.BLOCK // 2):
            got = "none" if scale is None else f"{scale.dtype} {scale.shape}"
            raise FormatError(
                f"U8 weight {shape} is MXFP4 only with a U8 weight_scale of shape {want}; found {got}", tensor=name
            )
        fmt = WeightFormat("mxfp4", name, scale.name)
    else:
        raise FormatError(f"unsupported weight dtype {weight.dtype}", tensor=name)
    module = module_of(name)
    if quant.excluded(module):
        raise FormatError(f"stored as {fmt.name} but quantization_config excludes this module", tensor=name)
    expected = quant.expected_format(module)
    if expected is not None and expected != fmt.name:
        raise FormatError(f"stored as {fmt.name} but quantization_config says {expected}", tensor=name)
    return fmt


def _detect_fp8(weight: StoredTensor, scales: dict[str, StoredTensor], quant: QuantConfig) -> WeightFormat:
    out, cols = weight.shape
    if "weight_scale_inv" in scales:
        s = scales["weight_scale_inv"]
        bo, bi = quant.fp8_block
        want = (math.ceil(out / bo), math.ceil(cols / bi))
        if s.dtype != "F32" or s.shape != want:
            raise FormatError(
                f"fp8 block scale must be F32 {want} for weight {weight.shape} and block {[bo, bi]}, "
                f"got {s.dtype} {s.shape}",
                tensor=s.name,
            )
        return WeightFormat("fp8-block", weight.name, s.name, (bo, bi))
    if "weight_scale" in scales:
        s = scales["weight_scale"]
        if s.dtype != "F32" or s.shape not in ((out,), (out, 1)):
            raise FormatError(
                f"fp8 per-channel scale must be F32 ({out},) or ({out}, 1), got {s.dtype} {s.shape}"
                " (per-tensor FP8 is not supported)",
                tensor=s.name,
            )
        return WeightFormat("fp8-channel", weight.name, s.name)
    raise FormatError("F8_E4M3 weight without weight_scale_inv or weight_scale", tensor=weight.name)


def dequantize(fmt: WeightFormat, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Stored tensors -> float32 ``[out, in]`` module weight as the format defines it (FP8: the exact product
    rounded once to float32)."""
    if fmt.name in FLOAT_DTYPES:
        return weight.to(torch.float32)
    if fmt.name == "fp8-block":
        return fp8.dequantize_block(weight, scale, fmt.block)
    if fmt.name == "fp8-channel":
        return fp8.dequantize_channel(weight, scale)
    if fmt.name == "mxfp4":
        return mxfp4.dequantize(weight, scale, axis=-1)
    raise FormatError(f"unknown format {fmt.name!r}", tensor=fmt.weight)


# ---- encoders (used by synthetic checkpoints) -------------------------------------------------------


def encode_fp8_block(w: torch.Tensor, block: tuple[int, int] = DEFAULT_FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[out, in]`` -> (F8_E4M3 weight, F32 ``weight_scale_inv`` ``[ceil(out/bo), ceil(in/bi)]``)."""
    out, cols = w.shape
    blocks = fp8.block_view(w.to(torch.float32), block)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(blocks.shape[0] * blocks.shape[1], -1)[:out, :cols].contiguous(), scale


def encode_fp8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[out, in]`` -> (F8_E4M3 weight, F32 ``weight_scale`` ``[out]``)."""
    amax = w.to(torch.float32).abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w.to(torch.float32) / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def encode_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[out, in]`` -> (U8 codes ``[out, in/2]``, U8 E8M0 scales ``[out, in/32]``), Quark's even rule."""
    return mxfp4.quantize(w, mode="even", axis=-1)


def encode(fmt: str, w: torch.Tensor, block: tuple[int, int] = DEFAULT_FP8_BLOCK) -> dict[str, torch.Tensor]:
    """float weight -> stored tensors keyed by suffix (``weight`` and, if any, its scale suffix)."""
    if fmt in FLOAT_DTYPES:
        return {"weight": w.to(DTYPES[FLOAT_DTYPES[fmt]][1])}
    if fmt == "fp8-block":
        q, s = encode_fp8_block(w, block)
        return {"weight": q, "weight_scale_inv": s}
    if fmt == "fp8-channel":
        q, s = encode_fp8_channel(w)
        return {"weight": q, "weight_scale": s}
    if fmt == "mxfp4":
        q, s = encode_mxfp4(w)
        return {"weight": q, "weight_scale": s}
    raise FormatError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")


def stored_specs(fmt: str, shape: tuple[int, int], block: tuple[int, int] = DEFAULT_FP8_BLOCK) -> dict[str, tuple]:
    """Suffix -> (safetensors dtype, shape) of what :func:`encode` produces for a weight of ``shape``."""
    out, cols = shape
    if fmt in FLOAT_DTYPES:
        return {"weight": (FLOAT_DTYPES[fmt], (out, cols))}
    if fmt == "fp8-block":
        return {
            "weight": ("F8_E4M3", (out, cols)),
            "weight_scale_inv": ("F32", (math.ceil(out / block[0]), math.ceil(cols / block[1]))),
        }
    if fmt == "fp8-channel":
        return {"weight": ("F8_E4M3", (out, cols)), "weight_scale": ("F32", (out,))}
    if fmt == "mxfp4":
        if cols % mxfp4.BLOCK:
            raise FormatError(f"MXFP4 needs in % 32 == 0, got shape {shape}")
        return {"weight": ("U8", (out, cols // 2)), "weight_scale": ("U8", (out, cols // mxfp4.BLOCK))}
    raise FormatError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
