"""Model-family cards: ``cards/*.toml`` (data only) loaded into :class:`Card`.

A card says how to recognise a family (``[detect]``), where its MLA geometry lives in config.json
(``[geometry]``: MlaGeometry field -> config key; never ``head_dim``), which layers carry what
(``[layers]``: selectors, see :func:`select_layers`), every tensor a checkpoint of the family holds
(``[[tensors]]``: name template, shape expressions over config keys, dtype, role, scope), the default
recipe (``[recipe]``), per-arch kernel configs for each route (``[kernels]``) and what synthetic
checkpoints use (``[synth]``: the full config, the small profile's overrides, documented assumptions; those
about the MTP layer have keys ``mtp_*``).

Layer selectors are tried in order; the first whose config key exists decides:
``{all = true}``; ``{list_key = K}`` (config[K] lists layer ids); ``{types_key = K, types = [...]}``
(config[K][i] in types; with ``letters = {F = "full", ...}`` config[K] may also be a string of one letter a
layer, e.g. ``"FFSS..."``); ``{first_k_key = K}`` (i < config[K]); ``{freq_key = F, offset_key = O}``
(IndexShare: ``max(i - O + 1, 0) % F == 0``; as in transformers' GlmMoeDsaConfig, O defaults to 2 and F < 1
counts as 1); ``{every = n, offset = o}`` (i % n == o; an assumption).

Tensor scopes: ``global`` (absolute name, once), ``layer`` (every decoder and MTP layer), ``mla``,
``linear_attn`` (layers without MLA), ``indexer``, ``dense`` (dense-MLP layers), ``moe`` (MoE layers,
MTP included), ``expert`` (each routed expert ``{e}`` of a MoE layer), ``mtp``. Names of layer scopes are
relative to :meth:`Card.layer_prefix`. Roles: ``attn``, ``indexer``, ``mlp``, ``expert`` (Linear weights a
quantized export may store quantized), ``router``, ``embed``, ``head``, ``norm``, ``other``.

Every config.json value is type-checked where it is read (:mod:`~glm_pack.convert.config_values`): a
wrong type (a float or bool for an integer, a string for a list, ...) is a CheckpointError naming the key and
the value.
"""

from __future__ import annotations

import ast
import functools
import operator
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from glm_pack.packing.errors import CheckpointError, PlanError
from glm_pack.packing.manifest import AITER_BMM_CONFIG_KEYS
from glm_pack.packing.mla import MlaGeometry

from .config_values import config_value

ROUTES = ("padded", "unpadded")
LINEAR_ROLES = ("attn", "indexer", "mlp", "expert")
SCOPES = ("global", "layer", "mla", "linear_attn", "indexer", "dense", "moe", "expert", "mtp")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


@dataclass(frozen=True)
class TensorTemplate:
    name: str
    shape: tuple
    dtype: str
    role: str
    scope: str

    @property
    def is_linear(self) -> bool:
        return self.role in LINEAR_ROLES and self.name.endswith(".weight") and len(self.shape) == 2


@dataclass(frozen=True)
class LayerPlan:
    """Which layers of one checkpoint carry what (layer ids; MTP layers follow the decoder layers)."""

    num_layers: int
    mtp: tuple[int, ...]
    mla: tuple[int, ...]
    dense: tuple[int, ...]
    moe: tuple[int, ...]
    indexer: tuple[int, ...]

    @property
    def all(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers)) + self.mtp


def eval_expr(expr, values: dict, where: str) -> int:
    """Integer arithmetic (+ - * // and parentheses) over config keys; ints pass through."""
    if isinstance(expr, bool):
        raise PlanError(f"{where}: unsupported expression {expr!r}")
    if isinstance(expr, int):
        return expr

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name):
            return config_value(values.get(node.id), node.id, int)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise PlanError(f"{where}: unsupported expression {expr!r}")

    try:
        tree = ast.parse(str(expr), mode="eval")
    except SyntaxError as err:
        raise PlanError(f"{where}: bad expression {expr!r}") from err
    return ev(tree)


