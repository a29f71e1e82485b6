"""A parallelization plan: what the search chose and what it predicts, saved as versioned JSON.

A :class:`Plan` names, for every node of the graph it was made for, the chosen
:class:`~hidup.ir.Signature`; lists every form change (conversion) the plan needs, once per
(tensor, destination form) at the first consumer that needs it (later consumers of that form reuse
it); groups the nodes into stages (a stage opens at each node whose inputs need communication, in
execution order); and records the predicted seconds per iteration and bytes per rank.

``Plan.check(graph)`` refuses a plan made for another graph (structure fingerprint), world size, mesh
or model.  ``mesh`` is the device mesh of a plan on several axes (:mod:`hidup.ir`, "Meshes"); its
forms are layouts and its conversions carry their one-axis ``steps``.  The search makes plans and
the code generator and runtime read them, so they live in the plan layer between them
(:mod:`hidup.plan`).

A plan remembers how to rebuild its model in ``model_source``: ``{"model": spec, "args": {...}}``
with ``spec`` a zoo name or ``package.module:function`` (see :mod:`hidup.models.source`) and
``args`` its keyword arguments, JSON values only (:func:`model_record` refuses anything else), so
``hidup show/train/verify --plan`` need no model flags.  It is empty for a plan searched in Python
without ``model_source=``.  Format versions: 2 adds ``model_source``; version 1 files still load
(their zoo name and ``model_config`` overrides say the same for plans of ``hidup search``).

``recompute`` lists the repeated layers (block labels, :func:`hidup.ir.block_label`) whose forward the
rank program runs again in the backward instead of keeping their activations
(:mod:`hidup.codegen.recompute`); a file without it recomputes nothing.  ``recompute_selective`` lists
the layers recomputed *selectively* instead (no layer is in both): the outputs of their matmuls,
attention and activation form changes are kept, and only the ops between them run again in the
backward; a file without it (every plan written before it existed) recomputes none selectively.

``reshard`` lists the parameters (``param`` node names) stored split whose converted (all-gathered)
copies the rank program frees after their forward use and makes again in the backward instead of
keeping them (:mod:`hidup.codegen.reshard`, FSDP2's reshard after forward); a file without it
reshards nothing.

``zero`` maps parameters (``param`` node names) stored ``replicate`` to the ZeRO stage they are kept in
(:mod:`hidup.codegen.zero`): 1, each rank keeps Adam's state of its 1/N of the rows only and steps
them; 2, its gradient too (reduce-scattered instead of all-reduced).  The updated rows are then
all-gathered into the whole weight.  A parameter not listed (and every parameter of a file without
it) keeps its whole gradient and optimizer state on every rank.

``offload`` says where Adam's state lives (:mod:`hidup.codegen.offload`): ``"optimizer"``, in the host's
memory, the moments and a float32 copy of every weight the rank steps, stepped by the host's CPU after
the gradients are copied there, the updated weights copied back; ``"off"`` (a file without it) on the
device.

``reduce_dtype`` is the dtype the float32 parameters' gradients are summed over ranks in
(:mod:`hidup.precision`, "Gradients reduced in bf16"): ``"fp32"`` (a file without it) or ``"bf16"``
(only for a plan searched under bf16 autocast); the conversions' recorded bytes follow it.

``versions`` records the torch (and, when imported, transformers) versions the graph was traced
with: the same model can export to a different graph under other versions (``transformers`` has
rewritten its rotary embeddings between releases), and ``check`` names the versions that moved when
the fingerprints differ.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from hidup.errors import UserError
from hidup.files import atomic_write
from hidup.ir import (
    COLLECTIVES,
    FORM_CHANGE_OPS,
    OFFLOADS,
    ZERO_STAGES,
    Form,
    Graph,
    Layout,
    Signature,
    block_label,
    mesh_text,
    parse_form,
)
from hidup.precision import REDUCE_DTYPES

__all__ = [
    "Plan",
    "ConversionRecord",
    "MeshStepRecord",
    "PlanError",
    "PLAN_VERSION",
    "READABLE_VERSIONS",
    "layer_of",
    "model_record",
]

PLAN_VERSION = 2
READABLE_VERSIONS = (1, 2)


class PlanError(UserError, ValueError):
    """A plan cannot be used as asked; the message says what differs and what to do."""


def _json_exact(value) -> bool:
    """Whether ``value`` survives a JSON round trip unchanged (no tuples, NaN, non-str keys, objects)."""
    try:
        return json.loads(json.dumps(value, allow_nan=False)) == value and _no_tuples(value)
    except (TypeError, ValueError):
        return False


def _no_tuples(value) -> bool:
    if isinstance(value, tuple):
        return False
    if isinstance(value, list):
        return all(_no_tuples(v) for v in value)
    if isinstance(value, dict):
        return all(_no_tuples(v) for v in value.values())
    return True


def model_record(source, args: dict | None = None) -> dict:
    """The ``model_source`` record of a plan: ``{"model": spec, "args": {...}}``.

    ``source`` is a spec string (a zoo name or ``package.module:function``) with ``args`` its keyword
    arguments, a ``(spec, args)`` pair, or a record dict.  Raises :class:`PlanError` for a missing spec or an
    argument that is not a JSON value (str, int, float, bool, None, and lists and dicts of them)."""
    if isinstance(source, tuple) and len(source) == 2 and args is None:
        source, args = source
    if isinstance(source, dict):
        if args is not None or set(source) - {"model", "args"}:
            raise PlanError(f"model_source={source!r}: a record has the keys 'model' and 'args' only")
        source, args = source.get("model"), source.get("args")
    if not isinstance(source, str) or not source.strip():
        raise PlanError(f"model_source={source!r}: give the model's spec, a zoo name or 'package.module:function'")
    if args is not None and not isinstance(args, dict):
        raise PlanError(
            f"model_source args of {source}: expected a dict of keyword arguments, got {type(args).__name__}"
        )
    args = dict(args or {})
    for key, value in args.items():
        if not isinstance(key, str) or not _json_exact(value):
            raise PlanError(
                f"model argument {key}={value!r} of {source}: a plan records only JSON values (str, "
                "int, float, bool, None, lists and dicts of them). Fix: make the factory take a JSON "
                "value (e.g. the dtype's name 'float64' instead of torch.float64)"
            )
    return {"model": source, "args": args}


@dataclass(frozen=True)
class MeshStepRecord:
    """One step of a layout change on a mesh (:class:`hidup.ir.MeshStep`): form-change ops
    ``forward``/``backward`` on mesh axis ``axis``, from layout ``before`` to ``after``; ``bytes`` the
    logical size of what that axis's collective moves (the tensor as the other axes hold it, at the
    dtype it has under the search's precision); ``forward_bytes`` what its forward moves where that
    differs (a weight sent in autocast's dtype, :mod:`hidup.precision`), ``backward_bytes`` what its
    backward moves where that differs (a gradient summed in bf16, ``Plan.reduce_dtype``)."""

    axis: int
    forward: str
    backward: str
    before: Layout
    after: Layout
    bytes: int
    forward_bytes: int | None = None
    backward_bytes: int | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["before"], d["after"] = str(self.before), str(self.after)
        for key in ("forward_bytes", "backward_bytes"):
            if d[key] is None:
                del d[key]
        return d

    @property
    def moved(self) -> tuple[int, int]:
        """(forward, backward) logical bytes of this step's collectives, at the dtypes they travel in."""
        return (
            self.bytes if self.forward_bytes is None else self.forward_bytes,
            self.bytes if self.backward_bytes is None else self.backward_bytes,
        )

    @staticmethod
    def from_dict(d: dict) -> "MeshStepRecord":
        return MeshStepRecord(
            d["axis"],
            d["forward"],
            d["backward"],
            parse_form(d["before"]),
            parse_form(d["after"]),
            d["bytes"],
            d.get("forward_bytes"),
            d.get("backward_bytes"),
        )


@dataclass(frozen=True)
class ConversionRecord:
    """One form change: tensor ``tensor`` made by ``producer`` is turned from ``src`` into ``dst`` just
    before ``consumer`` reads it as input ``input_index``; ``forward``/``backward`` are the ops of
    :func:`hidup.ir.conversion`; ``bytes`` the logical tensor size; ``grad`` whether its backward runs;
    ``wire`` the logical bytes its forward and backward collectives move, at the dtypes they travel
    in under the search's precision (empty in plans written before it was recorded: ``bytes``).
    On a mesh ``src``/``dst`` are layouts and ``steps`` the one-axis changes the cost model chose
    (:func:`hidup.ir.layout_conversions`), run in order forward and in reverse backward."""

    tensor: int
    producer: str
    consumer: str
    input_index: int
    src: Form | Layout
    dst: Form | Layout
    forward: str
    backward: str
    bytes: int
    grad: bool = True
    steps: tuple[MeshStepRecord, ...] = ()
    wire: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["src"], d["dst"] = str(self.src), str(self.dst)
        d["steps"] = [s.to_dict() for s in self.steps]
        d["wire"] = list(self.wire)
        for key in ("steps", "wire"):
            if not d[key]:
                del d[key]
        return d

    @staticmethod
    def from_dict(d: dict) -> "ConversionRecord":
        return ConversionRecord(
            d["tensor"],
            d["producer"],
            d["consumer"],
            d["input_index"],
            parse_form(d["src"]),
            parse_form(d["dst"]),
            d["forward"],
            d["backward"],
            d["bytes"],
            d.get("grad", True),
            tuple(MeshStepRecord.from_dict(s) for s in d.get("steps", ())),
            tuple(d.get("wire", ())),
        )

    def sent_bytes(self, ranks: Callable[[int | None], int]) -> float:
        """Bytes one rank sends for this conversion per step (forward, and backward where it runs);
        ``ranks(axis)`` is the size of mesh axis ``axis``'s group (None: the whole world)."""
        return sum(sent for _, sent in self.collectives(ranks))

    def collectives(self, ranks: Callable[[int | None], int]) -> list[tuple[str, float]]:
        """``(collective, bytes one rank sends)`` of each collective this conversion runs per step,
        forward then backward (where it runs), on a mesh axis by axis."""

        def one(op: str, nbytes: float, axis: int | None) -> list[tuple[str, float]]:
            known = FORM_CHANGE_OPS.get(op)
            collective = known.collective if known is not None else (op if op in COLLECTIVES else "")
            return [(collective, nbytes * sent_share(collective, ranks(axis)))] if collective else []

        if self.steps:
            out = []
            for s in self.steps:
                fwd, bwd = s.moved
                out += one(s.forward, fwd, s.axis)
                out += one(s.backward, bwd, s.axis) if self.grad else []
            return out
        fwd, bwd = self.wire or (self.bytes, self.bytes)
        return one(self.forward, fwd, None) + (one(self.backward, bwd, None) if self.grad else [])

    @property
    def comm_bytes(self) -> int:
        """Bytes moved by collectives (forward plus backward when it runs)."""
        if self.steps:
            return sum(
                s.moved[0] * _communicates(s.forward) + s.moved[1] * (self.grad and _communicates(s.backward))
                for s in self.steps
            )
        fwd, bwd = self.wire or (self.bytes, self.bytes)
        return fwd * _communicates(self.forward) + bwd * (self.grad and _communicates(self.backward))


def sent_share(collective: str, ranks: int) -> float:
    """Bytes one rank sends per logical byte (:mod:`hidup.profiler.measure.comm`'s convention) of ``collective``
    over ``ranks`` ranks by the ring and pairwise algorithms: ``(N-1)/N`` for an all-gather or a
    reduce-scatter, twice that for an all-reduce, ``(N-1)/N^2`` for an all-to-all (each rank holds
    ``1/N`` of the logical buffer and keeps ``1/N`` of that)."""
    if ranks <= 1 or not collective:
        return 0.0
    share = (ranks - 1) / ranks
    return {"all_reduce": 2 * share, "all_to_all": share / ranks}.get(collective, share)


def _communicates(op: str) -> bool:
    """Whether form-change op ``op`` runs a collective (plans saved earlier may name a collective
    or ``local``, which is not in the registry)."""
    known = FORM_CHANGE_OPS.get(op)
    return bool(known.collective) if known is not None else op in COLLECTIVES


def traced_versions() -> dict[str, str]:
    """Versions of the libraries that decide what a model exports to: torch, and transformers when this
    process has imported it."""
    out = {"torch": torch.__version__}
    tf = sys.modules.get("transformers")
    if tf is not None and getattr(tf, "__version__", None):
        out["transformers"] = tf.__version__
    return out


@dataclass
class Plan:
    model: str
    fingerprint: str
    world_size: int
    profile: str
    algorithm: str
    duplication: bool
    choices: dict[str, Signature]
    stages: list[list[str]]
    predicted: dict[str, float]
    memory: dict[str, float]
    conversions: list[ConversionRecord]
    options: dict = field(default_factory=dict)
    # [compute_f, compute_b, conv_f, conv_b]; a form change costs its collectives and their copies
    node_costs: dict[str, list[float]] = field(default_factory=dict)
    layers: dict[str, str] = field(default_factory=dict)  # node name -> layer label
    alternatives: dict[str, dict] = field(default_factory=dict)  # heaviest nodes: runner-up signature
    model_config: dict = field(default_factory=dict)  # version 1: the zoo overrides of `hidup search`
    model_source: dict = field(default_factory=dict)  # {"model": spec, "args": {...}} (see the module doc)
    recompute: list[str] = field(default_factory=list)  # layers whose forward runs again in the backward
    # layers whose forward runs again in the backward but for the outputs of their matmuls and attention
    recompute_selective: list[str] = field(default_factory=list)
    # node -> [mesh axis (-1: the whole world), logical bytes of the all-to-alls it runs inside per step]:
    # the routed experts' all-to-all dispatcher (hidup.rules.dispatch)
    dispatch: dict[str, list] = field(default_factory=dict)
    reshard: list[str] = field(default_factory=list)  # params whose gathered copies are made again in the backward
    zero: dict[str, int] = field(default_factory=dict)  # replicated param -> ZeRO stage (1 or 2), see the module doc
    mesh: list[int] = field(default_factory=list)  # device mesh, outer axis first; [] = one axis of world_size
    offload: str = "off"  # where Adam's state lives: "off" (the device) or "optimizer" (the host), module doc
    # the dtype the float32 parameters' gradients are summed over ranks in (hidup.precision; module doc)
    reduce_dtype: str = "fp32"
    # the libraries the graph was traced with ({"torch": "2.13.0", "transformers": "5.23.0"}): the same
    # model can export to another graph under other versions
    versions: dict[str, str] = field(default_factory=traced_versions)
    version: int = PLAN_VERSION

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The device mesh as a tuple (one axis of ``world_size`` for a plan of one axis)."""
        return tuple(self.mesh) or (self.world_size,)

    # ------------------------------------------------------------------------------ queries
    def group_size(self, axis: int | None) -> int:
        """Ranks in mesh axis ``axis``'s group (None or -1: the whole world)."""
        return self.world_size if axis is None or axis < 0 or not self.mesh else self.mesh[axis]

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage the search gave the plan's replicated weights (0: none; one stage per search)."""
        return max(self.zero.values(), default=0)

    def sent_bytes(self) -> float:
        """Bytes one rank sends per step by every collective of the plan: its conversions' and those
        inside its nodes (gradient all-reduces included; a duplicated plan's two copies together)."""
        moved = sum(c.sent_bytes(self.group_size) for c in self.conversions)
        moved += sum(b * sent_share("all_to_all", self.group_size(axis)) for axis, b in self.dispatch.values())
        return moved

    def conversion(self, tensor: int, dst: Form | Layout) -> ConversionRecord | None:
        for c in self.conversions:
            if c.tensor == tensor and c.dst == dst:
                return c
        return None

    def check(self, graph: Graph) -> None:
        """Raise :class:`PlanError` unless this plan was made for ``graph``."""
        problems = []
        if self.world_size != graph.world_size:
            problems.append(f"world size: plan {self.world_size}, graph {graph.world_size}")
        elif self.mesh_shape != graph.mesh:
            problems.append(f"mesh: plan {mesh_text(self.mesh_shape)}, graph {mesh_text(graph.mesh)}")
        # The fingerprint decides: a plan names its model by the zoo name it was searched for
        # (``hidup search --model``) while a traced graph carries the module's class name.
        fp = graph.fingerprint()
        if self.fingerprint != fp:
            if self.model and graph.model and self.model != graph.model:
                problems.append(f"model: plan {self.model!r}, graph {graph.model!r}")
            names = {n.name for n in graph.nodes}
            missing = sorted(names - set(self.choices))[:5]
            extra = sorted(set(self.choices) - names)[:5]
            detail = ""
            if missing:
                detail += f"; graph nodes without a choice: {', '.join(missing)}"
            if extra:
                detail += f"; plan nodes not in the graph: {', '.join(extra)}"
            now = traced_versions()
            moved = [
                f"{k} {self.versions[k]} -> {now.get(k, 'absent')}"
                for k in sorted(self.versions)
                if self.versions[k] != now.get(k)
            ]
            if moved:
                detail += (
                    f"; the plan was searched with other library versions ({', '.join(moved)} here), "
                    "under which the same model can trace to another graph"
                )
            problems.append(
                f"graph fingerprint: plan {self.fingerprint}, graph {fp} (the model's structure, "
                f"shapes or dtypes changed{detail})"
            )
        if problems:
            raise PlanError(
                "this plan was made for a different job -- "
                + "; ".join(problems)
                + ". Fix: run `hidup search` again for this model and world size (with the library versions "
                "the ranks run). A model whose forward iterates over a set (transformers' Gemma-3) traces "
                "alike only under one PYTHONHASHSEED: the hidup commands set it to 0; a script calling "
                "hidup.trace should too."
            )
        for n in graph.nodes:
            sig = self.choices.get(n.name)
            if sig is None or (n.signatures and sig not in n.signatures):
                raise PlanError(f"plan has no valid signature for node {n.name}: {sig}. Fix: search again.")

    # ------------------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        return {
            "version": self.version,
            "model": self.model,
            "fingerprint": self.fingerprint,
            "world_size": self.world_size,
            "profile": self.profile,
            "algorithm": self.algorithm,
            "duplication": self.duplication,
            "options": self.options,
            "model_config": self.model_config,
            "model_source": self.model_source,
            "predicted": self.predicted,
            "memory": self.memory,
            "choices": {k: s.to_dict() for k, s in self.choices.items()},
            "stages": self.stages,
            "conversions": [c.to_dict() for c in self.conversions],
            "node_costs": self.node_costs,
            "layers": self.layers,
            "alternatives": self.alternatives,
            "recompute": self.recompute,
            **({"recompute_selective": self.recompute_selective} if self.recompute_selective else {}),
            **({"reshard": self.reshard} if self.reshard else {}),
            **({"zero": dict(self.zero)} if self.zero else {}),
            **({"dispatch": self.dispatch} if self.dispatch else {}),
            **({"mesh": list(self.mesh)} if len(self.mesh) > 1 else {}),
            **({"reduce_dtype": self.reduce_dtype} if self.reduce_dtype != "fp32" else {}),
            **({"offload": self.offload} if self.offload != "off" else {}),
            "versions": dict(self.versions),
        }

    @staticmethod
    def from_dict(d: dict, where: str = "plan") -> "Plan":
        if not isinstance(d, dict):
            raise PlanError(
                f"{where}: a JSON {type(d).__name__}, not a hidup plan (a JSON object). Fix: pass a file "
                "`hidup search` wrote"
            )
        version = d.get("version")
        if version not in READABLE_VERSIONS:
            raise PlanError(
                f"{where}: plan format version {version!r}, this hidup reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}. Fix: run `hidup search` again to write a "
                "current plan."
            )
        try:
            return Plan(
                model=d["model"],
                fingerprint=d["fingerprint"],
                world_size=d["world_size"],
                profile=d["profile"],
                algorithm=d["algorithm"],
                duplication=d["duplication"],
                choices={k: Signature.from_dict(s) for k, s in d["choices"].items()},
                stages=[list(s) for s in d["stages"]],
                predicted=dict(d["predicted"]),
                memory=dict(d["memory"]),
                conversions=[ConversionRecord.from_dict(c) for c in d["conversions"]],
                options=dict(d.get("options", {})),
                node_costs=dict(d.get("node_costs", {})),
                layers=dict(d.get("layers", {})),
                alternatives=dict(d.get("alternatives", {})),
                model_config=dict(d.get("model_config", {})),
                model_source=dict(d.get("model_source") or {}),
                recompute=list(d.get("recompute") or []),
                recompute_selective=list(d.get("recompute_selective") or []),
                reshard=list(d.get("reshard") or []),
                zero=_zero_record(d.get("zero"), where),
                dispatch={k: list(v) for k, v in (d.get("dispatch") or {}).items()},
                mesh=list(d.get("mesh") or []),
                reduce_dtype=_reduce_record(d.get("reduce_dtype", "fp32"), where),
                offload=_offload_record(d.get("offload", "off"), where),
                versions=dict(d.get("versions") or {}),
                version=PLAN_VERSION,
            )
        except KeyError as e:
            raise PlanError(f"{where}: missing field {e.args[0]!r}; the file is not a complete hidup plan") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise PlanError(
                f"{where}: {e}; the file is not a valid hidup plan. Fix: run `hidup search` again to write one"
            ) from None

    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON (:func:`hidup.files.atomic_write`)."""
        return atomic_write(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @staticmethod
    def load(path: str | Path) -> "Plan":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise PlanError(f"no plan file at {path}. Fix: run `hidup search` first or pass the right path") from None
        except json.JSONDecodeError as e:
            raise PlanError(f"{path}: not valid JSON ({e})") from None
        return Plan.from_dict(data, where=str(path))


def _zero_record(value, where: str) -> dict[str, int]:
    """The ``zero`` entry of a plan file: parameter name -> ZeRO stage (1 or 2); absent, no ZeRO."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and not isinstance(v, bool) and v in ZERO_STAGES for k, v in value.items()
    ):
        raise PlanError(
            f"{where}: 'zero' must map parameter names to a ZeRO stage (1 or 2), got {value!r}. Fix: run "
            "`hidup search` again, or remove the entry to train without ZeRO"
        )
    return dict(value)


def _offload_record(value, where: str) -> str:
    """The ``offload`` entry of a plan file (:data:`hidup.ir.OFFLOADS`); absent, ``"off"``."""
    if value != "off" and value not in OFFLOADS:
        raise PlanError(
            f"{where}: 'offload' must be one of off, {', '.join(OFFLOADS)}, got {value!r}. Fix: run "
            "`hidup search` again, or remove the entry to keep the optimizer on the device"
        )
    return value


def _reduce_record(value, where: str) -> str:
    """The ``reduce_dtype`` entry of a plan file (:data:`hidup.precision.REDUCE_DTYPES`); absent, fp32."""
    if value not in REDUCE_DTYPES:
        raise PlanError(
            f"{where}: 'reduce_dtype' must be one of {', '.join(REDUCE_DTYPES)}, got {value!r}. Fix: run "
            "`hidup search` again, or remove the entry to reduce gradients in fp32"
        )
    return value


def layer_of(module: str) -> str:
    """Layer label for reports: the repeated-layer prefix (``layers.3``), else the top module."""
    return block_label(module) or (module.split(".")[0] if module else "")
