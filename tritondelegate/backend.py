"""The Triton delegate backend: a delegate subgraph -> a launch plan (see ``plan.py``).

Nodes are lowered in order through the kernel registry; ``getitem`` picks an element of a
multi-output node. Fusion (``kernels/fusion.py``) then rewrites the recorded launches, the builder
packs temporaries into the delegate's scratch block, and the traffic model (``kernels/traffic.py``)
records each launch's bytes and FLOPs.
"""

from __future__ import annotations

import operator

import torch.fx

from .errors import LoweringError
from .kernels import fusion, registry, traffic
from .kernels.builder import LaunchBuilder
from .plan import DelegatePlan

BACKEND_ID = "TritonBackend"


def build_plan(
    nodes: list[torch.fx.Node],
    inputs: list[torch.fx.Node],
    outputs: list[torch.fx.Node],
    *,
    aliases: dict[int, int] | None = None,
) -> DelegatePlan:
    """Lower ``nodes`` into one launch plan over ``inputs`` and ``outputs``.

    A node marked ``node.meta["td_inplace"] = True`` (by the reinplacing pass) updates its ``self``
    operand in place. ``aliases``: pass a dict to let an output that is exactly a delegate input
    written in place alias it instead of being copied out: ``aliases[output_position] =
    input_position`` is filled in, and the plan's outputs (``Base.OUTPUT`` indices,
    ``output_nbytes``) are then the remaining ones, numbered consecutively. ``None`` (default):
    every output gets its own buffer."""
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
    # Passes over the launch records: norms into matmul prologues, pointwise chains, matmul epilogues.
    b.records = fusion.fuse(b.records, *b.effects(), view=b.view).records
    # The traffic model of every launch, whatever was fused (kernels/traffic.py).
    return traffic.annotate(b.finish(aliases))


def symbolic_refusal(node: torch.fx.Node) -> str | None:
    """Why ``node`` cannot be lowered with the symbolic sizes it has (None: it can), found by lowering
    it alone over fresh inputs. Partitioners call it for nodes whose shapes depend on a method's
    symbols, so that such a node stays on the host with the reason instead of failing ``lower()``."""
    graph = torch.fx.Graph()
    inputs: dict[torch.fx.Node, torch.fx.Node] = {}

    def placeholder(arg: torch.fx.Node) -> torch.fx.Node:
        if arg not in inputs:
            inputs[arg] = graph.placeholder(f"in{len(inputs)}")
            inputs[arg].meta["val"] = arg.meta.get("val")
        return inputs[arg]

    copy = graph.node_copy(node, placeholder)
    nodes, outputs = [copy], [copy]
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):  # each tensor element through a getitem, as in the graph
        outputs = []
        for i in (i for i, v in enumerate(val) if isinstance(v, torch.Tensor)):
            outputs.append(graph.call_function(operator.getitem, (copy, i)))
            outputs[-1].meta["val"] = val[i]
        nodes += outputs
    try:
        build_plan(nodes, list(inputs.values()), outputs)
    except Exception as exc:  # noqa: BLE001 - any failure is the reason it stays on the host
        return f"cannot be lowered with dynamic shapes: {exc.__cause__ or exc}"
    return None
