"""The launch flags of the commands that start ranks, and the :class:`LaunchOptions` they make.

``--nnodes --cpn --node-rank --master-addr --master-port --backend --dist-timeout``
(:mod:`hidup.runtime.launch`: flags win over the environment's ``NNODES``, ``CPN``, ...);
:func:`launch_options` turns them into the :class:`hidup.runtime.launch.LaunchOptions` that
:func:`hidup.runtime.launch.launch` takes.
"""

from __future__ import annotations

import argparse

from hidup.runtime.launch import LaunchOptions, add_launch_args, launch_kwargs, positive_seconds

__all__ = ["add_launch_args", "positive_seconds", "launch_options", "launch_kwargs"]


def launch_options(args: argparse.Namespace) -> LaunchOptions:
    """The :class:`LaunchOptions` of parsed :func:`add_launch_args` flags (announcing the start)."""
    return LaunchOptions(**launch_kwargs(args))
