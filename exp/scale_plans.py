"""Plans for models that need many GPUs, searched on meta tensors: Llama-3-8B and Mixtral-8x7B shapes.

Each model is a ``transformers`` model built from a config with the published shapes (no weights are
allocated: the model lives on the ``meta`` device), wrapped so that its forward returns the
causal-LM loss.  It is traced with ``hidup.trace`` (torch.export) at the job's world size and
searched with the DP under a built-in profile, a per-GPU memory budget and bf16 (autocast) compute.
For each job the script records the trace and search seconds, the prediction, the memory by the
memory model, and how the plan shards the model: the signature kind of every op (data, tensor,
expert, replicated) and, for the weights of attention, MLP and experts, whether they are stored
sharded.

Jobs (sequence 4096, one sequence per GPU unless ``--batch-per-gpu`` says more):

* ``llama3-8b``: hidden 4096, 32 layers, 32 heads with 8 key/value heads, MLP 14336, vocab 128256;
* ``mixtral-8x7b``: hidden 4096, 32 layers, 32/8 heads, 8 experts of MLP 14336, top-2, vocab 32000.

Model FLOPs utilization (MFU) is computed from the model's shape, not from the plan, the way the published
figures are (:func:`model_flops`)::

    MFU = (6 N + 12 L h s) x tokens / (GPUs x 989 TFLOP/s x predicted step seconds)

``N`` the parameters outside the input embedding and the LM head, counting of the routed experts only the
``top_k / experts`` share a token uses (active parameters), ``L`` layers, ``h`` hidden size, ``s`` sequence
length (``12 L h s``: attention's scores and weighted sum, forward and backward, without causal savings),
``tokens`` the step's tokens over all GPUs and 989 TFLOP/s the H100 SXM's and the H200's dense bf16 peak.
The published MFU of comparable runs are printed beside it (:data:`ANCHORS`).

World sizes beyond the profile's measured group sizes are priced from the nearest measured group
with the ring factor (``hidup.profiler.profile``): 16 GPUs are then priced as one NVLink domain,
which a real 2-node cluster is not.

Writes ``--out``/scale_plans.json and scale_plans.md (the tables and each plan's summary; docs/scale.md
says what they show).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import resource
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

import hidup
from hidup.ir import RECOMPUTE_CHOICES, ZERO_CHOICES, parse_mesh
from hidup.precision import REDUCE_DTYPES
from hidup.rules.dispatch import DISPATCHERS
from hidup.search import SearchError

ROOT = Path(__file__).resolve().parent.parent

JOBS = {
    "llama3-70b": dict(
        family="llama",
        config=dict(
            num_hidden_layers=80,
            hidden_size=8192,
            num_attention_heads=64,
            num_key_value_heads=8,
            intermediate_size=28672,
            vocab_size=128256,
            max_position_embeddings=8192,
            rope_theta=500000.0,
        ),
    ),
    "llama3-8b": dict(
        family="llama",
        config=dict(
            num_hidden_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            vocab_size=128256,
            max_position_embeddings=8192,
            rope_theta=500000.0,
        ),
    ),
    "mixtral-8x7b": dict(
        family="mixtral",
        config=dict(
            num_hidden_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            vocab_size=32000,
            max_position_embeddings=32768,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
    ),
    "deepseek-v3": dict(
        family="deepseek_v3",
        config=dict(
            num_hidden_layers=61,
            first_k_dense_replace=3,
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_attention_heads=128,
            num_key_value_heads=128,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            n_routed_experts=256,
            n_shared_experts=1,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            vocab_size=129280,
            max_position_embeddings=4096,
        ),
    ),
}

PEAK_FLOPS = 989e12  # dense bf16 FLOP/s of one H100 SXM or H200 (datasheets: 989.5), the MFU's denominator
ANCHORS = {  # published MFU of comparable training runs (bf16, H100), printed beside a job's
    "llama3-70b": "torchtitan ~40%, Megatron-LM ~45%",
    "llama3-8b": "torchtitan 39% (compiled)",
    "mixtral-8x7b": "Megatron-Core 44%",
}

FAMILIES = {  # family -> (transformers config class, model class) names
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}


CAUSAL_ATTENTION = "hidup_causal"  # the attention implementation registered by causal_attention()


def causal_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """``transformers`` attention as trainers run it on sequences without padding: the key/value heads
    repeated to the query heads, then ``scaled_dot_product_attention(..., is_causal=True)`` without a
    mask tensor (flash attention's kernel).  An exported model otherwise passes its causal mask as a
    tensor, which torch runs on a slower kernel that reads the mask; on a sequence without padding the two
    compute the same thing."""
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout, scale=scaling, is_causal=True
    )
    return out.transpose(1, 2).contiguous(), None


class CausalLMStep(torch.nn.Module):
    """``model(input_ids, labels).loss``: the training step's loss as the forward's value."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def build(name: str, layers: int | None, batch: int, seq: int, attention: str = "causal"):
    """(step module on meta, example inputs) of job ``name`` for ``batch`` sequences of ``seq`` tokens;
    ``layers`` overrides the layer count; ``attention`` ``"causal"`` (:func:`causal_attention`) or
    ``"mask"`` (``transformers``' own ``sdpa``, which exports its causal mask as a tensor)."""
    import transformers

    job = JOBS[name]
    config = dict(job["config"])
    if layers is not None:
        config["num_hidden_layers"] = layers
    if attention == "causal":
        transformers.AttentionInterface.register(CAUSAL_ATTENTION, causal_attention)
    config["attn_implementation"] = CAUSAL_ATTENTION if attention == "causal" else "sdpa"
    config_name, model_name = FAMILIES[job["family"]]
    cfg, cls = getattr(transformers, config_name)(**config), getattr(transformers, model_name)
    with torch.device("meta"):
        model = CausalLMStep(cls(cfg))
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, (ids, ids)


def step(
    name: str,
    layers: int | None = None,
    seq: int = 4096,
    batch: int = 1,
    attention: str = "causal",
    world_size: int = 1,
    device=None,
):
    """Job ``name`` as a hidup model factory (``--model exp.scale_plans:step --model-arg name=llama3-70b``):
    the step on the meta device with ``batch`` sequences per rank, as the job's plan records it, so that
    ``hidup peak --plan`` rebuilds it.  ``device`` is ignored: the model stays on meta (no weights)."""
    if name not in JOBS:
        raise ValueError(f"unknown job {name!r}; jobs: {', '.join(sorted(JOBS))}")
    return build(name, layers, batch=batch * world_size, seq=seq, attention=attention)


def model_flops(model: torch.nn.Module, config: dict, seq: int) -> float:
    """FLOPs of one token's training step by the published convention (module docstring):
    ``6 N + 12 L h s``, ``N`` the parameters outside the embedding and the LM head with the routed
    experts' counted at ``top_k / experts`` (their active share)."""
    experts = config.get("num_local_experts") or config.get("n_routed_experts")
    active = config.get("num_experts_per_tok", 1) / experts if experts else 1.0
    params = 0.0
    for name, p in model.named_parameters():
        if "embed_tokens" in name or "lm_head" in name:
            continue
        params += p.numel() * (active if ".mlp.experts." in name else 1.0)
    return 6 * params + 12 * config["num_hidden_layers"] * config["hidden_size"] * seq


def mfu(token_flops: float, tokens: int, world: int, step_seconds: float) -> float:
    """Model FLOPs utilization of a step of ``tokens`` tokens over ``world`` GPUs taking
    ``step_seconds`` (module docstring; ``token_flops`` from :func:`model_flops`)."""
    return token_flops * tokens / (world * PEAK_FLOPS * step_seconds)


def _weight_role(param: str) -> str | None:
    for key, role in (
        ("experts", "experts"),
        ("mlp_gate_weight", "router"),
        ("self_attn", "attention"),
        ("mlp", "mlp"),
        ("embed_tokens", "embedding"),
        ("lm_head", "lm_head"),
    ):
        if key in param:
            return role
    return None


def describe_plan(plan, graph) -> dict:
    """Counts of signature kinds over call nodes, and per weight role how its parameters are stored."""
    kinds = Counter(plan.choices[n.name].kind for n in graph.nodes if n.op == "call")
    dispatchers = Counter(
        DISPATCHERS.get(f.impl, "")
        for n in graph.nodes
        if n.target == "routed_experts"
        for f in (plan.choices[n.name].axes or (plan.choices[n.name],))
        if f.kind == "expert"
    )
    stored: dict[str, Counter] = {}
    for n in graph.nodes:
        if n.op != "param":
            continue
        role = _weight_role(n.name)
        if role is None:
            continue
        form = plan.choices[n.name].outputs[0]
        stored.setdefault(role, Counter())[str(form)] += 1
    return {"kinds": dict(kinds), "stored": {k: dict(v) for k, v in stored.items()}, "dispatchers": dict(dispatchers)}


def plan_levers(plan) -> list[str]:
    """The memory levers ``plan`` uses, as ``hidup show`` names them: recomputed layers, resharded
    weights, ZeRO, the optimizer offloaded to the host."""
    levers = []
    if plan.recompute:
        levers.append(f"{len(plan.recompute)} layers recomputed")
    if plan.recompute_selective:
        levers.append(f"{len(plan.recompute_selective)} layers recomputed selectively")
    if plan.reshard:
        levers.append(f"{len(plan.reshard)} weights resharded")
    if plan.zero_stage:
        levers.append(f"ZeRO-{plan.zero_stage} on {len(plan.zero)} weights")
    if plan.offload != "off":
        levers.append(f"{plan.offload} offloaded to the host")
    return levers


def cpu_seconds() -> float:
    """CPU seconds of this process and of the children it waited for (the searches it forks)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


@dataclass(frozen=True)
class RunOptions:
    """How every run of one command is traced and searched (the command's flags)."""

    profile: str | None = None  # None: NODE_PROFILE for one axis, CLUSTER_PROFILE for a mesh
    precision: str = "bf16"
    layers: int | None = None  # override the layer count (a quick check)
    seq: int = 4096
    batch_per_gpu: int = 1  # sequences per GPU
    reduce_dtype: str = "fp32"  # the dtype gradients are summed over ranks in (hidup search --reduce-dtype)
    zero: str = "auto"  # hidup search --zero
    recompute: str = "auto"  # hidup search --recompute
    compiled: bool = False  # priced as inductor runs the program (hidup search --compiled)
    attention: str = "causal"  # "causal" (causal_attention) or "mask" (transformers' sdpa, a mask tensor)
    plans: Path | None = None  # also save each plan there as NAME@MESH:GB.json

    def profile_for(self, mesh: tuple[int, ...]) -> str:
        return self.profile or (CLUSTER_PROFILE if len(mesh) > 1 else NODE_PROFILE)


def run_job(name: str, mesh: tuple[int, ...], memory_gb: float, opts: RunOptions) -> dict:
    """One run's row: job ``name`` on ``mesh`` under ``memory_gb`` GB per GPU (0: no budget)."""
    world = math.prod(mesh)
    profile, seq, layers, precision = opts.profile_for(mesh), opts.seq, opts.layers, opts.precision
    batch = world * opts.batch_per_gpu
    source_args = {
        "name": name,
        "seq": seq,
        "batch": opts.batch_per_gpu,
        "attention": opts.attention,
        **({"layers": layers} if layers else {}),
    }  # the factory's arguments, which the plan records (hidup peak --plan rebuilds the model from them)
    model, inputs = step(world_size=world, **source_args)
    config = {**JOBS[name]["config"], **({"num_hidden_layers": layers} if layers else {})}
    token_flops = model_flops(model, config, seq)
    t0, c0 = time.perf_counter(), cpu_seconds()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = hidup.trace(model, inputs, world_size=world, mesh=mesh if len(mesh) > 1 else None)
    trace_s, trace_cpu_s = time.perf_counter() - t0, cpu_seconds() - c0
    row = {
        "job": name,
        "world": world,
        "mesh": "x".join(map(str, mesh)),
        "layers": layers or JOBS[name]["config"]["num_hidden_layers"],
        "batch": batch,
        "seq": seq,
        "nodes": len(graph.nodes),
        "fallbacks": list(graph.fallbacks),
        "host": f"{os.cpu_count()} CPUs ({platform.machine()}, Python {platform.python_version()}), "
        f"torch {torch.__version__}",
        "profile": profile,
        "precision": precision,
        "reduce_dtype": opts.reduce_dtype,
        "zero": opts.zero,
        "recompute": opts.recompute,
        "compiled": opts.compiled,
        "attention": opts.attention,
        "memory_budget_gb": memory_gb or None,
        "trace_s": round(trace_s, 2),
        "trace_cpu_s": round(trace_cpu_s, 2),
    }
    t0, c0 = time.perf_counter(), cpu_seconds()
    try:
        plan = hidup.search(
            graph,
            profile,
            memory_budget=memory_gb * 1e9 if memory_gb else None,
            precision=precision,
            reduce_dtype=opts.reduce_dtype,
            zero=opts.zero,
            recompute=opts.recompute,
            compiled=opts.compiled,
            model_source=("exp.scale_plans:step", source_args),
        )
    except SearchError as e:  # recorded: the budget or the mesh admits no plan
        row.update(search_s=round(time.perf_counter() - t0, 2), error=str(e))
        print(f"{name} world {world}: trace {trace_s:.1f} s, no plan: {e}", flush=True)
        return row
    search_s, search_cpu_s = time.perf_counter() - t0, cpu_seconds() - c0
    if opts.plans is not None:
        opts.plans.mkdir(parents=True, exist_ok=True)
        plan.save(opts.plans / f"{name}@{'x'.join(map(str, mesh))}:{memory_gb:g}.json")
    row.update(
        {
            "search_s": round(search_s, 2),
            "search_cpu_s": round(search_cpu_s, 2),
            "predicted_ms": round(plan.predicted["total"] * 1e3, 1),
            "mfu": round(mfu(token_flops, batch * seq, world, plan.predicted["total"]), 4),
            "exposed_comm_ms": round(plan.predicted["exposed_comm"] * 1e3, 1),
            "times_ms": {k: round(v * 1e3, 1) for k, v in plan.predicted.items()},
            "zero_stage": plan.zero_stage,
            "recomputed": len(plan.recompute),
            "recomputed_selective": len(plan.recompute_selective),
            "memory_gib": round(plan.memory["total"] / 2**30, 1),
            "peak_gib": round(plan.memory.get("peak", plan.memory["total"]) / 2**30, 1),
            "memory_parts_gib": {k: round(v / 2**30, 2) for k, v in plan.memory.items()},
            "sent_gb": round(plan.sent_bytes() / 1e9, 2),
            "duplication": plan.duplication,
            "levers": plan_levers(plan),
            "optimizer_ms": round(plan.predicted["optimizer"] * 1e3, 1),
            "host_memory_gib": round(plan.memory.get("host", 0.0) / 2**30, 1),
            **describe_plan(plan, graph),
            "summary": hidup.show(plan, graph),
        }
    )
    print(
        f"{name} world {world}: trace {trace_s:.1f} s, search {search_s:.1f} s ({search_cpu_s:.1f} s CPU), "
        f"predicted {row['predicted_ms']} ms, MFU {row['mfu']:.1%} (published: {ANCHORS.get(name, '-')}), "
        f"exposed communication {row['exposed_comm_ms']} ms, ZeRO {row['zero_stage']}, "
        f"{row['recomputed']} layers recomputed whole and {row['recomputed_selective']} selectively, "
        f"memory {row['memory_gib']} GiB (peak bound {row['peak_gib']} GiB), sent {row['sent_gb']} GB per GPU, "
        f"kinds {row['kinds']}, dispatchers {row['dispatchers']}, "
        f"stored {row['stored']}, levers {row['levers'] or 'none'}",
        flush=True,
    )
    return row


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.1%}"


def write_markdown(rows: list[dict], args, path: Path) -> None:
    lines = [
        "# Plans for models that need many GPUs",
        "",
        "Commands: " + ", ".join(f"`{c}`" for c in dict.fromkeys(r.get("command", "") for r in rows)) + "  ",
        f"Host: {rows[0]['host']}; "
        f"profiles {', '.join(f'`{p}`' for p in dict.fromkeys(r['profile'] for r in rows))}, {rows[0]['precision']}, "
        f"sequence {rows[0]['seq']}; the sequences per GPU (batch / GPUs) and the levers of each run in its section.",
        "",
        "Models are built on the meta device from `transformers` configs with the published shapes and "
        "traced with torch.export; times are wall seconds on this host (search CPU s: CPU seconds of the "
        "process and of the searches it forks, which another job's load on the host inflates less). Memory is "
        "the memory model's "
        "per-rank sum, the peak bound its largest op's temporaries where the activations live then (what the budget "
        "constrains). World sizes beyond the profile's measured groups (16 here) are priced as one "
        "NVLink domain by the ring factor, which a real two-node cluster is not.",
        "",
        "MFU: `(6 N + 12 L h s) x tokens / (GPUs x 989 TFLOP/s x predicted step)`, N the parameters outside the "
        "embedding and the LM head (of the routed experts the active share); published: the MFU of comparable runs.",
        "",
        "| job | GPUs | budget GB | nodes | trace s | search s | search CPU s | predicted ms | MFU | published MFU "
        "| exposed comm ms | memory GiB | peak bound GiB | sent GB per GPU | ops by kind | weights stored "
        "| memory levers |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['job']} | {r.get('mesh') or r['world']} | {r['memory_budget_gb'] or '-'} | {r['nodes']} "
                f"| {r['trace_s']} | {r['search_s']} | {r.get('search_cpu_s', '-')} | no plan | - "
                f"| {ANCHORS.get(r['job'], '-')} | - | - | - | - | {r['error'].split('. Fix')[0]} | - | - |"
            )
            continue
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["kinds"].items(), key=lambda kv: -kv[1]))
        stored = "; ".join(
            f"{role}: " + ", ".join(f"{f} {c}" for f, c in forms.items()) for role, forms in r["stored"].items()
        ).replace("|", "\\|")  # a layout's axes are joined by "|", a table cell's delimiter
        levers = "not recorded" if r.get("levers") is None else ", ".join(r["levers"]) or "none"
        lines.append(
            f"| {r['job']} | {r.get('mesh') or r['world']} | {r['memory_budget_gb'] or '-'} | {r['nodes']} "
            f"| {r['trace_s']} | {r['search_s']} | {r.get('search_cpu_s', '-')} | {r['predicted_ms']} "
            f"| {_percent(r.get('mfu'))} | {ANCHORS.get(r['job'], '-')} | {r.get('exposed_comm_ms', '-')} "
            f"| {r['memory_gib']} | {r.get('peak_gib', '-')} | {r.get('sent_gb', '-')} | {kinds} "
            f"| {stored} | {levers} |"
        )
    for r in rows:
        if "summary" in r:
            budget = f"budget {r['memory_budget_gb']:g} GB" if r["memory_budget_gb"] else "no budget"
            gpus = r.get("mesh") or r["world"]
            levers = (
                f"`{r.get('command', '')}`: profile `{r['profile']}`, {r['batch'] // r['world']} sequence(s) of "
                f"{r['seq']} per GPU, gradients reduced in {r.get('reduce_dtype', 'fp32')}, ZeRO stage "
                f"{r.get('zero_stage', 0)}, {r.get('recomputed', '-')} layers recomputed whole and "
                f"{r.get('recomputed_selective', 0)} selectively, attention {r.get('attention', 'mask')}, "
                f"{'compiled' if r.get('compiled') else 'eager'}, "
                f"duplication {'on' if r.get('duplication') else 'off'}; predicted {r['predicted_ms']} ms "
                f"({', '.join(f'{k} {v}' for k, v in r.get('times_ms', {}).items())})"
            )
            lines += ["", f"## {r['job']}, {gpus} GPUs, {budget}", "", levers, "", "```", r["summary"].rstrip(), "```"]
    path.write_text("\n".join(lines) + "\n")


