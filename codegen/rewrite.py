"""``hidup.compile``: a model plus a plan becomes the module one rank trains.

    module = hidup.compile(model, plan, rank, world_size, example_inputs)
    loss = module(*global_batch)         # this rank's part of the loss (reduce form)
    loss.backward()                      # gradients of local shards; replicated ones all-reduced
    optimizer.step()                     # an ordinary optimizer over module.parameters()
    print(module.global_loss(loss))      # the true loss: sum over ranks

The model is re-traced (:func:`hidup.frontend.trace.trace_module`) and :mod:`hidup.codegen.program` builds
this rank's fx program (sharded parameters, sliced inputs, form conversions, localized ops, loss
in ``reduce`` form).  The returned :class:`HidupModule`:

* takes the same inputs as ``model.forward`` -- the **global** batch by default, sliced on entry
  per the plan's input forms; with ``local_batch=True`` each input is given as this rank's piece
  (``module.input_forms`` says which form each input has);
* returns the rank's loss ``l_r`` with ``sum_r l_r = loss``; ``l_r.backward()`` seeds 1 on every
  rank, the exact gradient of a ``reduce`` value;
* holds only this rank's parameter slices (``module.param_shards`` maps them to logical names;
  :func:`hidup.codegen.params.full_state_dict` gathers the logical layout);
* all-reduces the gradients of replicated parameters in ~``bucket_mb`` buckets during backward
  (:class:`hidup.codegen.grads.GradBucketer`; use ``module.no_sync()`` for accumulation);
* with ZeRO (``plan.zero``, :mod:`hidup.codegen.zero`) splits the optimizer state (and with stage 2
  the gradient) of the replicated parameters it names over the ranks: build the optimizer over
  ``module.optimizer_parameters()`` and bind it with ``module.bind_optimizer(opt)``, which
  all-gathers the updated rows after each ``opt.step()`` (both are plain ``parameters()`` and a
  no-op without ZeRO);
* with the optimizer offloaded (``plan.offload``, :mod:`hidup.codegen.offload`) keeps a host copy of every
  tensor the optimizer steps: ``module.optimizer_parameters()`` are those copies, and
  ``module.bind_optimizer(opt)`` copies the gradients to the host before each ``opt.step()`` and the
  updated weights back after it;
* with duplication (default: the plan's), runs two half-batch copies (:mod:`hidup.codegen.duplicate`)
  and returns the sum of their losses.

A plan searched for a device mesh of several axes (``plan.mesh``, :mod:`hidup.ir` "Meshes") runs on
``prod(mesh)`` ranks, rank ``r`` at ``numpy.unravel_index(r, mesh)``: the model is traced for that
mesh, each layout change runs as one-axis steps on the axes' process groups
(:mod:`hidup.codegen.mesh`, ``module.mesh_groups``), parameters and inputs are cut per layout, and a
replicated parameter's gradient is summed over the axes on which it is ``replicate``, one bucketer
per set of axes.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.fx
import torch.nn as nn

from hidup.codegen import collectives
from hidup.codegen.compiled import backend_of, bucket_segments, compile_segments
from hidup.codegen.duplicate import SequentialCopies, StagedCopies, copy_inputs
from hidup.codegen.grads import GradBucketer
from hidup.codegen.mesh import MeshGroups, mesh_groups
from hidup.codegen.offload import OffloadedOptimizer
from hidup.codegen.prefetch import confine_links
from hidup.codegen.program import (
    CompileError,
    RankProgram,
    build_rank_program,
    hidup_copy_sum,
    using_copy_sums,
    using_group,
)
from hidup.codegen.zero import ZeroShards
from hidup.copies import copy_axis
from hidup.frontend.trace import forward_inputs, trace_copy, trace_module
from hidup.ir import GRAD_BUCKET_MB, OFFLOADS, Layout
from hidup.optionset import OptionSet
from hidup.rules import random

__all__ = ["compile", "CompileOptions", "HidupModule", "CompileError"]


class HidupModule(nn.Module):
    """One rank's compiled training step (see module docstring)."""

    def __init__(
        self,
        program: RankProgram,
        *,
        rank: int,
        world_size: int,
        group=None,
        local_batch: bool = False,
        duplication: bool = False,
        copy_groups=None,
        batch_dims=None,
        bucket_mb: float = GRAD_BUCKET_MB,
        streams: bool | None = None,
        plan=None,
        compile=None,  # noqa: A002 - the option's name
        mesh_groups: MeshGroups | None = None,
        seed: int = 0,
        offload: str = "off",
    ):
        super().__init__()
        self.gm = program.gm
        self.program = program
        self.rank, self.world_size, self.group = rank, world_size, group
        self.local_batch, self.duplication = local_batch, duplication
        self.input_names = list(program.input_forms)
        self.input_forms = dict(program.input_forms)
        self.plan = plan
        self.param_shards = {f"gm.{path}": shard for path, shard in program.param_shards.items()}
        self.mesh_groups = mesh_groups  # the device mesh's groups (a plan on several axes), else None
        self.run_group = mesh_groups if mesh_groups is not None else group  # what the program runs on
        self.bucket_mb = bucket_mb
        self.zero = ZeroShards(self.gm, program.zero, group)  # the split parameters (hidup.codegen.zero)
        # the host copies the optimizer steps when it is offloaded (hidup.codegen.offload), else None
        self.offload = OffloadedOptimizer(self._stepped()) if offload == "optimizer" else None
        self.bucketers = (
            _bucketers(self.gm, program, group, mesh_groups, bucket_mb, self.zero) if world_size > 1 else []
        )
        self.bucketer = self.bucketers[0] if self.bucketers else None
        self.batch_dims = batch_dims
        self.copy_groups = None
        self.side_pass = _side_pass(self.gm) if duplication else None
        if duplication:
            self.copy_groups = copy_groups or (self.run_group, self.run_group)
            device = device_of(self.gm)
            use_streams = device.type == "cuda" if streams is None else streams
            self.runner = StagedCopies(self.gm, device) if use_streams else SequentialCopies(self.gm)
            if use_streams and self.runner.num_stages < program.num_stages:
                warnings.warn(
                    f"duplication: the generated program has {self.runner.num_stages} of the plan's "
                    f"{program.num_stages} stages (the trace orders some op after an op of a later "
                    f"stage), so the copies overlap less than the search assumed",
                    stacklevel=2,
                )
        self._run = (self.gm,)  # what forward calls without duplication (a tuple: not a submodule)
        self.compile_backend = None
        self.set_compile(compile)
        # random ops draw as on one device (hidup.rules.random): one run-time key per copy
        self.rng_seed, self.rng_step = seed, 0
        if program.random_ops:
            for c in (0, 1):
                self.register_buffer(f"rng_key_{c}", random.make_key(seed, 0, c, device_of(self.gm)), persistent=False)

    @property
    def rng_keys(self) -> list[torch.Tensor] | None:
        """The run-time key of each copy (copy 0's alone without duplication), or None without random ops."""
        return [self.rng_key_0, self.rng_key_1] if self.program.random_ops else None

    def begin_step(self) -> None:
        """Make the next run draw step ``rng_step``'s random values, then count the step.  ``forward``
        calls it (except while a CUDA graph is captured); a caller that replays a captured step
        (:class:`hidup.codegen.GraphedStep`) calls it before each replay.  Set ``rng_step`` to draw a
        given step's values (a resumed job sets it to its step)."""
        if self.rng_keys is None:
            return
        for key in self.rng_keys:
            key[1].fill_(self.rng_step & 0xFFFFFFFF)
        self.rng_step += 1

    def _with_key(self, values: list, copy: int = 0) -> list:
        return values + [self.rng_keys[copy]] if self.rng_keys is not None else values

    def set_compile(self, compile) -> None:  # noqa: A002 - the option's name
        """Run the program through ``torch.compile`` (``True``: inductor, or a backend name such as
        ``"aot_eager"``) or eagerly (``False``/``None``); see :mod:`hidup.codegen.compiled`.
        Compilation happens on the next call (the first step after this one is slow)."""
        backend = backend_of(compile)
        self.compile_backend = backend
        if self.duplication:
            self.runner.compile(backend)
        elif backend is None:
            self._run = (self.gm,)
        else:
            # one graph per gradient bucket where buckets are synced, so that they overlap the backward
            replicated = self.program.replicated if self.bucketers else []
            segment_of = bucket_segments(self.gm, replicated, self.bucket_mb)
            confine_links(self.gm, lambda node: segment_of.get(node.name, 0))
            self._run = (compile_segments(self.gm, segment_of, backend),)

    # -- running
    def _bind(self, args, kwargs) -> list:
        if len(args) > len(self.input_names):
            raise TypeError(
                f"compiled module takes {len(self.input_names)} inputs ({self.input_names}), got {len(args)}"
            )
        values = list(args) + [None] * (len(self.input_names) - len(args))
        for k, v in kwargs.items():
            if k not in self.input_names:
                raise TypeError(f"compiled module got an unexpected input {k!r}; inputs: {self.input_names}")
            values[self.input_names.index(k)] = v
        return values

    def program_inputs(self, *args, **kwargs) -> list:
        """What the program (``gm``, copy 0's without duplication) takes for these module inputs: the
        inputs by name, then the run-time key of its random ops if it has any."""
        return self._with_key(self._bind(args, kwargs))

    def forward(self, *args, **kwargs) -> torch.Tensor:
        values = self._bind(args, kwargs)
        self._reduce_in(self._reduce_dtype())
        if self.program.random_ops and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            self.begin_step()
        if not self.duplication:
            with using_group(self.run_group):
                return self._run[0](*self._with_key(values))
        dims = self.batch_dims if self.batch_dims is not None else [0] * len(values)
        blocks = []
        for name in self.input_names:
            form = self.input_forms[name]
            d = dims[self.input_names.index(name)]
            # a local input already holds `pieces` of the batch dim's world_size blocks (module doc of
            # hidup.codegen.duplicate): its copies take half of each of the blocks it holds
            pieces = _pieces(form, d, self.mesh_groups, self.world_size) if self.local_batch and form is not None else 1
            blocks.append(self.world_size // pieces)
        inputs_of = lambda c: self._with_key(copy_inputs(values, dims, blocks, c), c)  # noqa: E731
        if self.side_pass is None:
            return self.runner(inputs_of, self.copy_groups)
        gm, keys = self.side_pass
        sums = None
        for c, group in enumerate(self.copy_groups):
            with using_group(group):
                part = gm(*inputs_of(c))
            sums = part if sums is None else [a + b for a, b in zip(sums, part)]
        with using_copy_sums(dict(zip(keys, sums))):
            return self.runner(inputs_of, self.copy_groups)

    # -- helpers
    def _reduce_dtype(self) -> torch.dtype | None:
        """bfloat16 where the program reduces gradients in bf16 and a bf16 autocast is on for this
        forward (:mod:`hidup.precision`), else None: the dtype this step's gradient syncs sum in."""
        if self.program.reduce_dtype != "bf16":
            return None
        kind = device_of(self.gm).type
        on = torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == torch.bfloat16
        return torch.bfloat16 if on else None

    def _reduce_in(self, dtype: torch.dtype | None) -> None:
        """Make the gradient bucketers sum the next backward's gradients in ``dtype`` (None: their own)."""
        for bucketer in self.bucketers:
            bucketer.reduce_dtype = dtype

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The true loss (sum over ranks of the local losses), detached."""
        return collectives.all_reduce_raw(loss.detach(), self.group)

    def _stepped(self) -> list[nn.Parameter]:
        """The tensors on the device that an optimizer of this module steps: its trainable parameters, each
        one ZeRO splits replaced by this rank's rows of it (:mod:`hidup.codegen.zero`)."""
        return self.zero.optimizer_parameters([p for p in self.parameters() if p.requires_grad])

    def optimizer_parameters(self) -> list[nn.Parameter]:
        """What an optimizer of this module steps: its trainable parameters, each one ZeRO splits
        replaced by this rank's rows of it (:mod:`hidup.codegen.zero`), and with the optimizer offloaded
        the host copies of those (:mod:`hidup.codegen.offload`)."""
        stepped = self._stepped()
        return self.offload.optimizer_parameters(stepped) if self.offload is not None else stepped

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Make ``optimizer`` (built over :meth:`optimizer_parameters`) copy the gradients to the host and
        the weights back around each step when it is offloaded, then all-gather the parameters ZeRO
        splits; returns it.  Nothing to do without either."""
        if self.offload is not None:  # first: ZeRO's gather reads the rows the copy back writes
            self.offload.bind(optimizer)
        if self.zero:
            self.zero.bind(optimizer)
        return optimizer

    @contextlib.contextmanager
    def no_sync(self):
        """Skip the gradient all-reduce of replicated parameters (accumulate locally)."""
        with contextlib.ExitStack() as stack:
            for bucketer in self.bucketers:
                stack.enter_context(bucketer.no_sync())
            yield

    def code(self) -> str:
        """The generated Python of this rank's program."""
        return self.gm.code


def _pieces(form, dim, mesh: MeshGroups | None, world: int) -> int:
    """Into how many pieces ``form`` cuts dim ``dim`` (a local input holds one of them)."""
    if isinstance(form, Layout):
        return math.prod(n for f, n in zip(form.forms, mesh.mesh) if f.is_gather and f.dim == dim)
    return world if form.is_gather and form.dim == dim else 1


def _bucketers(
    gm, program: RankProgram, group, mesh: MeshGroups | None, bucket_mb: float, zero: ZeroShards | None = None
) -> list[GradBucketer]:
    """The gradient bucketers of the replicated parameters: one over ``group`` (reduce-scattering the
    gradients of ZeRO-2's parameters, :mod:`hidup.codegen.zero`); on a mesh one per set of axes the
    parameters are ``replicate`` on (:mod:`hidup.codegen.grads`)."""
    if mesh is None:
        return [GradBucketer([gm.get_parameter(p) for p in program.replicated], group, bucket_mb, zero=zero)]
    by_axes: dict[tuple[int, ...], list] = {}
    for path in program.replicated:
        by_axes.setdefault(program.replicate_axes[path], []).append(gm.get_parameter(path))
    out = []
    for axes, params in by_axes.items():
        if len(axes) == len(mesh.mesh):
            over = mesh.world
        elif len(axes) == 1:
            over = mesh.axes[axes[0]]
        else:
            over = tuple(mesh.axes[k] for k in axes)
        out.append(GradBucketer(params, over, bucket_mb))
    return out


def _side_pass(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[int]] | None:
    """The part of a copy's program that computes the values :func:`hidup_copy_sum` adds across the
    two copies (counts of labels: no parameter, no gradient), as its own module returning them, with
    their keys; None when the program has none.  Duplication runs it on both copies' inputs first
    and hands each copy the sums (:mod:`hidup.copies`)."""
    sums = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is hidup_copy_sum]
    if not sums:
        return None
    needed: set[torch.fx.Node] = set()
    stack = [n.args[0] for n in sums]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        stack.extend(n.all_input_nodes)
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" or n in needed:
            env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output([env[n.args[0]] for n in sums])
    return torch.fx.GraphModule(gm, graph, "CopySums"), [n.args[1] for n in sums]


