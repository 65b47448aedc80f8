"""Checks that need a real CUDA device (run by scripts/gpu_check.sh); skipped without one."""

from __future__ import annotations

import pytest
import torch

import tritondelegate as td
from tritondelegate.models import MLP, demo_decoder

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STRICT = td.LowerConfig(
    propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True, error_on_per_call_copies=True)
)
# GPU clock cycles ``torch.cuda._sleep`` spins for: about 50 ms, far longer than the host needs to
# enqueue a call or a copy. A stream kept busy this long shows what was queued behind what.
CYCLES = 10**8


def _delegate_calls(lowered, method: int = 0) -> int:
    """Delegate instructions of a lowered method: each replays one graph per call once captured (every
    tensor they touch lies in the arena or the program's segments)."""
    from tritondelegate.program import InstrKind

    return sum(i.kind == InstrKind.DELEGATE for i in lowered.program.methods[method].instructions)


@pytest.mark.parametrize("model_name", ["mlp", "decoder"])
def test_resident_constants_on_a_side_stream_twice(tmp_path, model_name):
    """The seed's end-to-end check: resident constants, no per-call constant copies (it would raise at
    lower()), two calls on a non-default stream, matching eager; memory flat after the first call."""
    if model_name == "mlp":
        torch.manual_seed(0)
        model, args = MLP([256, 512, 64]).eval(), (torch.randn(8, 256),)
    else:
        model, args = demo_decoder()
    lowered = td.lower(torch.export.export(model, args), partitioner=td.TritonPartitioner("cuda:0"), config=STRICT)
    path = tmp_path / "m.tdp"
    lowered.save(path)
    stream = torch.cuda.Stream()
    program = td.load(path, devices="cuda")
    assert program.device == "cuda"
    method = program.load_method("forward", stream=stream)
    with torch.no_grad():
        expected = model(*args)
    input_bytes = sum(a.numel() * a.element_size() for a in args)
    allocated = None
    for _ in range(2):
        out = method(*args, stream=stream)
        stream.synchronize()
        torch.testing.assert_close(out, expected, atol=1e-3, rtol=1e-3)
        assert method.stats.call_h2d_bytes == input_bytes  # inputs only: no constant bytes per call
        if allocated is None:
            allocated = torch.cuda.memory_allocated()
        else:
            assert torch.cuda.memory_allocated() == allocated
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert method.stats.load_h2d_bytes >= weights


def test_device_inputs_and_outputs_stay_on_the_device(tmp_path):
    torch.manual_seed(0)
    model = MLP([64, 128, 32]).eval().cuda()
    x = torch.randn(4, 64, device="cuda")
    cfg = td.PropagateDeviceConfig(skip_h2d_for_constants=True, skip_h2d_for_method_inputs=True,
                                   skip_d2h_for_method_outputs=True)
    cpu_model = MLP([64, 128, 32]).eval()
    cpu_model.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    lowered = td.lower(torch.export.export(cpu_model, (x.cpu(),)), config=td.LowerConfig(propagate_device=cfg))
    method = lowered.load(devices="cuda").load_method()
    out = method(x)
    assert out.device.type == "cuda"
    assert method.stats.call_h2d_bytes == 0 and method.stats.call_d2h_bytes == 0
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(td.InputError, match="must be on cuda:0"):
        method(x.cpu())
    # On a side stream: the call is queued there, behind what the caller queued first, and waits for
    # nothing. The current stream sleeps longer: a launch wrongly queued there would not have run when
    # the side stream is done.
    stream, current = torch.cuda.Stream(), torch.cuda.current_stream()
    method(x, stream=stream)  # once before: the caching allocator then holds a block for its output there
    torch.cuda.synchronize()
    torch.cuda._sleep(4 * CYCLES)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(CYCLES)
    out = method(x, stream=stream)
    assert not stream.query()  # the call returned without waiting for its stream
    stream.synchronize()
    assert not current.query()
    with torch.cuda.stream(stream):  # read on the side stream: only what ran there is done
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    torch.cuda.synchronize()


def test_cuda_allocator_copies_on_the_given_stream_and_synchronize_waits_for_it_only():
    """The copy is queued on the given stream (behind a sleep there) without blocking; synchronize
    waits for that stream while the current stream still sleeps; the data read back on that stream
    is the copied data (a copy queued on the current stream would still be waiting)."""
    from tritondelegate.runtime.allocator import CudaAllocator

    allocator = CudaAllocator()
    buf = allocator.allocate(64 << 20, 0, 256)
    assert buf.data_ptr() % 256 == 0
    src = torch.randn(16 << 20).pin_memory()
    stream, current = torch.cuda.Stream(), torch.cuda.current_stream()
    torch.cuda._sleep(4 * CYCLES)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(CYCLES)
    allocator.copy_from_host(buf.view(torch.float32), src, stream)
    assert not stream.query()  # queued behind the sleep, not waited for
    allocator.synchronize(0, stream)
    assert not current.query()  # waited for the copy stream, not the whole device
    with torch.cuda.stream(stream):
        copied = buf.view(torch.float32).cpu()
    torch.testing.assert_close(copied, src)
    torch.cuda.synchronize()


