"""Open a local checkpoint directory: config, index, headers, family card; read tensors lazily, one at a time.

:func:`open_checkpoint` reads config.json, ``model.safetensors.index.json`` (or a single
``model.safetensors``), and every shard's header (never tensor data), then checks that the index and the
shards agree and that each tensor the card knows has the shape config.json implies. Tensor bytes are
read only on request, exactly one tensor's byte range at a time. Hugging Face cache snapshots (files that
are symlinks to blobs) work unchanged. File access goes through a store (:class:`LocalStore`: ``exists``,
``read_text``, ``open`` -> :class:`~.safetensors_io.ByteSource`), the seam where a Hub source plugs in.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from glm_pack.packing import mxfp4
from glm_pack.packing.errors import CheckpointError, FormatError, GlmPackError, NonFiniteError
from glm_pack.packing.manifest import INDEX_NAME, OVERLAY_DIR, SINGLE_NAME
from glm_pack.packing.mla import MlaGeometry

from . import formats
from .cards import Card, detect_card, load_card
from .safetensors_io import Header, LocalFile, TensorEntry, parse_header, read_tensor
from .writer import sha256_tensor


class LocalStore:
    """A checkpoint directory on local disk; names are relative to ``root``."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def where(self, rel: str) -> str:
        return str(self.root / rel)

    def exists(self, rel: str) -> bool:
        return (self.root / rel).is_file()

    def read_text(self, rel: str) -> str:
        try:
            return (self.root / rel).read_text(encoding="utf-8")
        except FileNotFoundError as err:
            raise CheckpointError("file is missing", file=self.where(rel)) from err
        except (OSError, UnicodeDecodeError) as err:
            raise CheckpointError(f"cannot read: {err}", file=self.where(rel)) from err

    def open(self, rel: str) -> LocalFile:
        return LocalFile(self.root / rel, name=self.where(rel))

    def safetensors_files(self) -> list[str]:
        return sorted(p.name for p in self.root.glob("*.safetensors") if p.is_file())

    def list_files(self) -> list[tuple[str, int]]:
        """Every regular file under the root (symlinks followed; hidden and ``glm-pack/`` skipped), with sizes.

        A symlink that resolves to nothing (a HF cache snapshot whose blob never finished downloading), or a folder
        that cannot be listed or a file that cannot be looked at (a permission, an I/O error), is refused: a
        conversion's output would silently lack those files."""
        out = []
        for path in walk_files(self.root, is_original, CheckpointError, "the source"):
            rel = path.relative_to(self.root)
            try:
                if path.is_file():
                    out.append((rel.as_posix(), path.stat().st_size))
                elif path.is_symlink() and not path.exists():
                    raise CheckpointError(
                        f"broken symlink in the source: it points to {os.readlink(path)}, which is missing or cannot "
                        "be resolved (an unfinished download?); restore the file or remove the link",
                        file=str(path),
                    )
            except OSError as err:  # in a folder this user may list but not enter (chmod -R 644), an I/O error
                raise CheckpointError(f"cannot read: {err.strerror or err}", file=str(path)) from err
        return out


@dataclass(frozen=True)
class TensorInfo(TensorEntry):
    """A header entry plus ``file``, the shard it lives in (relative to the root)."""

    file: str = ""


def _load_json(store: LocalStore, rel: str) -> dict:
    try:
        data = json.loads(store.read_text(rel))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"invalid JSON: {err}", file=store.where(rel)) from err
    if not isinstance(data, dict):
        raise CheckpointError("expected a JSON object", file=store.where(rel))
    return data