def device_of(module: nn.Module) -> torch.device:
    """The device of ``module``'s first parameter or buffer (the CPU when it has none)."""
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    return torch.device("cpu")


def _model_device(model: nn.Module) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def _positional(model: nn.Module, example_inputs) -> list:
    values = forward_inputs(model, example_inputs)
    return values


@dataclass(frozen=True)
class CompileOptions(OptionSet):
    """How a rank program is built and run (:func:`compile` takes them as keywords too).

    ``local_batch``: the inputs given at run time are this rank's slice, not the global batch.
    ``duplication``: run two half-batch copies (None: as the plan says).  ``batch_dims`` gives each
    forward input's batch dim for duplication (default 0 for every tensor; None keeps an input
    whole).  ``bucket_mb``: gradient bucket size.  ``device`` defaults to the model's.  ``streams``:
    duplication's two copies on two CUDA streams (None: on CUDA).  ``copy_groups``: two existing
    process groups for the copies (else duplication creates them on CUDA; a process that compiles
    many modules can reuse one pair of communicators for all of them).  ``compile`` runs the program
    through ``torch.compile``: ``True`` for inductor, a backend name (``"aot_eager"``), or ``False``
    for eager fx code (:mod:`hidup.codegen.compiled`; ``module.set_compile`` switches later).
    ``recompute`` lists the layers (block labels) whose forward runs again in the backward (None:
    the plan's ``recompute``; :mod:`hidup.codegen.recompute`), ``recompute_selective`` those whose
    forward runs again but for the outputs its matmuls, attention and activation form changes saved
    (None: the plan's ``recompute_selective``).  ``reshard`` lists the parameters (``param``
    node names) whose converted copies are made again in the backward instead of kept (None: the plan's
    ``reshard``; True: every parameter the plan stores split; :mod:`hidup.codegen.reshard`).  ``seed``:
    the seed of the random ops (dropout), which draw the single device's values whatever the plan
    (:mod:`hidup.rules.random`; ``module.rng_step`` is the step they draw next).  ``zero``: the ZeRO
    stage of the replicated parameters (None: the plan's ``zero``; 0 none; 1 or 2 that stage for each
    whose rows the world divides; a dict of ``param`` node names; :mod:`hidup.codegen.zero`).
    ``reduce_dtype``: the dtype the float32 parameters' gradients are summed over ranks in while a bf16
    autocast is on (``"fp32"`` or ``"bf16"``; None: the plan's ``reduce_dtype``; :mod:`hidup.precision`).
    whose rows the world divides; a dict of ``param`` node names; :mod:`hidup.codegen.zero`).  ``prefetch``:
    issue the gathers of stored-split parameters one unit (layer) ahead of their use, asynchronously on
    CUDA (:mod:`hidup.codegen.prefetch`; exact: it only moves them earlier; None: as the plan was searched,
    ``plan.options["prefetch"]``, on where it does not say).  ``offload``: where Adam's state lives,
    ``"off"`` (the device) or ``"optimizer"`` (the host, stepped by the CPU; :mod:`hidup.codegen.offload`;
    None: the plan's ``offload``)."""

    local_batch: bool = False
    duplication: bool | None = None
    batch_dims: list | None = None
    bucket_mb: float = GRAD_BUCKET_MB
    device: torch.device | str | None = None
    streams: bool | None = None
    copy_groups: tuple | None = None
    compile: bool | str = False
    recompute: list | tuple | None = None
    recompute_selective: list | tuple | None = None
    reshard: list | tuple | bool | None = None
    seed: int = 0
    zero: int | dict | None = None
    reduce_dtype: str | None = None
    prefetch: bool | None = None
    offload: str | None = None
    WHAT = "compile"