def select_layers(selectors: list[dict], cfg: dict, n: int, what: str) -> set[int] | None:
    """Layer ids among ``range(n)`` chosen by the first applicable selector (None when none applies)."""
    for sel in selectors:
        if sel.get("all"):
            return set(range(n))
        if "list_key" in sel and sel["list_key"] in cfg:
            return {i for i in config_value(cfg[sel["list_key"]], sel["list_key"], list, item=int) if 0 <= i < n}
        if "types_key" in sel and sel["types_key"] in cfg:
            key, types, letters = sel["types_key"], cfg[sel["types_key"]], sel.get("letters", {})
            if letters and isinstance(types, str):
                if not set(types) <= set(letters):
                    letters_only = f"a string of the letters {''.join(letters)}"
                    raise CheckpointError(f"{key} must be {letters_only}, got {types[:80]!r}", file="config.json")
                types = [letters[c] for c in types]
            types = config_value(types, key, list, item=str)
            if len(types) < n:
                raise CheckpointError(
                    f"{sel['types_key']} has {len(types)} entries for {n} layers ({what})", file="config.json"
                )
            return {i for i in range(n) if types[i] in sel["types"]}
        if "first_k_key" in sel and sel["first_k_key"] in cfg:
            return set(range(min(config_value(cfg[sel["first_k_key"]], sel["first_k_key"], int, minimum=0), n)))
        if "freq_key" in sel and sel["freq_key"] in cfg:
            freq = max(config_value(cfg[sel["freq_key"]], sel["freq_key"], int), 1)
            offset = config_value(cfg.get(sel["offset_key"]), sel["offset_key"], int, default=2)
            return {i for i in range(n) if max(i - offset + 1, 0) % freq == 0}
        if "every" in sel:
            return {i for i in range(n) if i % sel["every"] == sel["offset"]}
    return None


