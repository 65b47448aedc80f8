"""Zero padding read by convolutions is their own padding: a pass of ``fusion.fuse`` over a delegate's
launch records, first of all (the convolutions may then take epilogues as any other).

TensorFlow's ``SAME`` padding (transformers' MobileNet, EfficientNet's ``ZeroPad2d``, timm's
``Conv2dSame``) and causal 1-D convolutions (``F.pad(x, (k - 1, 0))``) pad explicitly, often on one
side only, and convolve with no padding of their own: a ``pad`` launch writes the padded copy of the
activation and the convolution reads it back. The convolution kernel already reads its input through
masks (``conv.conv2d_kernel``: whatever lies outside the input is 0), so reading the unpadded input with
its padding grown by the zeros before it computes the same values, the zeros after it being past the
input's end (the output's size stays the convolution's own):

    P:  t = pad(x, zeros: before b, after a)        t scratch, read by convolutions only
    C:  u = conv(t, w, padding p)          ->  C':  u = conv(x, w, padding p + b)      P dropped

P merges into its readers when all of these hold:
  - P pads with zeros and crops nothing (``pad.ZeroPad``), on the convolution's spatial dims only
    (the last three of NCDHW, the last two of NCHW, the last of a 1-D convolution's NCL: a causal video
    VAE's ``F.pad(x, (1, 1, 1, 1, 2, 0))`` before a k3 Conv3d folds into its padding (2, 1, 1) on the
    input's side: the kernel reads depth -2 and -1 as zeros);
  - t's buffer is scratch, not a delegate output nor viewed by one, and every launch that touches it
    after P is a convolution reading exactly t as its input (not a transposed one: its padding crops
    its output instead);
  - no launch between P and the last of them writes x (P's read of x moves to each convolution).
"""

from __future__ import annotations

from dataclasses import replace

from . import conv as cv
from .pad import ZeroPad
from .refs import LaunchRecord, new_launch, same_view


def merge_pads(records: list[LaunchRecord], touched: list[set[int]], writes: list[set[int]], keep: set[int]
               ) -> tuple[list[LaunchRecord], list[set[int]], list[set[int]], bool]:
    """The records with each zero pad that only convolutions read merged into them; their ``touched``
    and ``writes``; and whether any was merged."""
    records, touched = list(records), [set(t) for t in touched]
    gone: set[int] = set()
    for p, record in enumerate(records):
        pad = record.op
        if not isinstance(pad, ZeroPad) or pad.out.buffer in keep or not _spatial_only(pad):
            continue
        readers = [k for k in range(p + 1, len(records)) if pad.out.buffer in touched[k]]
        if not readers or not all(_reads_padded(records[k].op, pad) for k in readers):
            continue
        if any(pad.x.buffer in writes[k] for k in range(p + 1, readers[-1])):
            continue
        for k in readers:
            records[k] = _unpadded(records[k], pad, record.launch.op)
            touched[k] = (touched[k] - {pad.out.buffer}) | {pad.x.buffer}
        gone.add(p)
    keep_at = [i for i in range(len(records)) if i not in gone]
    return ([records[i] for i in keep_at], [touched[i] for i in keep_at], [writes[i] for i in keep_at],
            bool(gone))


def _spatial_only(pad: ZeroPad) -> bool:
    """Whether the pad's zeros are on the spatial dims of an NCDHW, NCHW or NCL tensor only (not its batch
    or channels)."""
    return (pad.x.ndim in (3, 4, 5) and not any(pad.before[:2])
            and tuple(pad.x.shape[:2]) == tuple(pad.out.shape[:2]))


def _reads_padded(op, pad: ZeroPad) -> bool:
    """Whether ``op`` is a (not transposed) convolution whose input is exactly the pad's result and no
    other operand of it lives in that buffer. A transposed convolution's padding crops its output: zeros
    before its input are not that."""
    return (isinstance(op, cv.ConvOp) and not op.transposed and same_view(op.x, pad.out)
            and all(r.buffer != pad.out.buffer for r in op.reads[1:]) and op.c.buffer != pad.out.buffer)


def _unpadded(record: LaunchRecord, pad: ZeroPad, pad_name: str) -> LaunchRecord:
    """The convolution of ``record`` reading the pad's input, its padding grown by the zeros before."""
    op = record.op
    if pad.x.ndim == 3:  # a 1-D convolution runs as 2-D over a height of 1: its padding is (0, p)
        padding = (op.padding[0], op.padding[1] + pad.before[2])
    else:  # (h, w) or (d, h, w): one entry per spatial dim
        padding = tuple(p + b for p, b in zip(op.padding, pad.before[2:], strict=True))
    grown = replace(op, x=pad.x, padding=padding)
    grid, args, constexprs = grown.launch()
    fused = LaunchRecord(new_launch(grown.kernel, grid, args, constexprs, f"{pad_name}+{record.launch.op}"))
    fused.op = grown
    return fused