def compile(  # noqa: A001
    model: nn.Module,
    plan,
    rank: int,
    world_size: int,
    example_inputs,
    group=None,
    options: CompileOptions | None = None,
    **changes,
) -> HidupModule:
    """The module rank ``rank`` of ``world_size`` trains under ``plan`` (see module docstring), built
    with ``options`` (:class:`CompileOptions`) updated by the keyword ``changes``.

    ``example_inputs`` hold the global batch (as for tracing).  Every rank of ``group`` must call
    this (duplication creates two process groups on CUDA, one per copy, unless the options pass
    ``copy_groups``)."""
    opts = CompileOptions.of(options, **changes)
    _check_world(plan, rank, world_size, group)
    offload = _offload_request(plan, opts.offload)
    duplication = bool(getattr(plan, "duplication", False)) if opts.duplication is None else opts.duplication
    device = torch.device(opts.device) if opts.device is not None else _model_device(model)
    mesh = tuple(getattr(plan, "mesh", None) or ())
    mesh = mesh if len(mesh) > 1 else None
    if mesh is not None and math.prod(mesh) != world_size:
        raise CompileError(f"the plan's device mesh {mesh} holds {math.prod(mesh)} ranks, not world_size={world_size}")

    values = _positional(model, example_inputs)
    dims = opts.batch_dims if opts.batch_dims is not None else [0] * len(values)
    if len(dims) != len(values):
        raise CompileError(f"batch_dims has {len(dims)} entries for {len(values)} forward inputs")
    traced, copies = _trace_for(model, plan, values, dims, world_size, mesh, duplication)
    duplication = copies is not None
    program = build_rank_program(traced, plan, rank, world_size, copies, replace(opts, device=device))

    streams, copy_groups = opts.streams, opts.copy_groups
    staged = device.type == "cuda" if streams is None else streams
    groups = None if mesh is None else mesh_groups(mesh, rank, group, device.type)
    if not (duplication and staged and world_size > 1):
        copy_groups = None
    else:
        copy_groups = _copy_groups(copy_groups, mesh, groups, rank, world_size, group, device)
    return HidupModule(
        program,
        rank=rank,
        world_size=world_size,
        group=group,
        local_batch=opts.local_batch,
        duplication=duplication,
        copy_groups=copy_groups,
        batch_dims=dims,
        bucket_mb=opts.bucket_mb,
        streams=streams,
        plan=plan,
        compile=opts.compile,
        mesh_groups=groups,
        seed=opts.seed,
        offload=offload,
    )