def test_cuda_graph_replay_matches_eager_on_a_side_stream(tmp_path):
    model, args = demo_decoder()
    lowered = td.lower(torch.export.export(model, args), config=STRICT)
    stream = torch.cuda.Stream()
    method = lowered.load(devices="cuda").load_method(stream=stream, graphs=True)
    delegates = _delegate_calls(lowered)
    assert delegates >= 1
    with torch.no_grad():
        expected = model(*args)
        for i in range(4):
            out = method(*args, stream=stream)
            stream.synchronize()
            torch.testing.assert_close(out, expected, atol=1e-3, rtol=1e-3)
            # Run plain on the first call, recorded on the second, every delegate replayed from the third.
            assert method.stats.graph_replays_per_call == (delegates if i >= 2 else 0)


@pytest.mark.parametrize("graphs", [False, True])
def test_generation_with_the_kv_cache_on_the_device(tmp_path, graphs):
    """Prefill + decode share the weights and the cache on the GPU: tokens match eager, each decode
    step moves only ids and position in and logits out, and the direct launches take over."""
    from tritondelegate.generate import Generator
    from tritondelegate.models import export_prefill_decode, generate_eager, kv_cache_decoder

    model = kv_cache_decoder(seed=0, max_seq_len=64)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 16))
    lowered = td.lower(export_prefill_decode(model, 16), config=STRICT)
    lowered.save(tmp_path / "kv.tdp")
    program = td.load(tmp_path / "kv.tdp", devices="cuda")
    expected, _ = generate_eager(model, prompt, 12)
    result = Generator(program, graphs=graphs).generate(prompt, 12)
    assert result.tokens[0].tolist() == expected[0].tolist()
    decode = program.load_method("decode")
    assert decode.stats.load_h2d_bytes == 0
    last = result.steps[-1]
    assert last.h2d_bytes == 16 and last.d2h_bytes == model.cfg.vocab_size * 4
    program.reset_state()
    assert Generator(program, graphs=graphs).generate(prompt, 12).tokens[0].tolist() == expected[0].tolist()


def test_direct_launches_replace_the_jit_after_the_first_call():
    model, args = demo_decoder()
    lowered = td.lower(torch.export.export(model, args), config=STRICT)
    method = lowered.load(devices="cuda").load_method()
    with torch.no_grad():
        expected = model(*args)
        for _ in range(3):
            torch.testing.assert_close(method(*args), expected, atol=1e-3, rtol=1e-3)
    runners = [step.runner for kind, step in method._sizes[()].steps if hasattr(step, "runner")]
    assert runners and all(r._direct for r in runners)  # every launch prebound to its compiled kernel


def test_kernel_binaries_load_without_compiling(tmp_path):
    """A program carrying binaries for this GPU's arch runs its first call in a fresh process with an
    empty Triton cache without compiling a kernel: Triton's cache then holds only what the program
    brought (cubin + metadata), no intermediate of a compilation (ttir, ptx)."""
    import os
    import subprocess
    import sys

    major, minor = torch.cuda.get_device_capability()
    model, args = demo_decoder()
    config = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True),
                            kernel_archs=(f"sm_{major}{minor}",))
    td.lower(torch.export.export(model, args), config=config).save(tmp_path / "m.tdp")
    child = ("import sys, torch, tritondelegate as td\n"
             "m = td.load(sys.argv[1], devices='cuda').load_method()\n"
             "print(m(torch.zeros(1, 16, dtype=torch.long)).abs().sum().item())\n")
    cache = tmp_path / "triton-cache"
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", child, str(tmp_path / "m.tdp")], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    suffixes = {name.rsplit(".", 1)[-1] for _, _, files in os.walk(cache) for name in files
                if not name.startswith("__grp__")}
    assert not suffixes & {"ttir", "ttgir", "llir", "ptx"}, suffixes  # nothing was compiled


def test_dynamic_prompt_length_on_the_gpu_with_graphs(tmp_path):
    """A decoder exported for every prompt length up to 48: compiled kernels, direct launches and
    one CUDA graph per size, each size matching eager; device memory does not grow per size."""
    from torch.export import Dim

    model, _ = demo_decoder(seed=0, max_seq_len=64)
    ep = torch.export.export(model, (torch.randint(0, 256, (1, 16)),),
                             dynamic_shapes={"input_ids": {1: Dim("seq", max=48)}})
    lowered = td.lower(ep, config=td.LowerConfig(propagate_device=td.PropagateDeviceConfig(
        skip_h2d_for_constants=True)))
    lowered.save(tmp_path / "dyn.tdp")
    program = td.load(tmp_path / "dyn.tdp", devices="cuda")
    method = program.load_method("forward", graphs=True)
    delegates = _delegate_calls(lowered)
    assert delegates >= 1
    before = program.memory()
    for i, n in enumerate((1, 48, 17, 31, 17, 17)):
        ids = torch.randint(0, 256, (1, n))
        with torch.no_grad():
            torch.testing.assert_close(method(ids), model(ids), atol=1e-4, rtol=1e-4)
        # Each size records its graphs on its second call; only the third call at 17 replays them.
        assert method.stats.graph_replays_per_call == (delegates if i == 5 else 0)
    assert program.memory() == before