class Card:
    """One model family. Methods taking ``config`` read the text-model fields (see :meth:`text_config`)."""

    def __init__(self, data: dict, source: str):
        self.data = data
        self.source = source
        self.name: str = data["name"]
        self.title: str = data.get("title", self.name)
        self.detect_rules: dict = data["detect"]
        self.geometry_keys: dict = data["geometry"]
        self.layers_spec: dict = data["layers"]
        self.prefix: str = self.layers_spec["prefix"]
        self.recipe: dict = data.get("recipe", {})
        self.synth: dict = data.get("synth", {})
        self.assumptions: dict[str, str] = dict(self.synth.get("assumptions", {}))
        self.tensors = tuple(
            TensorTemplate(t["name"], tuple(t["shape"]), t.get("dtype", "BF16"), t.get("role", "other"), t["scope"])
            for t in data.get("tensors", [])
        )
        for t in self.tensors:
            if t.scope not in SCOPES:
                raise PlanError(f"card {self.name}: tensor {t.name} has unknown scope {t.scope!r}", file=source)
        self._check_kernels()

    def __repr__(self) -> str:
        return f"Card({self.name!r})"

    # ---- recognition and geometry ---------------------------------------------------------------
    def text_config(self, config: dict) -> dict:
        key = self.data.get("config", {}).get("text_config", "")
        return (config_value(config.get(key), key, dict, default=config) or config) if key else config

    def matches(self, config: dict) -> bool:
        text = self.text_config(config)
        rules = self.detect_rules
        arch = set(config_value(config.get("architectures"), "architectures", list, item=str, default=[]))
        model_type = config_value(config.get("model_type"), "model_type", str, default=None)
        if not (arch & set(rules.get("architectures", [])) or model_type in rules.get("model_types", [])):
            return False
        keys = set(config) | set(text)
        if rules.get("with_any_keys") and not keys & set(rules["with_any_keys"]):
            return False
        return not keys & set(rules.get("without_keys", []))

    def geometry(self, config: dict) -> MlaGeometry:
        text = self.text_config(config)
        values = {}
        for field_name, key in self.geometry_keys.items():
            values[field_name] = config_value(text.get(key), key, int)
        return MlaGeometry(**values)

    def default_k_pad(self, geometry: MlaGeometry) -> int | None:
        """The K-up multiple to pad w_kc's K (nope) to, or None when nope already is one (or no padding)."""
        k = int(self.recipe.get("k_pad_to", 0))
        return k if k and geometry.qk_nope_head_dim % k else None

    # ---- layers and names -----------------------------------------------------------------------
    def layer_plan(self, config: dict) -> LayerPlan:
        text = self.text_config(config)
        spec = self.layers_spec
        n = config_value(text.get(spec["count_key"]), spec["count_key"], int, minimum=1)
        mtp_key = spec.get("mtp_count_key", "")
        n_mtp = config_value(text.get(mtp_key), mtp_key, int, minimum=0, default=0)
        mtp = tuple(range(n, n + n_mtp))
        mla = select_layers(spec.get("mla", []), text, n, "MLA layers")
        mla = set(range(n)) if mla is None else mla
        dense = select_layers(spec.get("dense", []), text, n, "dense layers") or set()
        indexer = select_layers(spec.get("indexer", []), text, n, "indexer layers") or set()
        indexer &= mla
        if spec.get("mtp_has_mla", True):
            mla |= set(mtp)
            if spec.get("mtp_has_indexer", False):
                indexer |= set(mtp)
        moe = (set(range(n)) - dense) | set(mtp)
        return LayerPlan(n, mtp, *(tuple(sorted(s)) for s in (mla, dense, moe, indexer)))

    def mla_layers(self, config: dict) -> list[int]:
        """Every layer with MLA attention per config.json, MTP layers included when they carry MLA."""
        return list(self.layer_plan(config).mla)

    def layer_prefix(self, layer: int) -> str:
        return f"{self.prefix}.{layer}"

    def layer_of(self, name: str) -> int | None:
        """The layer id in a tensor name under the card's layer prefix (``model.layers.5.mlp...`` -> 5), else None."""
        m = self._layer_name.match(name)
        return int(m[1]) if m else None

    @functools.cached_property
    def _layer_name(self) -> re.Pattern:
        return re.compile(rf"^{re.escape(self.prefix)}\.(\d+)\.")

    def kv_b_proj(self, layer: int) -> str:
        return f"{self.layer_prefix(layer)}.self_attn.kv_b_proj.weight"

    def expert_templates(self) -> list[TensorTemplate]:
        return [t for t in self.tensors if t.scope == "expert"]

    def routed_experts(self, config: dict) -> int:
        """Routed experts per MoE layer per config.json (``n_routed_experts``; 0 where it has none)."""
        text = self.text_config(config)
        return config_value(text.get("n_routed_experts"), "n_routed_experts", int, minimum=0, default=0)

    def expert_weights(self, layer: int, num_experts: int) -> list[str]:
        """Routed-expert module weights of ``layer``, expert-major (e.g. ``...mlp.experts.3.up_proj.weight``)."""
        prefix = self.layer_prefix(layer)
        return [f"{prefix}.{t.name.format(e=e)}" for e in range(num_experts) for t in self.expert_templates()]

    @functools.cached_property
    def expert_pattern(self) -> re.Pattern:
        """Regex matching routed-expert tensor names; groups ``layer``, ``expert``, ``proj`` (e.g. ``up_proj``)."""
        heads, projs = set(), set()
        for t in self.expert_templates():
            head, tail = t.name.split("{e}")
            heads.add(re.escape(head))
            projs.add(re.escape(tail.split(".")[1]))
        if not heads:
            return re.compile(r"(?!x)x")
        return re.compile(
            rf"^{re.escape(self.prefix)}\.(?P<layer>\d+)\.(?:{'|'.join(sorted(heads))})"
            rf"(?P<expert>\d+)\.(?P<proj>{'|'.join(sorted(projs))})\."
        )

    def iter_tensors(self, config: dict):
        """Yield ``(name, template, logical shape)`` for every tensor the card implies for ``config``:
        globals first, then layer by layer (experts expert-major within their layer)."""
        text = self.text_config(config)
        plan = self.layer_plan(config)
        n_experts = self.routed_experts(config)
        in_scope = {
            "layer": set(plan.all),
            "mla": set(plan.mla),
            "linear_attn": set(plan.all) - set(plan.mla),
            "indexer": set(plan.indexer),
            "dense": set(plan.dense),
            "moe": set(plan.moe),
            "expert": set(plan.moe),
            "mtp": set(plan.mtp),
        }
        shapes = {
            t: tuple(eval_expr(d, text, f"card {self.name} tensor {t.name}") for d in t.shape) for t in self.tensors
        }
        for t in self.tensors:
            if t.scope == "global":
                yield t.name, t, shapes[t]
        for layer in plan.all:
            prefix = self.layer_prefix(layer)
            for t in self.tensors:
                if t.scope not in ("global", "expert") and layer in in_scope[t.scope]:
                    yield f"{prefix}.{t.name}", t, shapes[t]
            if layer in in_scope["expert"]:
                for e in range(n_experts):
                    for t in self.expert_templates():
                        yield f"{prefix}.{t.name.format(e=e)}", t, shapes[t]

    # ---- kernels ---------------------------------------------------------------------------------
    def kernel_configs(self, route: str) -> dict:
        """``{arch: {op: {bucket: {key: value}}}}`` for route ``padded`` or ``unpadded`` (ops k_up, v_up)."""
        if route not in ROUTES:
            raise PlanError(f"unknown kernel route {route!r}; choose one of {', '.join(ROUTES)}")
        out: dict = {}
        for arch, spec in self.data.get("kernels", {}).items():
            out[arch] = {}
            for op, bucket, cfg in _route_configs(spec, route):
                cfg = {k: (None if cfg[k] == "" else cfg[k]) for k in AITER_BMM_CONFIG_KEYS}
                out[arch].setdefault(op, {})[bucket] = cfg
        return out

    def _check_kernels(self) -> None:
        for arch, spec in self.data.get("kernels", {}).items():
            for route in ROUTES:
                if route not in spec.get("routes", {}):
                    raise PlanError(f"card {self.name}: kernels.{arch} lacks route {route!r}", file=self.source)
                for op, bucket, cfg in _route_configs(spec, route):
                    missing = [k for k in AITER_BMM_CONFIG_KEYS if k not in cfg]
                    if missing or cfg.get("NUM_KSPLIT") != 1:
                        raise PlanError(
                            f"card {self.name}: {arch}/{route}/{op}/{bucket} needs every key "
                            f"(missing {missing}) and NUM_KSPLIT=1",
                            file=self.source,
                        )


