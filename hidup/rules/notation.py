"""Dimension notation: sharding signatures from an einsum-like description of an op.

``dims("...k, nk, n -> ...n")`` describes ``linear(x, W, b)``: one letter per dimension, operands
separated by commas, ``...`` for any number of leading dims (right-aligned across operands, as in
numpy broadcasting).  On ``N`` ranks each letter ``t`` gives at most one signature, sharding ``t``:

* ``t`` must not be *fixed* (written ``t!`` anywhere, or listed in ``fixed=``), must occur at most
  once per operand, and every dimension that carries it with size > 1 must be divisible by ``N``;
  an operand whose ``t`` dimension has size 1 broadcasts along ``t`` and stays ``full``.
* ``t`` in an output: operands holding it take ``gather_<pos>``, operands without it ``full``;
  the output is ``gather_<pos>``.  Rank r computes ``out[..., t in chunk r, ...]`` from its chunks.
* ``t`` contracted (in inputs, not in an output): holders take ``gather``, the output is ``reduce``
  because ``out = sum_r sum_{t in chunk r} (...)``.  Valid for ops *multilinear* in the holders
  (einsum, matmul, sum).  An *additive* operand (``+ bias``) lacking ``t`` takes ``reduce`` too --
  it is added once overall, never ``N`` times.
* reduce propagation: for each set ``S`` in ``linear=`` (input indices the op is jointly linear
  in, the others held fixed) the signature ``S -> reduce, others full, outputs reduce`` is valid,
  since ``f(sum_r a_r, b) = sum_r f(a_r, b)``.  Sets whose non-additive members are parameters are
  skipped (parameters never arrive as partial sums), as are boolean tensors.

FLOPs: a signature that shards a letter does ``flops / N`` per rank; replicated and
reduce-propagating signatures do the full ``flops`` on every rank.

Parallelism kind of a sharded letter ``t`` (``kinds=`` overrides per letter): ``data`` when no
parameter carries ``t``; ``expert`` when a multiplicatively used parameter, an activation input
and an output all carry ``t`` and the op contracts some other letter (``e`` in
``egcd,edf->egcf``); ``tensor`` otherwise (column parallel: a parameter dim absent from the
activation; row parallel: a contracted parameter dim).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hidup.ir import FULL, REDUCE, Signature, gather
from hidup.rules.base import TensorMeta

__all__ = ["SpecError", "Dims", "dims", "shard_signatures"]

_ITEM = re.compile(r"\.\.\.|[A-Za-z](?:!)?|\s+")


class SpecError(ValueError):
    """A dimension spec does not match the op's operands (a rule bug or an unexpected call)."""


def _parse_operand(text: str, where: str) -> list[tuple[str, bool]]:
    items: list[tuple[str, bool]] = []
    pos = 0
    while pos < len(text):
        m = _ITEM.match(text, pos)
        if not m:
            raise SpecError(
                f"{where}: cannot parse {text[pos:]!r} in dim spec operand {text!r}; "
                f"use single letters, '...' and '!' for non-shardable letters"
            )
        tok = m.group(0)
        pos = m.end()
        if tok.isspace():
            continue
        if tok == "...":
            items.append(("...", False))
        else:
            items.append((tok[0], tok.endswith("!")))
    if sum(1 for t, _ in items if t == "...") > 1:
        raise SpecError(f"{where}: operand {text!r} has more than one '...'")
    return items


