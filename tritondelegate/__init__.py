"""tritondelegate: torch.export programs -> Triton-kernel delegates with device-resident constants.

    ep = torch.export.export(model, example_args)
    lowered = td.lower(ep, partitioner=td.TritonPartitioner(device="cuda:0"),
                       config=td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True)))
    lowered.save("model.tdp")
    method = td.load("model.tdp").load_method("forward")
    out = method(*example_args)

The lowering side (``lower``, the partitioners, the passes) is imported on first use, so a process
that only runs programs (``td.load``) never loads it.
"""

from .lazy import lazy_exports

_EXPORTS = {
    # lowering side
    "lower": "lower", "LoweredProgram": "lower",
    "LowerConfig": "config", "PropagateDeviceConfig": "config",
    "PerCallCopyWarning": "config", "PerCallCopyError": "config",
    "Partitioner": "partitioner", "PartitionResult": "partitioner",
    "DelegationSpec": "partitioner", "TritonPartitioner": "partitioner",
    "LoweringError": "errors", "Target": "kernels.target",
    "quantize_linears": "quantize", "QuantizedLinear": "quantize", "QuantizedEmbedding": "quantize",
    "QuantizedExperts": "quantize",
    # runtime side
    "load": "runtime", "DeviceAllocator": "runtime", "InputError": "runtime",
    "register_allocator": "runtime",
    "ProgramError": "errors",
    "Generator": "generate", "Sampling": "sampling", "PromptLookup": "lookup",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