def _route_configs(spec: dict, route: str):
    """``(op, bucket, config)`` of one arch's kernel ``route``: each base bucket's config under the op's ``"*"``
    overrides, then its bucket's."""
    for op, overrides in spec["routes"][route].items():
        for bucket, base in spec["base"].items():
            yield op, bucket, {**base, **overrides.get("*", {}), **overrides.get(bucket, {})}


def list_cards() -> list[str]:
    """Names of the bundled cards (``cards/<name>.toml``), sorted."""
    return sorted(p.name[:-5] for p in resources.files("glm_pack.cards").iterdir() if p.name.endswith(".toml"))


def card_ref(name: str):
    """Where the card ``name`` is: a bundled card's resource, or a card file's path (``*.toml``); PlanError listing
    the bundled cards for any other name."""
    if name.endswith(".toml") and Path(name).is_file():
        return Path(name)
    ref = resources.files("glm_pack.cards") / f"{name}.toml"
    if not ref.is_file():
        raise PlanError(f"unknown card {name!r}; known cards: {', '.join(list_cards())}")
    return ref


@functools.cache
def load_card(name: str) -> Card:
    """A bundled card by name, or a card file by path (``*.toml``): a new family needs a card, not code."""
    ref = card_ref(name)
    try:
        raw = ref.read_bytes()
    except OSError as err:  # a card file given by path: a permission, an I/O error
        raise PlanError(f"cannot read card {name}: {err.strerror or err}", file=str(ref)) from err
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as err:  # TOML is UTF-8
        raise PlanError(f"card {name} is not valid TOML: {err}", file=str(ref)) from err
    return Card(data, str(ref))


def detect_card(config: dict) -> Card:
    """The one card whose ``[detect]`` rules match config.json; CheckpointError when none (or several) do."""
    hits = [card for card in map(load_card, list_cards()) if card.matches(config)]
    if len(hits) == 1:
        return hits[0]
    arch = ", ".join(config.get("architectures") or []) or "none"
    if not hits:
        raise CheckpointError(
            f"unknown architecture {arch} (model_type {config.get('model_type')!r}); "
            f"known cards: {', '.join(list_cards())}",
            file="config.json",
        )
    raise CheckpointError(
        f"architecture {arch} matches several cards: {', '.join(c.name for c in hits)}", file="config.json"
    )
