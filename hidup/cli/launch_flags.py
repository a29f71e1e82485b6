"""The launch flags of the commands that start ranks, and the :class:`LaunchOptions` they make.

``--nnodes --cpn --node-rank --master-addr --master-port --backend --dist-timeout``
(:mod:`hidup.runtime.launch`: flags win over the environment's ``NNODES``, ``CPN``, ...);
:func:`launch_options` turns them into the :class:`hidup.runtime.launch.LaunchOptions` that
:func:`hidup.runtime.launch.launch` takes.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from hidup.runtime.launch import DEFAULT_TIMEOUT_S, LaunchOptions

__all__ = ["add_launch_args", "positive_seconds", "launch_options", "launch_kwargs"]


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--nnodes --cpn --node-rank --master-addr --master-port --backend --dist-timeout``."""
    g = parser.add_argument_group("launch")
    g.add_argument("--nnodes", type=int, default=None, help="number of nodes (env NNODES; default 1)")
    g.add_argument("--cpn", type=int, default=None, help="processes (cards) per node (env CPN)")
    g.add_argument("--node-rank", type=int, default=None, help="this node's index (env NODERANK)")
    g.add_argument("--master-addr", default=None, help="address of node 0 (env MASTER_ADDR)")
    g.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="rendezvous port on node 0 (env MASTER_PORT; 0 on one node: a free port)",
    )
    g.add_argument("--backend", default=None, choices=["nccl", "gloo"], help="default: nccl with CUDA, else gloo")
    g.add_argument(
        "--dist-timeout",
        type=positive_seconds,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds before a collective waiting on a dead rank fails (default {DEFAULT_TIMEOUT_S:g})",
    )


def positive_seconds(text: str) -> float:
    """``--dist-timeout``'s value: a positive number of seconds (argparse reports anything else)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive number of seconds")
    return value


def launch_options(args: argparse.Namespace) -> LaunchOptions:
    """The :class:`LaunchOptions` of parsed :func:`add_launch_args` flags (announcing the start)."""
    return LaunchOptions(
        nnodes=args.nnodes,
        cpn=args.cpn,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        backend=args.backend,
        timeout_s=args.dist_timeout,
        announce=True,
    )


def launch_kwargs(args: argparse.Namespace) -> dict:
    """The keyword arguments of :func:`hidup.runtime.launch.launch` from parsed :func:`add_launch_args`
    flags (:func:`launch_options` as a dict)."""
    return dataclasses.asdict(launch_options(args))
