"""Exactness sweep: every plan style the command line offers, on the `transformers` families people
train, against one device.

    python -m exp.exactness [--worlds 2 4] [--models t5 gemma2 ...] [--out sweep.json]

Each model is a tiny float64 configuration of its family, built by the factory
``exp.exactness:<name>`` (usable as ``hidup verify --model exp.exactness:t5``): DeepSeek-V3 (latent
attention, group-limited routing, keys filled through slices), Gemma-2 (logit soft-capping, sliding
windows), Gemma-3 (sliding and full layers), T5 (encoder-decoder, dropout 0.1 on), Phi-3 (fused
query-key-value and gate-up projections), GPT-NeoX (parallel residual, partial rotary), Qwen3-MoE
and OLMoE.  Every job is ``hidup verify`` of one (model, style, world, duplication): the searched
plan and each forced style of :data:`hidup.search.STYLES`, duplication on and off; all jobs of one
world run in one launch of gloo ranks.  A job passes when the loss and every gradient are within
``--tolerance`` (relative, as ``verify`` measures them; the `transformers` losses are computed in
float32, so the default allows float32 rounding); a failing job names the first op that differs.

With ``--hash-seeds K`` it also traces each model in K fresh interpreters, each started under another
``PYTHONHASHSEED`` and fixing it as the command-line entry points do
(:func:`hidup.cli.hashseed.fix_hash_seed`), and checks that every trace has the same fingerprint, the one a
plan records: a plan made by one run is accepted by the next.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch
import transformers as T

if __package__ in (None, ""):  # run as a script, not as exp.<module>: `exp` comes from the checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from exp.rank_models import CausalLMStep

VOCAB, SEQ, BATCH, PAD = 96, 16, 8, 3


def _lm(model) -> tuple:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[:, :PAD] = -100
    return CausalLMStep(model).double().train(), (ids, labels)


def _sizes(**changes) -> dict:
    sizes = dict(
        num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return {**sizes, **changes}


def deepseek_v3():
    return _lm(T.DeepseekV3ForCausalLM(T.DeepseekV3Config(**_sizes(
        num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, experts_implementation="eager"))))  # fmt: skip


def gemma2():
    return _lm(T.Gemma2ForCausalLM(T.Gemma2Config(**_sizes(head_dim=8, sliding_window=4))))


def gemma3():
    return _lm(T.Gemma3ForCausalLM(T.Gemma3TextConfig(**_sizes(
        head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"]))))  # fmt: skip


def t5():
    config = T.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.1,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return _lm(T.T5ForConditionalGeneration(config))


def phi3():
    return _lm(T.Phi3ForCausalLM(T.Phi3Config(**_sizes())))


def gpt_neox():
    return _lm(T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**_sizes(rotary_pct=0.5))))


def qwen3_moe():
    return _lm(T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**_sizes(
        moe_intermediate_size=16, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
        experts_implementation="eager"))))  # fmt: skip


def olmoe():
    return _lm(T.OlmoeForCausalLM(T.OlmoeConfig(**_sizes(num_experts=8, num_experts_per_tok=2,
                                                          experts_implementation="eager"))))  # fmt: skip


MODELS = ("deepseek_v3", "gemma2", "gemma3", "t5", "phi3", "gpt_neox", "qwen3_moe", "olmoe")


def _run_jobs(ctx, jobs: list) -> list:
    """Every job on the ranks of ``ctx`` (rank 0 returns the rows)."""
    from hidup.runtime.verify import parity_report

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    rows = []
    for model, style, dup, tolerance in jobs:
        try:
            report = parity_report(
                ctx, f"exp.exactness:{model}", {}, style=style, duplication=dup, locate=tolerance,
                profile="h200x4-nvlink",
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a job that cannot run is a row of the sweep, not its end
            report = {"error": f"{type(e).__name__}: {e}"}
        if ctx.rank == 0:
            rows.append({"model": model, "style": style, "duplication": dup, **_summary(report, tolerance)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _summary(report: dict, tolerance: float) -> dict:
    if "error" in report:
        return {"ok": False, "error": report["error"][:400]}
    out = {
        "ok": report["loss_rel"] <= tolerance and report["grad_rel"] <= tolerance,
        "ran_duplication": report["duplication"],
        "kinds": report["kinds"],
        "loss_rel": report["loss_rel"],
        "grad_rel": report["grad_rel"],
    }
    if report.get("first_mismatch"):
        out["first_mismatch"] = report["first_mismatch"]
    return out


_FINGERPRINT = """
from hidup.cli.hashseed import fix_hash_seed
fix_hash_seed()
import warnings
import hidup
import exp.exactness as E
warnings.simplefilter("ignore")
model, inputs = getattr(E, {model!r})()
print(hidup.trace(model, inputs, world_size=2).fingerprint())
"""


def fingerprints(model: str, seeds: int) -> list[str]:
    """The trace's fingerprint in ``seeds`` fresh interpreters, each under another hash seed."""
    import subprocess

    out = []
    for seed in range(1, seeds + 1):
        env = dict(os.environ, PYTHONHASHSEED=str(seed))
        run = subprocess.run([sys.executable, "-c", _FINGERPRINT.format(model=model)], env=env, capture_output=True,
                             text=True, timeout=600, check=True)  # fmt: skip
        out.append(run.stdout.split()[-1])
    return out


def main(argv=None) -> int:
    from exp.exactness import _run_jobs  # by its module's name, which the spawned ranks import
    from hidup.runtime.launch import launch
    from hidup.search import STYLES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="*", default=[2, 4], help="world sizes (none: only --hash-seeds)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--styles", nargs="+", default=["searched", *STYLES])
    p.add_argument("--tolerance", type=float, default=1e-4, help="relative (float32 losses: 4 x 128 x eps_32 ~ 6e-5)")
    p.add_argument("--hash-seeds", type=int, default=0, help="also trace each model under K hash seeds")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    stable = {}
    for model in args.models if args.hash_seeds else ():
        prints = fingerprints(model, args.hash_seeds)
        stable[model] = len(set(prints)) == 1
        print(f"{model}: {len(set(prints))} fingerprint(s) over {args.hash_seeds} hash seeds", flush=True)
    jobs = [(m, s, d, args.tolerance) for m in args.models for s in args.styles for d in (False, True)]
    jobs = jobs if args.worlds else []
    rows = []
    for world in args.worlds:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(CPN=str(world), NNODES="1", NODERANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        for row in launch(_run_jobs, jobs, env=env, backend="gloo", timeout_s=600.0)[0]:
            rows.append({"world": world, **row})
    bad = [r for r in rows if not r["ok"]] + [{"model": m, "hash_seeds": "fingerprints differ"} for m, ok in
                                              stable.items() if not ok]  # fmt: skip
    print(f"{len(rows)} jobs, {len(bad)} failed", flush=True)
    for r in bad:
        print("FAILED", json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            record = {"torch": torch.__version__, "transformers": T.__version__, "rows": rows, "hash_seeds": stable}
            json.dump(record, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