def _offload_request(plan, offload: str | None) -> str:
    """The offload the module runs with: ``offload``, or the plan's where it is None."""
    if offload is None:
        return getattr(plan, "offload", "off")
    if offload not in ("off", *OFFLOADS):
        raise CompileError(f"offload={offload!r}: give 'off' or one of {', '.join(map(repr, OFFLOADS))}")
    return offload


def _check_world(plan, rank: int, world_size: int, group) -> None:
    """Refuse a rank, world size or process group that does not match the job or the plan."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise CompileError(f"rank {rank} / world size {world_size}: need 0 <= rank < world_size")
    initialized = dist.is_available() and dist.is_initialized()
    if collectives.world_of(group) != world_size and initialized:
        raise CompileError(f"world_size={world_size} but the process group has {collectives.world_of(group)} ranks")
    if initialized and collectives.rank_of(group) != rank:
        raise CompileError(f"compile(rank={rank}) but this process is rank {collectives.rank_of(group)} of its group")
    if world_size > 1 and not initialized:
        raise CompileError(
            f"world_size={world_size} needs an initialized process group "
            f"(hidup.runtime.launch or torch.distributed.init_process_group)"
        )
    plan_world = getattr(plan, "world_size", world_size)
    if plan_world != world_size:
        raise CompileError(f"the plan was searched for world size {plan_world}, not {world_size}; search again")


def _trace_for(model: nn.Module, plan, values: list, dims: list, world_size: int, mesh, duplication: bool):
    """(traced step, copy axis or None): the half-batch trace of one copy when duplication is on and
    exact (else a warning says why it is off), the whole step otherwise, checked against the plan."""
    if duplication:
        traced = trace_copy(model, tuple(values), world_size, batch_dims=dims, mesh=mesh)
        inputs = [n.name for n in traced.graph.nodes if n.op == "input"]
        names = [n.name for n in traced.gm.graph.nodes if n.op == "placeholder"]
        copies = copy_axis(traced.graph, {name: d for name, d in zip(names, dims) if name in inputs})
        if copies.exact:
            return traced, copies
        warnings.warn(f"hidup.compile: duplication is off: {copies.reason}", stacklevel=3)
    traced = trace_module(model, tuple(values), world_size, mesh=mesh)
    check = getattr(plan, "check", None)
    if check is not None:
        check(traced.graph)
    return traced, None


def _copy_groups(copy_groups, mesh, groups, rank: int, world_size: int, group, device: torch.device):
    """The two communicators of duplication's copies: the ones given (checked), else new ones."""
    if mesh is not None:
        if copy_groups is not None and not all(isinstance(g, MeshGroups) and g.mesh == mesh for g in copy_groups):
            raise CompileError(f"copy_groups of a mesh plan must be two MeshGroups of the mesh {mesh}")
        return copy_groups or (groups, mesh_groups(mesh, rank, group, device.type, copy=1))
    if copy_groups is not None:
        if len(copy_groups) != 2 or any(collectives.world_of(g) != world_size for g in copy_groups):
            raise CompileError(f"copy_groups must be two process groups of the {world_size} ranks of the job")
        return copy_groups
    ranks = list(range(world_size)) if group is None else dist.get_process_group_ranks(group)
    return (dist.new_group(ranks), dist.new_group(ranks))
