"""One MLA layer at run time: absorbed K-up, sparse attention in the latent space, V-up.

Shapes (H = this rank's heads, T = tokens, L = kv_lora, P = nope, R = rope, V = v_head_dim):
``k_up``: q ``[T, H, P]`` or ``[T, H, P+R]`` -> latent ``[T, H, L]``; ``attend``: -> ``[T, H, L]``;
``v_up``: ``[T, H, L]`` -> ``[T, H, V]``. All bf16; outputs are batch-major ``[T, H, N]``.
"""

from __future__ import annotations

import contextlib
import numbers
from dataclasses import dataclass

import torch

from glm_pack.packing.errors import BackendError
from glm_pack.packing.mla import MlaGeometry
from glm_pack.runtime.backends.base import Backend
from glm_pack.runtime.reference import ACT_QUANT_MODES


@dataclass
class ProjectionWeights:
    """A loaded projection in ``bmm_nk`` layout: mxfp4 codes ``[H, N, k_stored/2]`` + scales, or bf16
    ``[H, N, k_stored]``."""

    precision: str
    weight: torch.Tensor
    scale: torch.Tensor | None
    k_logical: int
    k_stored: int
    rel_error: float


_FLOAT32_MAX = torch.finfo(torch.float32).max  # the attention scores are float32
_ALREADY_CURRENT = contextlib.nullcontext()  # one reusable no-op block: a new one per call costs ~0.3 us