@dataclass
class Dims:
    """A parsed dimension spec; :meth:`signatures` evaluates it for concrete shapes."""

    spec: str
    fixed: frozenset = frozenset()
    linear: tuple = ()
    additive: frozenset = frozenset()
    kinds: dict = field(default_factory=dict)
    ins: list = field(init=False)
    outs: list = field(init=False)

    def __post_init__(self):
        if "->" not in self.spec:
            raise SpecError(f"dim spec {self.spec!r} has no '->'")
        lhs, rhs = self.spec.split("->")
        self.ins = [_parse_operand(o, self.spec) for o in lhs.split(",")]
        self.outs = [_parse_operand(o, self.spec) for o in rhs.split(",")]
        marked = {t for op in self.ins + self.outs for t, f in op if f}
        self.fixed = frozenset(self.fixed) | marked

    def tokens(self, in_shapes, out_shapes) -> tuple[list[list[str]], list[list[str]]]:
        """Expand ``...`` for the given shapes: one token per dimension per operand."""
        if len(in_shapes) != len(self.ins) or len(out_shapes) != len(self.outs):
            raise SpecError(
                f"dim spec {self.spec!r} has {len(self.ins)} inputs / {len(self.outs)} outputs, "
                f"the op has {len(in_shapes)} / {len(out_shapes)}"
            )
        ops = self.ins + self.outs
        shapes = list(in_shapes) + list(out_shapes)
        ell = []
        for items, shape in zip(ops, shapes):
            explicit = sum(1 for t, _ in items if t != "...")
            has = any(t == "..." for t, _ in items)
            n = len(shape) - explicit
            if n < 0 or (n > 0 and not has):
                raise SpecError(
                    f"dim spec {self.spec!r}: operand {''.join(t for t, _ in items)!r} "
                    f"does not fit shape {tuple(shape)}"
                )
            ell.append(n if has else 0)
        width = max(ell, default=0)
        toks = []
        for items, n in zip(ops, ell):
            row = []
            for t, _ in items:
                if t == "...":
                    row.extend(f"...{width - n + j}" for j in range(n))
                else:
                    row.append(t)
            toks.append(row)
        return toks[: len(self.ins)], toks[len(self.ins) :]

    def signatures(
        self, inputs: list[TensorMeta], outputs: list[TensorMeta], world: int, flops: float, contract: bool = True
    ) -> list[Signature]:
        tin, tout = self.tokens([m.shape for m in inputs], [m.shape for m in outputs])
        return shard_signatures(
            tin,
            tout,
            inputs,
            outputs,
            world,
            flops,
            fixed=self.fixed,
            linear=self.linear,
            additive=self.additive,
            kinds=self.kinds,
            contract=contract,
            where=self.spec,
        )


def dims(spec: str, *, fixed="", linear=(), additive=(), kinds=None) -> Dims:
    """Parse a dimension spec (see the module docstring)."""
    return Dims(spec, frozenset(fixed), tuple(tuple(s) for s in linear), frozenset(additive), dict(kinds or {}))


def _can_reduce(meta: TensorMeta) -> bool:
    return meta.dtype != "bool"


# why: a declarative rule notation, each keyword names one property of the op's rule (as einsum-like builders)
def shard_signatures(
    tin: list[list[str]],
    tout: list[list[str]],
    inputs: list[TensorMeta],
    outputs: list[TensorMeta],
    world: int,
    flops: float,
    *,
    fixed=frozenset(),
    linear=(),
    additive=frozenset(),
    kinds=None,
    contract: bool = True,
    strict: bool = True,
    where: str = "",
) -> list[Signature]:
    """Signatures from explicit per-dimension tokens (the engine behind :class:`Dims`).

    ``strict`` checks that a token has one size (> 1) wherever it is not broadcast; shape rules
    (reshape) pass ``strict=False`` and tokens whose sizes differ per operand (each dim holding the
    token must still be divisible by ``N``).
    """
    op = _Operands(tin, tout, inputs, outputs, world, flops, additive, kinds or {}, contract)
    letters = op.letters(strict, where)
    sigs = [op.replicated()]
    for t in letters:
        if t not in fixed:
            sigs.append(op.sharding(t))
    for group in linear:
        sigs.append(op.propagating(tuple(group)))
    return dedupe([s for s in sigs if s is not None])