NODE_PROFILE, CLUSTER_PROFILE = "h200x4-nvlink", "h100x64-ib400"
DEFAULT_RUNS = (
    "llama3-8b@8",
    "llama3-8b@8:0",
    "mixtral-8x7b@8",
    "mixtral-8x7b@8:0",
    "mixtral-8x7b@16",
    "mixtral-8x7b@8:80",  # one node of 8 80 GB GPUs: fits only with the optimizer offloaded to the host
)


def parse_run(text: str, default_memory: float) -> tuple[str, tuple[int, ...], float]:
    """``name@world[:GB]`` or ``name@AxB[:GB]`` -> (job, mesh, memory budget in GB per GPU; 0 = none)."""
    try:
        name, rest = text.split("@")
        world, _, memory = rest.partition(":")
        run = (name, parse_mesh(world), float(memory) if memory else default_memory)
    except ValueError:
        raise SystemExit(
            f"scale_plans: --runs {text!r} is not NAME@WORLD[:GB] or NAME@AxB[:GB] (e.g. mixtral-8x7b@16:141, "
            "llama3-70b@8x8:80)"
        ) from None
    if name not in JOBS:
        raise SystemExit(f"scale_plans: unknown job {name!r} in --runs {text!r}; jobs: {', '.join(sorted(JOBS))}")
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--runs",
        nargs="+",
        default=list(DEFAULT_RUNS),
        help="NAME@WORLD[:GB] per run (GB: the memory budget per GPU, 0 for none; default --memory)",
    )
    p.add_argument("--layers", type=int, help="override the layer count (a quick check)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch-per-gpu", type=int, default=1, help="sequences per GPU (default 1)")
    p.add_argument(
        "--profile",
        default=None,
        help=f"profile of every run (default {NODE_PROFILE} for one axis, {CLUSTER_PROFILE} for a mesh)",
    )
    p.add_argument("--memory", type=float, default=141.0, help="default GB per GPU (H200: 141; 0: no budget)")
    p.add_argument("--precision", default="bf16", choices=("fp32", "tf32", "bf16"))
    p.add_argument(
        "--reduce-dtype",
        default="fp32",
        choices=REDUCE_DTYPES,
        help="dtype the weights' gradients are summed over ranks in (bf16 needs --precision bf16; default fp32)",
    )
    p.add_argument("--zero", default="auto", choices=ZERO_CHOICES, help="hidup search --zero (default auto)")
    p.add_argument(
        "--recompute",
        default="auto",
        choices=RECOMPUTE_CHOICES,
        help="hidup search --recompute (default auto)",
    )
    p.add_argument(
        "--compiled",
        action="store_true",
        help="price the program as inductor compiles it (hidup search --compiled; default eager, one CUDA graph)",
    )
    p.add_argument(
        "--attention",
        default="causal",
        choices=("causal", "mask"),
        help="causal: is_causal attention without a mask tensor, as trainers run it (default); mask: transformers' "
        "sdpa as it exports, the causal mask passed as a tensor (a slower kernel)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "docs")
    p.add_argument("--plans", type=Path, help="also save each run's plan as JSON in this folder")
    p.add_argument(
        "--render",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="write the tables from the scale_plans.json of earlier runs (no search)",
    )
    args = p.parse_args(argv)
    if args.batch_per_gpu < 1:
        raise SystemExit(f"scale_plans: --batch-per-gpu must be at least 1, got {args.batch_per_gpu}")
    opts = RunOptions(
        profile=args.profile,
        precision=args.precision,
        layers=args.layers,
        seq=args.seq,
        batch_per_gpu=args.batch_per_gpu,
        reduce_dtype=args.reduce_dtype,
        zero=args.zero,
        recompute=args.recompute,
        compiled=args.compiled,
        attention=args.attention,
        plans=args.plans,
    )
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    if args.render:  # no search: merge the rows of earlier runs (each ran in its own process)
        for path in args.render:
            rows += json.loads(path.read_text())
        for r in rows:  # where a run wrote its files does not matter to a reader
            r["command"] = re.sub(r" --(out|plans) \S+", "", r.get("command", ""))
        (args.out / "scale_plans.json").write_text(json.dumps(rows, indent=1) + "\n")
    else:
        for name, mesh, memory in (parse_run(r, args.memory) for r in args.runs):
            rows.append(run_job(name, mesh, memory, opts))
            rows[-1]["command"] = " ".join(["python exp/scale_plans.py", *args.argv])
            (args.out / "scale_plans.json").write_text(json.dumps(rows, indent=1) + "\n")  # kept if a later run is cut
    write_markdown(rows, args, args.out / "scale_plans.md")
    print(f"wrote {args.out / 'scale_plans.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
