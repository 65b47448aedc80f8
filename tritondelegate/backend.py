"""The Triton delegate backend: a delegate subgraph -> a launch plan (see ``plan.py``).

Nodes are lowered in order through the kernel registry; ``getitem`` picks an element of a
multi-output node. The builder packs temporaries into the delegate's scratch block.
"""

from __future__ import annotations

import operator

import torch.fx

from .kernels import registry
from .kernels.builder import LaunchBuilder, LoweringError
from .plan import DelegatePlan

BACKEND_ID = "TritonBackend"


def build_plan(
    nodes: list[torch.fx.Node], inputs: list[torch.fx.Node], outputs: list[torch.fx.Node]
) -> DelegatePlan:
    b = LaunchBuilder(inputs, outputs)
    for node in nodes:
        b.current = node
        if node.target is operator.getitem:
            b.bind(node, b.values(node.args[0])[node.args[1]])
            continue
        spec = registry.lookup(node.target)
        if spec is None:
            raise LoweringError(f"node {node.name!r} ({node.target}) has no kernel in the registry")
        try:
            spec.lower(b, node)
        except LoweringError:
            raise
        except Exception as exc:
            raise LoweringError(f"lowering node {node.name!r} ({node.target}) failed: {exc}") from exc
    b.current = None
    return b.finish()