@dataclass
class _Operands:
    """One op's operands as :func:`shard_signatures` reads them: their tokens and metas (``rows`` and
    ``metas``: the ``nin`` inputs, then the outputs) and the rule's properties a signature depends on."""

    tin: list[list[str]]
    tout: list[list[str]]
    inputs: list[TensorMeta]
    outputs: list[TensorMeta]
    world: int
    flops: float
    additive: frozenset
    kinds: dict
    contract: bool
    rows: list = field(init=False)
    metas: list = field(init=False)
    nin: int = field(init=False)

    def __post_init__(self):
        self.rows = self.tin + self.tout
        self.metas = list(self.inputs) + list(self.outputs)
        self.nin = len(self.tin)

    def letters(self, strict: bool, where: str) -> list[str]:
        """The tokens in order of first occurrence; :class:`SpecError` where an operand's tokens do not
        fit its shape, or (``strict``) where a token has two sizes > 1."""
        for row, m in zip(self.rows, self.metas):
            if len(row) != len(m.shape):
                raise SpecError(f"{where}: {len(row)} dim tokens {row} for a tensor of shape {m.shape}")
        sizes: dict[str, set] = {}
        for row, m in zip(self.rows, self.metas):
            for t, s in zip(row, m.shape):
                sizes.setdefault(t, set()).add(s)
        if strict:
            for t, ss in sizes.items():
                big = {s for s in ss if s != 1}
                if len(big) > 1:
                    raise SpecError(f"{where}: dim {t!r} has sizes {sorted(big)} on different operands")
        return list(sizes)

    def replicated(self) -> Signature:
        """Every operand full, the whole work on every rank."""
        return Signature(tuple(FULL for _ in self.tin), tuple(FULL for _ in self.tout), float(self.flops), "replicated")

    def held(self, t: str) -> dict[int, int] | None:
        """Operand -> position of ``t`` in it, for the operands sharded along ``t`` (those where its size
        is > 1); None where ``t`` gives no signature by where it occurs (twice in an operand, nowhere
        with size > 1, a size not divisible by the world, an output broadcasting along it)."""
        if any(row.count(t) > 1 for row in self.rows):
            return None
        metas = self.metas
        held = [(k, row.index(t)) for k, row in enumerate(self.rows) if t in row and metas[k].shape[row.index(t)] > 1]
        if not held or any(metas[k].shape[p] % self.world for k, p in held):
            return None
        held_set = dict(held)
        if any(t in row and k not in held_set for k, row in enumerate(self.tout, start=self.nin)):
            return None  # an output broadcasts along t while an input does not: not a slice of anything
        return held_set

    def sharding(self, t: str) -> Signature | None:
        """The signature sharding ``t`` (module docstring), or None where ``t`` gives none."""
        held = self.held(t)
        if held is None:
            return None
        out_forms = [gather(held[k]) if k in held else REDUCE for k in range(self.nin, len(self.rows))]
        reduces = any(f == REDUCE for f in out_forms)
        if reduces and not self.reduces_ok(held, out_forms):
            return None
        in_forms = self.input_forms(held, reduces)
        if in_forms is None:
            return None
        kind = self.kinds.get(t) or _kind(t, self.tin, self.tout, self.inputs, self.additive, self.contracted_any())
        return Signature(tuple(in_forms), tuple(out_forms), float(self.flops) / self.world, kind)

    def reduces_ok(self, held: dict[int, int], out_forms: list) -> bool:
        """Whether a signature whose outputs ``out_forms`` include a partial sum is valid: the op
        contracts, those outputs can be summed, an input holds the letter, and no additive operand is
        added to an output that stays a slice."""
        if not self.contract or any(not _can_reduce(m) for f, m in zip(out_forms, self.outputs) if f == REDUCE):
            return False
        if not held.keys() - set(range(self.nin, len(self.rows))):
            return False
        return not (any(f.is_gather for f in out_forms) and self.additive)

    def input_forms(self, held: dict[int, int], reduces: bool) -> list | None:
        """The inputs' forms of the signature sharding the operands ``held``: a slice where held, a
        partial sum for an additive input where the outputs are partial sums (None where it cannot be
        summed), else full."""
        forms = []
        for k in range(self.nin):
            if k in held:
                forms.append(gather(held[k]))
            elif reduces and k in self.additive:
                if not _can_reduce(self.inputs[k]):
                    return None
                forms.append(REDUCE)
            else:
                forms.append(FULL)
        return forms

    def contracted_any(self) -> bool:
        """Whether the op contracts some letter (an input's letter no output holds)."""
        out = {x for r in self.tout for x in r}
        return any(t not in out for r in self.tin for t in r)

    def propagating(self, group: tuple) -> Signature | None:
        """The reduce-propagating signature of the inputs ``group`` the op is jointly linear in (module
        docstring), or None where it is not valid."""
        inputs = self.inputs
        if not group or any(i >= self.nin for i in group):
            return None
        if any(not _can_reduce(inputs[i]) for i in group) or any(not _can_reduce(m) for m in self.outputs):
            return None
        if any(inputs[i].is_param and i not in self.additive for i in group):
            return None
        return Signature(
            tuple(REDUCE if i in group else FULL for i in range(self.nin)),
            tuple(REDUCE for _ in self.tout),
            float(self.flops),
            "tensor" if any(m.is_param for m in inputs) else "data",
        )


def _kind(t, tin, tout, inputs, additive, contracted_any) -> str:
    holders = [k for k, row in enumerate(tin) if t in row and inputs[k].shape[row.index(t)] > 1]
    params = [k for k in holders if inputs[k].is_param]
    if not params:
        return "data"
    in_out = any(t in row for row in tout)
    if not in_out:
        return "tensor"
    mult = [k for k in params if k not in additive]
    acts = [k for k in holders if not inputs[k].is_param]
    if mult and acts and contracted_any:
        return "expert"
    return "tensor"


def dedupe(sigs: list[Signature]) -> list[Signature]:
    seen = set()
    out = []
    for s in sigs:
        key = (s.inputs, s.outputs, s.impl)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out