def walk_files(root: Path, keep, error: type[GlmPackError], what: str) -> list[Path]:
    """Sorted paths of the entries under ``root`` that are no folder (files, links to files, broken links) whose parts
    relative to it ``keep`` accepts; only folders it accepts are entered, linked ones too (their files are part of
    the checkpoint, as a linked file's are). A folder that cannot be listed (a permission, an I/O error), or a
    folder link leading back to a folder it lies in (the walk would never end), raises ``error`` naming it and
    ``what`` holds it (skipped, its files would be silently missing from what is made of the listing)."""

    def unlisted(err: OSError):
        raise error(f"cannot list this folder of {what}: {err.strerror or err}", file=err.filename)

    paths = []
    chains = {os.fspath(root): (os.path.realpath(root),)}  # folder -> the real paths of it and the folders above it
    for folder, dirs, files in os.walk(root, onerror=unlisted, followlinks=True):
        chain = chains.pop(folder)
        parts = Path(folder).relative_to(root).parts
        dirs[:] = [d for d in dirs if keep((*parts, d))]
        for d in dirs:
            real = os.path.realpath(os.path.join(folder, d))
            if real in chain:
                raise error(
                    f"a folder link in {what} leads back to a folder it lies in ({real}); remove the link",
                    file=os.path.join(folder, d),
                )
            chains[os.path.join(folder, d)] = (*chain, real)
        paths += [Path(folder, name) for name in files if keep((*parts, name))]
    return sorted(paths)


def is_original(parts) -> bool:
    """Whether a source path, split into its parts, names an original convert places in OUT: some parts, none empty
    or hidden (``.cache/``, ``.git/``), not under ``glm-pack/`` (an overlay inside the source)."""
    return bool(parts) and parts[0] != OVERLAY_DIR and not any(not p or p.startswith(".") for p in parts)


def _inside(store: LocalStore, rel) -> bool:
    """Whether an index entry names a file inside the checkpoint that convert would place in OUT: a relative
    path without empty, hidden, ``.`` or ``..`` parts, not under ``glm-pack/``, on local disk not reached
    through a linked folder (the file itself may be a link, as in a Hugging Face cache snapshot)."""
    parts = rel.split("/") if isinstance(rel, str) else []
    if not is_original(parts) or "\\" in rel:  # a non-string rel has no parts
        return False
    if isinstance(store, LocalStore):
        return (store.root / rel).parent.resolve() == store.root.resolve().joinpath(*parts[:-1])
    return True


def _weight_map(store: LocalStore) -> tuple[dict[str, str], Path | None, dict[str, Header]]:
    """(tensor -> shard, the index's path or None, the shard headers parsed on the way: all of them where there is
    no index, whose map then comes from the headers; none otherwise)."""
    if store.exists(INDEX_NAME):
        index = _load_json(store, INDEX_NAME)
        wm = index.get("weight_map")
        if not isinstance(wm, dict):
            raise CheckpointError("weight_map must map tensor names to file names", file=store.where(INDEX_NAME))
        seen = set()
        for tensor, rel in wm.items():
            if not (isinstance(rel, str) and rel in seen or _inside(store, rel)):
                raise CheckpointError(
                    f"the index maps this tensor to {rel!r:.80}, not a file name inside the checkpoint",
                    file=store.where(INDEX_NAME),
                    tensor=tensor,
                )
            seen.add(rel)
        return dict(wm), store.root / INDEX_NAME, {}
    names = [SINGLE_NAME] if store.exists(SINGLE_NAME) else store.safetensors_files()
    if not names:
        raise CheckpointError(f"no {INDEX_NAME} and no *.safetensors file", file=str(store.root))
    headers = {rel: parse_header(store.open(rel)) for rel in names}
    return _tensor_files(store, headers), None, headers


def _tensor_files(store: LocalStore, headers: dict[str, Header]) -> dict[str, str]:
    """{tensor: shard} from the shards' headers; CheckpointError for a tensor that two shards hold (which copy
    an engine loads would depend on how it reads the checkpoint)."""
    found: dict[str, str] = {}
    for rel, header in headers.items():
        for tensor in header.tensors:
            first = found.setdefault(tensor, rel)
            if first != rel:
                raise CheckpointError(
                    f"two shards hold this tensor: {store.where(first)} and {store.where(rel)}",
                    file=store.where(rel),
                    tensor=tensor,
                )
    return found


