"""Lowering configuration: the public ``LowerConfig`` and ``PropagateDeviceConfig``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

from .kernels.target import Target
from .kernels.target import resolve as resolve_target

Flag = "bool | dict[str, bool]"


class PerCallCopyWarning(UserWarning):
    """A constant or a state buffer is copied between host and device on every call (named, with
    the reason)."""


class PerCallCopyError(ValueError):
    """Raised instead of :class:`PerCallCopyWarning` with ``error_on_per_call_copies=True``."""


@dataclass
class PropagateDeviceConfig:
    """Where values live around device delegates. Each flag is a bool or a dict by method name.

    * ``skip_h2d_for_method_inputs``: inputs read only by delegates on one device arrive from the
      caller as device tensors; no copy.
    * ``skip_d2h_for_method_outputs``: delegate outputs that only the method output reads are
      returned as device tensors; no copy.
    * ``skip_h2d_for_constants``: constants read only by delegates on one device stay resident in
      that device's arena, loaded once at load; no per-call copy. Costs device memory for as long as
      the method is loaded (one copy per method that keeps it resident).
    * ``state_on_device`` (default True): program state (a buffer some method mutates, e.g. a KV
      cache) that only delegates of one device read and write lives in that device's state segment,
      one instance per loaded program shared by every method, updated in place; never copied per
      call. False keeps it on the host: copied to the device and back on every call.
    * ``error_on_per_call_copies``: raise :class:`PerCallCopyError` instead of warning when a
      constant or a state buffer is still copied per call.
    """

    skip_h2d_for_method_inputs: bool | dict[str, bool] = False
    skip_d2h_for_method_outputs: bool | dict[str, bool] = False
    skip_h2d_for_constants: bool | dict[str, bool] = False
    error_on_per_call_copies: bool = False
    state_on_device: bool | dict[str, bool] = True

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            ok = isinstance(value, bool) or (
                f.name != "error_on_per_call_copies"
                and isinstance(value, dict)
                and all(isinstance(k, str) and isinstance(v, bool) for k, v in value.items())
            )
            if not ok:
                raise TypeError(f"PropagateDeviceConfig.{f.name} must be a bool or a dict of method name -> bool, got {value!r}")

    def flag(self, name: str, method: str) -> bool:
        value = getattr(self, name)
        default = name == "state_on_device"  # the one flag that is on unless turned off
        return value.get(method, default) if isinstance(value, dict) else value

    def any_skip(self, method: str) -> bool:
        return any(self.flag(n, method) for n in SKIP_FLAGS)


SKIP_FLAGS = ("skip_h2d_for_method_inputs", "skip_d2h_for_method_outputs", "skip_h2d_for_constants")


@dataclass
class LowerConfig:
    """How ``lower()`` builds the program.

    * ``propagate_device``: one :class:`PropagateDeviceConfig`, or a dict of them by method name (a
      method without an entry gets the defaults).
    * ``enable_non_cpu_memory_planning``: plan device values into per-device arenas (default). When
      False, delegates take host tensors and copy into their own device buffers inside every call
      (the behaviour before device-aware planning); skip flags are then an error.
    * ``external_constants``: True, or a callable ``(fqn) -> bool``, to write those constants to a
      safetensors file next to the program instead of into it.
    * ``alloc_graph_input`` / ``alloc_graph_output``: plan device memory for copied method inputs /
      for device outputs (default True). A skipped input is never planned.
    * ``fold_constants``: compute subgraphs that depend on no method input (causal masks, rotary
      tables for a static shape) once in ``lower()`` and store them as constants (default True).
    * ``kernel_archs``: GPU archs (``"sm_80"``, ``"sm_86"``, ``"sm_89"``, ``"sm_90"``, ``"sm_100"``) to
      compile every kernel variant for at lower time, on this machine, GPU or not; the binaries go in
      the program file and a GPU with the same Triton runs them without compiling (default: none).
    * ``target``: the GPU whose SM count and shared memory choose tile sizes and pipeline depths
      (``kernels/target.py``): a ``Target``, a name (``"h100"``, ``"a100"``, ``"l4"``, ...), or None
      for this machine's GPU (H100 when it has none).
    """

    propagate_device: PropagateDeviceConfig | dict[str, PropagateDeviceConfig] = field(
        default_factory=PropagateDeviceConfig
    )
    enable_non_cpu_memory_planning: bool = True
    external_constants: bool | Callable[[str], bool] = False
    alloc_graph_input: bool = True
    alloc_graph_output: bool = True
    fold_constants: bool = True
    kernel_archs: tuple[str, ...] = ()
    target: Target | str | None = None

    def __post_init__(self):
        if self.target is not None:
            resolve_target(self.target)  # an unknown name fails here, naming the known ones

    def device_config(self, method: str) -> PropagateDeviceConfig:
        pd = self.propagate_device
        if isinstance(pd, dict):
            for key, value in pd.items():
                if not isinstance(value, PropagateDeviceConfig):
                    raise TypeError(f"LowerConfig.propagate_device[{key!r}] must be a PropagateDeviceConfig")
            cfg = pd.get(method, PropagateDeviceConfig())
        elif isinstance(pd, PropagateDeviceConfig):
            cfg = pd
        else:
            raise TypeError("LowerConfig.propagate_device must be a PropagateDeviceConfig or a dict of them by method name")
        if not self.enable_non_cpu_memory_planning:
            on = [n for n in SKIP_FLAGS if cfg.flag(n, method)]
            if on:
                raise ValueError(
                    f"method {method!r}: {', '.join(on)} needs device memory planning, but "
                    "LowerConfig(enable_non_cpu_memory_planning=False) turns it off: device delegates "
                    "then take host tensors and copy inside the delegate, so there is no device value "
                    "to skip a copy for. Enable planning or drop the flag."
                )
        return cfg

    def is_external(self, fqn: str) -> bool:
        ext = self.external_constants
        return bool(ext(fqn)) if callable(ext) else bool(ext)