def _storage_bytes(t: torch.Tensor) -> tuple[int, int]:
    """[first, end) byte addresses of ``t``'s whole storage."""
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _element_bytes(t: torch.Tensor) -> tuple[int, int]:
    """[first, end) byte addresses from ``t``'s first element to its last (empty for no elements)."""
    if not t.numel():
        return 0, 0
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _spans_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share memory: their storages' byte ranges intersect (separate allocations never
    do, the common case, decided by that alone), and so do the ranges from first to last element (views of one
    buffer whose elements interleave count too). Host arithmetic, no sync."""
    for span in (_storage_bytes, _element_bytes):
        (a0, a1), (b0, b1) = span(a), span(b)
        if not (a0 < b1 and b0 < a1):
            return False
    return True


def _may_overlap(t: torch.Tensor) -> bool:
    """Whether ``t``'s strides may map two of its elements to one place: unless each dimension's stride (smallest
    first) passes the reach of the smaller ones, as in any contiguous tensor, a permuted view or a slice of one
    (a stride 0 of ``expand`` is caught, and so are exotic layouts that happen not to collide)."""
    if t.is_contiguous():  # the common case, decided in C
        return False
    reach = 0
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def _float32_scale(value) -> float | None:
    """``value`` as a float when it is a real number (no bool) in ``(0, float32 max]``, else None."""
    if type(value) is float:  # the common case
        return value if 0 < value <= _FLOAT32_MAX else None
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return None
    try:
        scale = float(value)
    except (OverflowError, TypeError, ValueError):  # 10**400; a Real type whose float() fails
        return None
    return scale if 0 < scale <= _FLOAT32_MAX else None


class MlaLayer:
    """Absorbed-MLA operations of one layer for one tensor-parallel rank."""

    def __init__(
        self, layer: int, geometry: MlaGeometry, w_kc: ProjectionWeights, w_vc: ProjectionWeights, backend: Backend
    ):
        self.layer = layer
        self.geometry = geometry  # num_heads is this rank's head count
        self.w_kc = w_kc
        self.w_vc = w_vc
        self.backend = backend
        self.device = w_kc.weight.device  # where the weights are; every tensor argument must be there too

    def _check_tensor(self, t: torch.Tensor, name: str) -> None:
        """``t`` is a tensor on the layer's device (no backend checks it before its kernels run: the torch backend
        raised deep inside an op, or returned zeros for a cache on the meta device) that asks for no gradient while
        autograd records (the ops have no backward: the torch backend's output claimed one and gave zeros)."""
        if not isinstance(t, torch.Tensor):
            raise BackendError(f"layer {self.layer}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != self.device:
            raise BackendError(
                f"layer {self.layer}: {name} is on {t.device}, but the layer's weights are on {self.device} "
                "(the device given to open())"
            )
        if t.requires_grad and torch.is_grad_enabled():
            raise BackendError(
                f"layer {self.layer}: {name} requires grad, but these operations are inference-only (no backward): "
                f"call them under torch.inference_mode() or torch.no_grad(), or pass {name}.detach()"
            )

    def _on_device(self) -> contextlib.AbstractContextManager:
        """The layer's GPU made the current device for a backend call, when it is not already: Triton and aiter
        launch on the current device (and its current stream) whatever device the tensors are on."""
        if self.device.type == "cuda" and torch.cuda.current_device() != self.device.index:
            return torch.cuda.device(self.device)
        return _ALREADY_CURRENT

    def _name_layer(self, err: BackendError, op: str = "") -> None:
        """Lead the message of ``err``, a backend's error (its checks know no layer), with this layer (and ``op``)
        like the layer's own (a try block costs next to nothing until it catches: the GEMM calls keep their host
        time)."""
        err.message = f"layer {self.layer}{' ' + op if op else ''}: {err.message}"

    def _check_act(self, t: torch.Tensor, name: str, width: int | None = None) -> None:
        g = self.geometry
        self._check_tensor(t, name)
        if t.dim() != 3 or t.shape[1] != g.num_heads or t.dtype != torch.bfloat16:
            raise BackendError(
                f"layer {self.layer}: {name} must be bf16 [T, {g.num_heads}, ...], got {t.dtype} {tuple(t.shape)}"
            )
        if width is not None and t.shape[-1] != width:
            raise BackendError(f"layer {self.layer}: {name} must be {width} wide, got {t.shape[-1]}")

    def _bmm(self, proj: ProjectionWeights, x_thk: torch.Tensor, out_thn: torch.Tensor, op: str, act_quant: str):
        if act_quant not in ACT_QUANT_MODES:
            raise BackendError(f"layer {self.layer}: act_quant must be one of {ACT_QUANT_MODES}, got {act_quant!r}")
        if x_thk.shape[-1] != proj.k_stored:  # aiter does not check this and returns garbage
            raise BackendError(f"layer {self.layer} {op}: x has K={x_thk.shape[-1]}, weight stores K={proj.k_stored}")
        x, out = x_thk.transpose(0, 1), out_thn.transpose(0, 1)
        with self._on_device():
            try:
                if proj.precision == "mxfp4":
                    self.backend.bmm_a16wfp4(x, proj.weight, proj.scale, out, op=op, act_quant=act_quant)
                else:
                    self.backend.bmm_bf16(x, proj.weight, out)
            except BackendError as err:
                self._name_layer(err, op)
                raise

    def _check_out(self, out: torch.Tensor, shape: tuple[int, ...]) -> None:
        """``out`` can take a ``shape`` bf16 result: each element its own memory, writable in this mode."""
        self._check_tensor(out, "out")
        if tuple(out.shape) != shape or out.dtype != torch.bfloat16:
            raise BackendError(f"layer {self.layer}: out must be bf16 {shape}, got {out.dtype} {tuple(out.shape)}")
        if _may_overlap(out):
            raise BackendError(
                f"layer {self.layer}: out's strides {out.stride()} can give two elements one memory location (as "
                "from expand or as_strided): each output element needs its own"
            )
        if out.is_inference() and not torch.is_inference_mode_enabled():
            raise BackendError(
                f"layer {self.layer}: out was made under torch.inference_mode() and cannot be written outside it"
            )

    def k_input(self, q: torch.Tensor) -> torch.Tensor:
        """The x the K-up kernel gets (K == k_stored) from q ``[T, H, P]`` or ``[T, H, P+R]``: q itself when it has
        that width (zero copy: the full row against a w_kc padded to nope+rope, whose zero weights meet the rope
        part), else q_nope (a view when w_kc is unpadded) zero-padded to k_stored."""
        g, kc = self.geometry, self.w_kc
        P = g.qk_nope_head_dim
        self._check_act(q, "q")
        width = q.shape[-1]
        if width not in (P, P + g.qk_rope_head_dim):  # also a width equal to a padded K (a latent against K 512)
            widths = (
                f"[T, H, {P}] (nope) or [T, H, {P + g.qk_rope_head_dim}] (nope+rope)"
                if g.qk_rope_head_dim
                else f"[T, H, {P}] (nope; this model is rope-free)"
            )
            raise BackendError(f"layer {self.layer}: q must be {widths}, got width {width}")
        if width == kc.k_stored:
            return q
        nope = q[..., :P]
        return nope if kc.k_stored == P else torch.nn.functional.pad(nope, (0, kc.k_stored - P))

    def k_up(self, q: torch.Tensor, *, act_quant: str = "mxfp4") -> torch.Tensor:
        """q_nope (or the full q row) ``[T, H, P(+R)]`` -> latent ``[T, H, L]`` bf16."""
        x = self.k_input(q)
        out = torch.empty(
            q.shape[0], self.geometry.num_heads, self.geometry.kv_lora_rank, dtype=torch.bfloat16, device=q.device
        )
        self._bmm(self.w_kc, x, out, "k_up", act_quant)
        return out

    def v_up(self, latent: torch.Tensor, out: torch.Tensor | None = None, *, act_quant: str = "mxfp4") -> torch.Tensor:
        """Attention output in latent space ``[T, H, L]`` -> ``[T, H, V]`` bf16, written into ``out`` if given (an
        ``out`` sharing memory with ``latent``, e.g. a view of it, is written through a temporary copy)."""
        g = self.geometry
        self._check_act(latent, "latent", g.kv_lora_rank)
        shape = (latent.shape[0], g.num_heads, g.v_head_dim)
        if out is not None:
            self._check_out(out, shape)
        # an out sharing latent's memory is not written directly: a kernel's programs would read others' results
        direct = out is not None and not _spans_overlap(out, latent)
        y = out if direct else torch.empty(shape, dtype=torch.bfloat16, device=latent.device)
        self._bmm(self.w_vc, latent, y, "v_up", act_quant)
        if out is None:
            return y
        if not direct:
            out.copy_(y)
        return out

    def attend(
        self, q_latent, kv_cache, kv_indptr, kv_indices, softmax_scale: float, *, q_rope=None, return_lse: bool = False
    ):
        """Sparse MLA over top-k rows of a BF16 latent cache (row L, or L+R with rope) -> ``[T, H, L]`` bf16
        (and lse ``[T, H]`` float32 when ``return_lse``). FP8 caches are not supported.

        q_latent ``[T, H, L]`` bf16 (``k_up``'s output); q_rope ``[T, H, R]`` bf16, rope applied (None when rope-free);
        kv_cache bf16 ``[slots, L+R]`` (also paged ``[blocks, block, L+R]`` or ``[slots, 1, 1, L+R]``), each row
        ``[latent | k_rope]``; token t attends to the slots ``kv_indices[kv_indptr[t]:kv_indptr[t+1]]``: kv_indptr
        ``[T+1]`` int32, kv_indices flat int32 global slot ids (-1: skip); softmax_scale the model's, a real number in
        (0, float32 max]."""
        g = self.geometry
        self._check_act(q_latent, "q_latent", g.kv_lora_rank)
        if g.qk_rope_head_dim:
            if q_rope is None:
                raise BackendError(f"layer {self.layer}: this model has rope; pass q_rope [T, H, {g.qk_rope_head_dim}]")
            self._check_act(q_rope, "q_rope", g.qk_rope_head_dim)
            if q_rope.shape[0] != q_latent.shape[0]:
                raise BackendError(
                    f"layer {self.layer}: q_rope has {q_rope.shape[0]} tokens, q_latent {q_latent.shape[0]}"
                )
        elif q_rope is not None:
            raise BackendError(f"layer {self.layer}: this model is rope-free; q_rope must be None")
        for name, t in (("kv_cache", kv_cache), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
            self._check_tensor(t, name)
        if kv_cache.dtype != torch.bfloat16:
            raise BackendError(
                f"layer {self.layer}: kv_cache must be bf16 (FP8 caches are not supported yet), got {kv_cache.dtype}"
            )
        if kv_cache.dim() not in (2, 3, 4) or kv_cache.shape[-1] != g.cache_row:
            raise BackendError(
                f"layer {self.layer}: kv_cache must be [slots, {g.cache_row}], [blocks, block, {g.cache_row}] or "
                f"[slots, 1, 1, {g.cache_row}], got {tuple(kv_cache.shape)}"
            )
        for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
            if t.dtype != torch.int32:  # e.g. torch.topk's int64 ids
                raise BackendError(f"layer {self.layer}: {name} must be int32, got {t.dtype}")
        if kv_indices.dim() != 1:
            raise BackendError(
                f"layer {self.layer}: kv_indices must be flat (1-D) global slot ids, got {tuple(kv_indices.shape)}"
            )
        scale = _float32_scale(softmax_scale)
        if scale is None:  # 0 would flatten every softmax; beyond float32's range the float32 scores are inf or NaN
            tensor = isinstance(softmax_scale, torch.Tensor)
            hint = " (a tensor, not a number: pass float(softmax_scale))" if tensor else ""
            raise BackendError(
                f"layer {self.layer}: softmax_scale must be a positive number within float32's range, got "
                f"{softmax_scale!r:.80}{hint}"
            )
        if not isinstance(return_lse, bool):  # "no" would be truthy
            raise BackendError(f"layer {self.layer}: return_lse must be True or False, got {return_lse!r}")
        if kv_indptr.shape != (q_latent.shape[0] + 1,):
            raise BackendError(
                f"layer {self.layer}: kv_indptr must be [T+1] = [{q_latent.shape[0] + 1}], got {tuple(kv_indptr.shape)}"
            )
        with self._on_device():
            try:
                out, lse = self.backend.sparse_mla(
                    q_latent, q_rope, kv_cache, kv_indptr, kv_indices, scale, return_lse=return_lse
                )
            except BackendError as err:
                self._name_layer(err)
                raise
        return (out, lse) if return_lse else out