class Checkpoint:
    """A local checkpoint: config, card, geometry, index, headers; tensors read lazily."""

    def __init__(
        self,
        store: LocalStore,
        config: dict,
        card: Card,
        weight_map: dict[str, str],
        index_path,
        headers: dict[str, Header] | None = None,
    ):
        """``headers``: shard headers already parsed (by ``_weight_map``), which are not read again."""
        self.store = store
        self.root = store.root
        self.config = config
        self.card = card
        self.weight_map = weight_map
        self.index_path: Path | None = index_path
        self.files: list[str] = list(dict.fromkeys(weight_map.values()))
        self.quant_config: dict | None = config.get("quantization_config")
        self.quant = formats.QuantConfig(self.quant_config)
        self.headers: dict[str, Header] = {}
        self._formats: dict[str, formats.WeightFormat] = {}
        first: dict[str, str] = {}  # shard -> the first tensor the index maps to it
        for tensor, rel in weight_map.items():
            first.setdefault(rel, tensor)
        for rel in self.files:
            if headers and rel in headers:
                self.headers[rel] = headers[rel]
                continue
            if not store.exists(rel):
                raise CheckpointError("shard named by the index is missing", file=store.where(rel), tensor=first[rel])
            self.headers[rel] = parse_header(store.open(rel))
        if not headers:  # without an index, _weight_map built the map from these headers with this very check
            _tensor_files(store, self.headers)
        for tensor, rel in weight_map.items():
            if tensor not in self.headers[rel].tensors:
                raise CheckpointError(
                    "the index names this tensor but its shard lacks it", file=store.where(rel), tensor=tensor
                )
        self.geometry: MlaGeometry = card.geometry(config)
        self.layer_plan = card.layer_plan(config)
        self._check_against_card()

    # ---- names and infos -----------------------------------------------------------------------
    @property
    def map_file(self) -> str:
        """Where the tensor names come from, for errors about them: the index, or the folder without one."""
        return str(self.index_path or self.root)

    def names(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def info(self, name: str) -> TensorInfo:
        rel = self.weight_map.get(name)
        if rel is None:
            raise CheckpointError(
                "no such tensor in the checkpoint", file=self.map_file, tensor=name
            )
        e = self.headers[rel].tensors[name]
        return TensorInfo(name, e.dtype, e.shape, e.begin, e.end, file=rel)

    def file_size(self, rel: str) -> int:
        return self.store.open(rel).size()

    def mla_layers(self) -> list[int]:
        """The card's MLA layers that this checkpoint holds (an export may drop the MTP layer)."""
        return [layer for layer in self.layer_plan.mla if self.card.kv_b_proj(layer) in self.weight_map]

    # ---- raw reads -----------------------------------------------------------------------------
    def read_raw(self, name: str) -> torch.Tensor:
        """The stored tensor (its dtype and shape), reading only its own bytes."""
        info = self.info(name)
        return read_tensor(self.store.open(info.file), self.headers[info.file].tensors[name])

    def raw_sha256(self, name: str) -> str:
        info = self.info(name)
        return hashlib.sha256(self.store.open(info.file).read(info.begin, info.nbytes)).hexdigest()

    # ---- formats -------------------------------------------------------------------------------
    def _stored(self, name: str) -> formats.StoredTensor:
        info = self.info(name)
        return formats.StoredTensor(name, info.dtype, info.shape)

    def format_of(self, weight_name: str) -> formats.WeightFormat:
        if weight_name not in self._formats:
            module = formats.module_of(weight_name)
            scales = {
                s: self._stored(f"{module}.{s}") for s in formats.SCALE_SUFFIXES if f"{module}.{s}" in self.weight_map
            }
            try:
                self._formats[weight_name] = formats.detect(self._stored(weight_name), scales, self.quant)
            except GlmPackError as err:  # in the shard of the tensor at fault (the weight, or its scale)
                blamed = err.tensor if err.tensor in self.weight_map else weight_name
                err.file = err.file or self.store.where(self.info(blamed).file)
                raise
        return self._formats[weight_name]

    def weight_format(self, weight_name: str) -> str:
        """One of ``formats.FORMATS`` for a module weight ``<module>.weight``."""
        return self.format_of(weight_name).name

    def source_tensors(self, weight_name: str) -> list[str]:
        """The stored tensors the module weight is decoded from: the weight and its scale, if any."""
        return self.format_of(weight_name).tensors

    def read_float(self, weight_name: str, *, digests: dict[str, str] | None = None) -> torch.Tensor:
        """The module weight dequantized to float32 ``[out, in]`` (never through bf16; exact, FP8 rounded once).

        ``digests``: filled with the sha256 of each stored tensor read (the same bytes, no second read).
        """
        return self.read_float_and_mxfp4(weight_name, digests=digests)[0]

    def read_float_and_mxfp4(
        self, weight_name: str, *, digests: dict[str, str] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """``read_float``'s float32 ``[out, in]``, and for an MXFP4 weight also ``read_mxfp4``'s stored (codes,
        scales), both from one read of the stored bytes; None for the second for any other format."""
        fmt = self.format_of(weight_name)
        scale = self.read_scale(fmt) if fmt.scale else None
        weight = self.read_raw(fmt.weight)
        _record_digests(digests, ((fmt.weight, weight), (fmt.scale, scale)))
        dequantized = formats.dequantize(fmt, weight, scale)
        if scale is not None:
            self._check_scaled(fmt, weight, dequantized)
        return dequantized, ((weight, scale) if fmt.name == "mxfp4" else None)

    def _check_scaled(self, fmt: formats.WeightFormat, weight: torch.Tensor, dequantized: torch.Tensor) -> None:
        """NonFiniteError naming the scale tensor and its shard where finite stored weight values times their finite
        scales overflow float32 (a scale out of range: 1e38, E8M0 2^127); a weight holding NaN/Inf itself is left
        to the caller's check, which names the weight."""
        try:
            mxfp4.check_finite(dequantized, "the scaled weight")
        except GlmPackError as err:
            if fmt.name != "mxfp4":  # e2m1 codes are always finite
                try:
                    mxfp4.check_finite(weight)
                except GlmPackError:
                    return
            raise NonFiniteError(
                f"this scale overflows float32 when applied: {err}",
                file=self.store.where(self.info(fmt.scale).file),
                tensor=fmt.scale,
            ) from None

    def read_mxfp4(
        self, weight_name: str, *, digests: dict[str, str] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """An MXFP4 weight as stored: (codes u8 ``[out, in/2]``, E8M0 scales u8 ``[out, in/32]``).

        ``digests``: filled with the sha256 of the codes and of the scales (the same bytes, no second read).
        """
        fmt = self.format_of(weight_name)
        if fmt.name != "mxfp4":
            raise FormatError(
                f"read_mxfp4 needs an mxfp4 weight, this one is {fmt.name}",
                file=self.store.where(self.info(weight_name).file),
                tensor=weight_name,
            )
        codes, scales = self.read_raw(fmt.weight), self.read_scale(fmt)
        _record_digests(digests, ((fmt.weight, codes), (fmt.scale, scales)))
        return codes, scales

    def read_scale(self, fmt: formats.WeightFormat) -> torch.Tensor:
        """The stored scale tensor of ``fmt``; NonFiniteError naming it and its shard if it holds NaN/Inf (for
        MXFP4, E8M0 byte 0xFF): a bad scale is the scale's fault, not the weight's."""
        scale = self.read_raw(fmt.scale)
        try:
            if fmt.name == "mxfp4":
                mxfp4.check_scale_bytes(scale)
            else:
                mxfp4.check_finite(scale, "scale")
        except GlmPackError as err:
            err.file, err.tensor = self.store.where(self.info(fmt.scale).file), fmt.scale
            raise
        return scale

    # ---- consistency with the card -------------------------------------------------------------
    def expected_shapes(self) -> dict[str, tuple[tuple[int, ...], bool]]:
        """Tensor name -> (logical shape from config.json, is a Linear weight) for every tensor the card knows."""
        return {name: (shape, t.is_linear) for name, t, shape in self.card.iter_tensors(self.config)}

    def missing_tensors(self) -> list[str]:
        """Tensors config.json implies (through the card) that the checkpoint lacks, in the card's order. An MTP
        layer left out altogether (exports often drop it; none of its layers is converted then) is not counted."""
        held = {self.card.layer_of(name) for name in self.weight_map}
        mtp = set(self.layer_plan.mtp)
        return [
            name
            for name in self.expected_shapes()
            if name not in self.weight_map and self.card.layer_of(name) not in mtp - held
        ]

    def _check_layers_held(self) -> None:
        """CheckpointError naming a tensor of a layer config.json does not have (a layer count that contradicts the
        weights: the extra layer would be neither converted nor served)."""
        plan, spec = self.layer_plan, self.card.layers_spec
        known, stray = set(plan.all), {}  # layer -> its first tensor
        for name in self.weight_map:
            layer = self.card.layer_of(name)
            if layer is not None and layer not in known:
                stray.setdefault(layer, name)
        if stray:
            layer = min(stray)
            counts = f"{spec['count_key']} {plan.num_layers}"
            if spec.get("mtp_count_key"):
                counts += f", {spec['mtp_count_key']} {len(plan.mtp)}"
            raise CheckpointError(
                f"the checkpoint holds layer {layer}, which config.json does not have ({counts}): the config and "
                "the weights disagree",
                file=self.map_file,
                tensor=stray[layer],
            )

    def _check_against_card(self) -> None:
        self._check_layers_held()
        for layer in self.layer_plan.mla:
            name = self.card.kv_b_proj(layer)
            if name not in self.weight_map and layer not in self.layer_plan.mtp:
                raise CheckpointError(
                    f"MLA layer {layer} has no kv_b_proj (card {self.card.name})",
                    file=self.map_file,
                    tensor=name,
                )
        for name, (shape, linear) in self.expected_shapes().items():
            if name not in self.weight_map:
                continue
            stored = self.info(name).shape
            want, how = shape, "from config.json"
            if linear:
                fmt = self.format_of(name)
                want = formats.stored_specs(fmt.name, shape, fmt.block or formats.DEFAULT_FP8_BLOCK)["weight"][1]
                how = f"for {fmt.name} of logical {shape} from config.json"
            if tuple(stored) != tuple(want):
                raise CheckpointError(
                    f"shape {tuple(stored)} contradicts the config: expected {tuple(want)} {how}",
                    file=self.store.where(self.info(name).file),
                    tensor=name,
                )


def _record_digests(digests: dict[str, str] | None, tensors) -> None:
    """Put the sha256 of each stored ``(name, tensor)``'s bytes into ``digests`` (nothing when it is None; a None
    tensor, an absent scale, is skipped)."""
    if digests is not None:
        for name, raw in tensors:
            if raw is not None:
                digests[name] = sha256_tensor(raw)


def hub_spec(src: str | os.PathLike) -> tuple[str, str | None] | None:
    """``(repo_id, revision or None)`` when ``src`` names a Hub repo rather than a local directory (see
    :func:`.hub_source.parse_repo_spec`; nothing is requested from the Hub), else None."""
    root = Path(src)
    try:
        if root.is_dir():
            return None
    except OSError as err:  # in a folder this user cannot enter (another user's home), an I/O error
        raise CheckpointError(f"cannot read: {err.strerror or err}", file=str(root)) from err
    from .hub_source import parse_repo_spec

    return parse_repo_spec(src)


def open_checkpoint(src: str | os.PathLike, *, card: str | None = None) -> Checkpoint:
    """Open a local checkpoint directory, or a Hub repo ``org/name[@revision]`` (read by byte ranges, see
    :mod:`.hub_source`); ``card`` forces a family instead of detecting it from config.json."""
    root = Path(src)
    spec = hub_spec(src)
    if spec is not None:
        from .hub_source import HUB_PREFIX, HubStore

        store = HubStore(*spec, explicit=os.fspath(src).startswith(HUB_PREFIX))
    elif root.is_dir():
        store = LocalStore(root)
        if not os.path.lexists(root / "config.json"):  # an empty or wrong folder (a dangling link is "missing")
            raise CheckpointError("not a checkpoint directory: it has no config.json", file=str(root))
    else:
        why = "is a file" if root.exists() else "does not exist"
        raise CheckpointError(f"not a checkpoint directory: the path {why}", file=str(root))
    config = _load_json(store, "config.json")
    try:
        family = load_card(card) if card else detect_card(config)
        return Checkpoint(store, config, family, *_weight_map(store))
    except GlmPackError as err:
        if err.file == "config.json":
            err.file = store.where("config.json")
        raise
