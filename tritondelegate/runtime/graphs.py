"""Replaying a delegate's launches as one captured graph.

Planned memory makes this safe: every tensor a delegate touches sits at a fixed arena address for the
life of the loaded method, so the launches recorded once stay valid for every later call. On CUDA the
recording is a ``torch.cuda.CUDAGraph``; on the simulated device it is the list of launches with their
arguments frozen, which is what a graph replays (a later change of address would be missed the same way).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(runner, inputs: list[torch.Tensor], outputs: list[torch.Tensor], allocator,
            device_index: int) -> Callable[[object], None]:
    """Record ``runner(inputs, outputs)``; returns ``replay(stream)``. Run it once normally first, so
    every kernel is compiled before capture."""
    if allocator.host_memory:
        frozen = runner.bound_launches(inputs, outputs)

        def replay_simulated(stream) -> None:
            with runner.scope():
                for launch, args, constexprs in frozen:
                    launch(*args, **constexprs)

        return replay_simulated

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.device(device_index):
        with torch.cuda.graph(graph):  # captures on a side stream; nothing runs now
            runner(inputs, outputs)

    def replay_cuda(stream) -> None:
        with torch.cuda.stream(allocator.stream(device_index, stream)):
            graph.replay()

    return replay_cuda
